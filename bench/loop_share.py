"""How much of an eval's acceptance comes from the target repeating itself.

    python bench/loop_share.py RUN/eval/*.json [--ngram 8]

A small target decoding greedily often falls into a loop (SmolLM2 ends about a third of its regenerated
answers in one), and a draft predicts a loop almost perfectly: tau over such text says little about tau
over text that does not repeat. This reads `eyas eval` result files (each turn's generated tokens and the
tokens accepted per cycle) and splits the cycles in two: a cycle is "in a repeat" when the `--ngram` tokens
just before it already occurred, in that order, earlier in the same turn's output (its context is a repeat,
so what it drafts continues one). It prints, per result file, the share of cycles and tokens in repeats and
tau inside and outside them. No model is loaded: it runs anywhere in a second. (`eyas eval` reports the same
split for 8-token contexts in each summary since it was written; this reads older result files too and takes
other context lengths.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eyas.speculative.stats import repeat_split


def summarise(path: Path, n: int) -> dict:
    data = json.loads(path.read_text())
    repeat, fresh = [], []
    for prompt in data["prompts"]:
        for turn in prompt["turns"]:
            r, f = repeat_split(turn["tokens"], turn["accepted"], n)
            repeat += r
            fresh += f
    cycles = len(repeat) + len(fresh)
    tokens = sum(repeat) + sum(fresh)
    return {"file": path.name, "cycles": cycles, "tokens": tokens,
            "tau": tokens / cycles if cycles else 0.0,
            "repeat_cycle_share": len(repeat) / cycles if cycles else 0.0,
            "repeat_token_share": sum(repeat) / tokens if tokens else 0.0,
            "tau_repeat": sum(repeat) / len(repeat) if repeat else None,
            "tau_fresh": sum(fresh) / len(fresh) if fresh else None,
            "speedup": data.get("summary", {}).get("speedup_vs_plain")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="eyas eval result files (BENCH-SETTING.json)")
    p.add_argument("--ngram", type=int, default=8, help="context length that makes a repeat (default 8)")
    args = p.parse_args()
    rows = [summarise(f, args.ngram) for f in args.results if f.name != "summary.json"]
    print(f"| result | cycles | tau | cycles in repeats | tokens in repeats | tau in repeats | tau elsewhere "
          f"| speedup |  ({args.ngram}-token contexts)")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        def f(x):
            return "" if x is None else f"{x:.2f}"
        print(f"| {r['file']} | {r['cycles']} | {r['tau']:.2f} | {100 * r['repeat_cycle_share']:.1f} % | "
              f"{100 * r['repeat_token_share']:.1f} % | {f(r['tau_repeat'])} | {f(r['tau_fresh'])} | "
              f"{f(r['speedup'])} |")


if __name__ == "__main__":
    main()
