"""User prompts written by the target itself (the Magpie recipe): no dataset needed, and chat-like.

A chat model trained on conversations continues its template's opening of a user turn (for SmolLM2,
the default system prompt and `<|im_start|>user\\n`) with a plausible user request, because that is
what followed it in its own training data. Sampled at temperature < 1, SmolLM2-135M writes requests
such as "Can you help me plan a dinner party...": much closer to MT-bench than prompts built from
Python docstrings, so a draft trained on the target's answers to them sees the kind of text it
will be asked to speculate on.

The opening is found by rendering one user message holding a sentinel and cutting before it, so
any template (default system prompt included) works. Requests that hit the token limit, are empty
or repeat an earlier one (case and spacing ignored) are dropped and counted; generation goes on in
batches until `num_prompts` are kept or twice that many were written.

Openers steer a share of the requests (`data.self_prompt_openers`, `data.self_prompt_opener_share`): the
target continues its opening followed by the start of a request, such as "Write a Python function that", and
the request is that start and what the target wrote after it. A draft meant for code can so see more code
than the target's own requests hold (a few percent of SmolLM2's are about code). The share is of the kept
requests: steered requests are dropped more often (a code request runs past the token limit more often than
a question), so each batch writes steered and free requests in proportion to what each group still lacks over
the rate at which it has been kept so far, and each group is kept up to its quota. That plan depends on the
written requests alone, so a resumed run steers as an uninterrupted one does.

Results are appended to a JSONL file (one line per written request, kept or not) and flushed per
batch; a rerun reads it and continues. Batch i is sampled with seed (seed, i), so a resumed run
writes what an uninterrupted one would have.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from eyas.common import print0, progress
from eyas.data.regenerate import ResultsFile, generate_batch, read_results

SENTINEL = "\x00eyas-user-message\x00"


def user_turn_opening(template) -> list[int]:
    """Token ids of the chat template up to where the first user message's content begins."""
    text = template.render([{"role": "user", "content": SENTINEL}])
    at = text.find(SENTINEL)
    if at < 0:
        raise ValueError("the chat template does not render the user message's content; self prompts need a "
                         "template that writes user messages verbatim")
    return template.tokenizer(text[:at], add_special_tokens=False)["input_ids"]


