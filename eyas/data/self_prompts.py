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
than the target's own requests hold (a few percent of SmolLM2's are about code). Which written request gets
which opener depends on its index alone, so a resumed run steers as an uninterrupted one does.

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


def _tally(records: list[dict], num_prompts: int) -> tuple[list[dict], dict]:
    """The first num_prompts kept requests in id order, and the counts per verdict."""
    seen: set[str] = set()
    kept, counts = [], {"kept": 0, "truncated": 0, "empty": 0, "duplicate": 0}
    for rec in records:
        verdict = _verdict(rec, seen)
        counts[verdict] += 1
        if verdict == "kept":
            seen.add(_key(rec["prompt"]))
            if len(kept) < num_prompts:
                kept.append({"id": rec["id"], "prompt": rec["prompt"].strip()})
    return kept, counts


def opener_of(index: int, openers: list[str], share: float) -> str | None:
    """The opener of the index-th written request, or None: a `share` of the indices, spread evenly, take
    the openers in turn."""
    if not openers or share <= 0:
        return None
    before, upto = int(index * share), int((index + 1) * share)
    return openers[before % len(openers)] if upto > before else None


def write_self_prompts(target, template, num_prompts: int, out_path: str | Path, *, temperature: float,
                       max_new_tokens: int, batch_size: int, seed: int = 0, cuda_graphs: bool = True,
                       openers: list[str] | None = None, opener_share: float = 0.0) -> tuple[list[dict], dict]:
    """Have the target write `num_prompts` distinct user requests -> ([{id, prompt}], summary). A share
    `opener_share` of them start with one of `openers` (the target writes the rest of the request)."""
    opening = user_turn_opening(template)
    openers = list(openers or [])
    tok = target.tokenizer
    opener_ids = {o: tok(o, add_special_tokens=False)["input_ids"] for o in openers}
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else template.stop_ids[0]
    device = next(target.model.parameters()).device
    max_written = 2 * num_prompts
    records = sorted(read_results(out_path).values(), key=lambda r: r["id"])
    kept, counts = _tally(records, num_prompts)
    t0, num_tokens = time.perf_counter(), 0
    if len(kept) < num_prompts and len(records) < max_written:
        sink = ResultsFile(out_path)
        bar = progress(total=num_prompts, initial=len(kept), desc="self prompts", unit="prompt")
        try:
            while len(kept) < num_prompts and len(records) < max_written:
                start = len(records)
                rows = min(batch_size, max_written - start)
                generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + start)
                starts = [opener_of(start + i, openers, opener_share) for i in range(rows)]
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
                kept, counts = _tally(records, num_prompts)
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
        print0(f"{with_opener} of the {len(kept)} kept requests start with an opener (data.self_prompt_openers)")
    summary = {"num_asked": num_prompts, "num_kept": len(kept), "num_written": len(records),
               "num_kept_with_opener": with_opener,
               "dropped": {k: v for k, v in counts.items() if k != "kept"}, "opening_tokens": len(opening),
               "seconds_this_run": round(time.perf_counter() - t0, 2), "num_tokens_this_run": num_tokens}
    return kept, summary
