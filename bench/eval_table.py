"""One markdown table of `eyas eval` results: every BENCH-SETTING.json under the directories given (and their
subdirectories, where `eyas eval --draft A --draft B` puts each draft).

    python bench/eval_table.py RUN/eval RUN/eval-dflash ...

Per result: its directory's name, the benchmark, the draft's method, tau (pooled and per request), the speedup
against plain decoding in the same process (and both rates), acceptance by position, tau after a repeated context
and elsewhere, n-gram lookup's tau on the same turns, and the turns that differ from plain greedy decoding with
their largest first-token margin in steps of the logits' format (greedy results only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _num(x, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def row(path: Path) -> str | None:
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or "summary" not in doc or "settings" not in doc:
        return None
    s, st = doc["summary"], doc["settings"]
    turns = sum(len(p["turns"]) for p in doc.get("prompts", []))
    accept = " ".join(f"{x:.2f}" for x in (s.get("accept_at_position") or [])[:7])
    margins = s.get("plain_mismatch_margins") or {}
    differ = "" if "plain_mismatches" not in s else f"{s['plain_mismatches']} of {turns}"
    if margins.get("max_steps") is not None:
        differ += f" (largest margin {margins['max_steps']:.3g} steps)"
    dtype = st.get("dtype", "").removeprefix("torch.")
    bench = Path(st["bench"]).name if st["bench"].endswith(".jsonl") else st["bench"]
    return (f"| {path.parent.name} | {bench} | {doc.get('method', 'eagle3')} {st['setting']} | {turns} | "
            f"{_num(s.get('tau_pooled'))} / {_num(s.get('tau_per_request'))} | {_num(s.get('speedup_vs_plain'))}x "
            f"({_num(s.get('tokens_per_s'), 1)}; {_num(s.get('plain_tokens_per_s'), 1)}) | {accept} | "
            f"{_num(s.get('tau_in_repeats'))} / {_num(s.get('tau_elsewhere'))} | {_num(s.get('ngram_tau'))} | "
            f"{differ} | {dtype} |")


def main(dirs: list[str]) -> int:
    rows = []
    for d in dirs:
        for path in sorted(Path(d).rglob("*.json")):  # a comparison of drafts keeps each in a subdirectory
            if path.name != "summary.json" and (r := row(path)):
                rows.append(r)
    if not rows:
        print(f"no eval results under {', '.join(dirs) or '(no directory given)'}", file=sys.stderr)
        return 1
    print("| results | benchmark | draft, decoding | turns | tau (pooled / per request) | speedup (tok/s; plain) | "
          "acceptance by position | repeat / elsewhere | n-gram lookup alone | turns differing from plain greedy | "
          "dtype |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