def _key(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _verdict(rec: dict, seen: set[str]) -> str:
    """'kept', or why the written request is dropped."""
    text = str(rec.get("prompt", "")).strip()
    if rec.get("finish") != "stop":
        return "truncated"
    if not text:
        return "empty"
    if _key(text) in seen:
        return "duplicate"
    return "kept"


def _tally(records: list[dict], num_prompts: int, num_steered: int = 0) -> tuple[list[dict], dict]:
    """The kept requests in id order, and the counts per verdict: the first num_steered usable ones with an
    opener and the first num_prompts - num_steered usable ones without (a usable request over its group's
    quota is counted as kept but not returned)."""
    seen: set[str] = set()
    quota = {True: num_steered, False: num_prompts - num_steered}
    kept, counts = [], {"kept": 0, "truncated": 0, "empty": 0, "duplicate": 0}
    for rec in records:
        verdict = _verdict(rec, seen)
        counts[verdict] += 1
        if verdict == "kept":
            seen.add(_key(rec["prompt"]))
            steered = bool(rec.get("opener"))
            if quota[steered] > 0:
                quota[steered] -= 1
                kept.append({"id": rec["id"], "prompt": rec["prompt"].strip()})
    return kept, counts


def steered_quota(num_prompts: int, openers: list[str], share: float) -> int:
    """How many of the num_prompts kept requests start with an opener."""
    return round(num_prompts * share) if openers and share > 0 else 0


def plan_batch(records: list[dict], rows: int, num_prompts: int, openers: list[str], share: float) -> list[str | None]:
    """The opener (or None) of each of the next `rows` requests to write, from what was written so far: rows
    go to the steered and the free group in proportion to what each still lacks divided by the share of its
    written requests that was usable (one more of each counted, so a new group starts at 1); the steered
    rows are spread evenly over the batch and take the openers in turn."""
    num_steered = steered_quota(num_prompts, openers, share)
    if not num_steered:
        return [None] * rows
    seen: set[str] = set()
    written, usable = {True: 0, False: 0}, {True: 0, False: 0}
    for rec in records:
        steered = bool(rec.get("opener"))
        written[steered] += 1
        if _verdict(rec, seen) == "kept":
            seen.add(_key(rec["prompt"]))
            usable[steered] += 1
    lack = {True: max(0, num_steered - usable[True]), False: max(0, num_prompts - num_steered - usable[False])}
    want = {g: lack[g] * (written[g] + 1) / (usable[g] + 1) for g in (True, False)}
    total = want[True] + want[False]
    steer_rows = round(rows * want[True] / total) if total else 0
    out: list[str | None] = []
    for i in range(rows):
        if (i + 1) * steer_rows // rows > i * steer_rows // rows:
            out.append(openers[(written[True] + sum(o is not None for o in out)) % len(openers)])
        else:
            out.append(None)
    return out


def write_self_prompts(target, template, num_prompts: int, out_path: str | Path, *, temperature: float,
                       max_new_tokens: int, batch_size: int, seed: int = 0, cuda_graphs: bool = True,
                       openers: list[str] | None = None, opener_share: float = 0.0) -> tuple[list[dict], dict]:
    """Have the target write `num_prompts` distinct user requests -> ([{id, prompt}], summary). A share
    `opener_share` of the kept ones start with one of `openers` (the target writes the rest of the request)."""
    opening = user_turn_opening(template)
    openers = list(openers or [])
    tok = target.tokenizer
    opener_ids = {o: tok(o, add_special_tokens=False)["input_ids"] for o in openers}
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else template.stop_ids[0]
    device = next(target.model.parameters()).device
    max_written = 2 * num_prompts
    num_steered = steered_quota(num_prompts, openers, opener_share)
    records = sorted(read_results(out_path).values(), key=lambda r: r["id"])
    kept, counts = _tally(records, num_prompts, num_steered)
    t0, num_tokens = time.perf_counter(), 0
    if len(kept) < num_prompts and len(records) < max_written:
        sink = ResultsFile(out_path)
        bar = progress(total=num_prompts, initial=len(kept), desc="self prompts", unit="prompt")
        try:
            while len(kept) < num_prompts and len(records) < max_written:
                start = len(records)
                rows = min(batch_size, max_written - start)
                generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + start)
                starts = plan_batch(records, rows, num_prompts, openers, opener_share)
                results = generate_batch(target.model, [opening + opener_ids.get(o, []) for o in starts],
                                         max_new_tokens=max_new_tokens, stop_ids=template.stop_ids, pad_id=pad_id,
                                         temperature=temperature, generator=generator, cuda_graphs=cuda_graphs)
                batch = [{"id": f"self-{start + i:07d}",
                          "prompt": (o or "") + tok.decode(r["tokens"], skip_special_tokens=True),
                          "finish": r["finish"], "num_tokens": len(r["tokens"]), **({"opener": o} if o else {})}
                         for i, (o, r) in enumerate(zip(starts, results))]
                sink.append(batch)
                records += batch
                num_tokens += sum(r["num_tokens"] for r in batch)
                before = len(kept)
                kept, counts = _tally(records, num_prompts, num_steered)
                bar.update(len(kept) - before)
                bar.set_postfix_str(f"{num_tokens / (time.perf_counter() - t0):.0f} tok/s, "
                                    f"{counts['duplicate']} dup, {counts['truncated']} cut")
        finally:
            bar.close()
            sink.close()
    if len(kept) < num_prompts:
        fix = ("raise data.self_prompt_temperature for more variety" if counts["duplicate"] > counts["truncated"]
               else "raise data.self_prompt_max_tokens, or lower data.self_prompt_temperature for tidier requests")
        print0(f"the target wrote {len(kept)} usable prompts of the {num_prompts} asked in {len(records)} tries "
               f"(dropped: {counts['truncated']} hit data.self_prompt_max_tokens, {counts['duplicate']} duplicates, "
               f"{counts['empty']} empty); {fix}")
    steered = {r["id"] for r in records if r.get("opener")}
    with_opener = sum(p["id"] in steered for p in kept)
    if openers:
        written = len(steered)
        print0(f"{with_opener} of the {len(kept)} kept requests start with an opener, {num_steered} asked "
               f"(data.self_prompt_opener_share={opener_share}); {written} of the {len(records)} written did"
               + ("" if with_opener == num_steered else
                  "; the steered ones were dropped too often: raise data.self_prompt_max_tokens"))
    summary = {"num_asked": num_prompts, "num_kept": len(kept), "num_written": len(records),
               "num_kept_with_opener": with_opener, "num_asked_with_opener": num_steered,
               "num_written_with_opener": len(steered),
               "dropped": {k: v for k, v in counts.items() if k != "kept"}, "opening_tokens": len(opening),
               "seconds_this_run": round(time.perf_counter() - t0, 2), "num_tokens_this_run": num_tokens}
    return kept, summary
