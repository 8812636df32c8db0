"""User prompts written by the target itself (the Magpie recipe): no dataset needed, and chat-like.

A chat model trained on conversations continues its template's opening of a user turn (for SmolLM2,
the default system prompt and `<|im_start|>user\\n`) with a plausible user request, because that is
what followed it in its own training data. Sampled at temperature < 1, SmolLM2-135M writes requests
such as "Can you help me plan a dinner party...": much closer to MT-bench than prompts built from
Python docstrings, so a draft trained on the target's answers to them sees the kind of text it
will be asked to speculate on.

The opening is found by rendering one user message holding a sentinel and cutting before it, so
any template (default system prompt included) works. Where the user turn ends is found the same way,
from what the template writes between a user message and the assistant's answer: ChatML's
`<|im_end|>` is a stop token, but Mistral's `[/INST]` or DeepSeek's `<｜Assistant｜>` are not, and a target
writing its own request goes on past them to answer it. So the request ends where the target writes
that end (when it is one added token, generation stops there too), and counts as finished. Requests
that hit the token limit, are empty or repeat an earlier one (case and spacing ignored) are dropped and
counted; generation goes on in batches until `num_prompts` are kept or twice that many were written.

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
ANSWER = "\x00eyas-assistant-message\x00"


def user_turn_opening(template) -> list[int]:
    """Token ids of the chat template up to where the first user message's content begins."""
    text = template.render([{"role": "user", "content": SENTINEL}])
    at = text.find(SENTINEL)
    if at < 0:
        raise ValueError("the chat template does not render the user message's content; self prompts need a "
                         "template that writes user messages verbatim")
    return template.tokenizer(text[:at], add_special_tokens=False)["input_ids"]


def user_turn_end(template) -> str:
    """The first line of what the template writes between a user message's content and the assistant's, stripped
    ("<|im_end|>" for ChatML, "[/INST]" for Mistral); "" when that is only spacing or the template hides it."""
    try:
        text = template.render([{"role": "user", "content": SENTINEL}, {"role": "assistant", "content": ANSWER}])
    except Exception:  # noqa: BLE001 -- a template may raise (jinja's raise_exception) on any input
        return ""
    at, end = text.find(SENTINEL), text.find(ANSWER)
    if at < 0 or end < at:
        return ""
    between = text[at + len(SENTINEL):end].strip()
    return between.splitlines()[0].strip() if between else ""


def _until(tok, tokens: list[int], marker: str) -> tuple[list[int], bool]:
    """The tokens before the first `marker` in their text (special tokens included), and whether it is there."""
    at = tok.decode(tokens).find(marker) if marker else -1
    if at < 0:
        return tokens, False
    lo, hi = 0, len(tokens)  # the most tokens whose text ends before the marker begins
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tok.decode(tokens[:mid])) <= at:
            lo = mid
        else:
            hi = mid - 1
    return tokens[:lo], True


def _request(tok, opener: str | None, opener_ids: list[int], tokens: list[int], turn_end: str) -> tuple[str, bool]:
    """(the written request, whether the target ended its user turn). The continuation is decoded with the
    opener's ids, since a SentencePiece decoder drops the space that starts the first token it decodes."""
    tokens, ended = _until(tok, tokens, turn_end)
    if not opener:
        return tok.decode(tokens, skip_special_tokens=True), ended
    text = tok.decode(opener_ids + tokens, skip_special_tokens=True)
    head = tok.decode(opener_ids, skip_special_tokens=True)  # the opener verbatim, even if it decodes otherwise
    return (opener + text[len(head):] if text.startswith(head) else text), ended


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


class Tally:
    """The written requests, taken in id order as they come (`add`): the kept ones (the first num_steered
    usable ones with an opener and the first num_prompts - num_steered without; a usable request over its
    group's quota counts as kept but is not used), the counts per verdict, and per group (steered or not) how
    many were written and usable, from which `plan` steers the next batch. Incremental, so a batch costs
    its own records, not all written so far."""

    def __init__(self, num_prompts: int, num_steered: int = 0):
        self.num_steered = num_steered
        self.quota = {True: num_steered, False: num_prompts - num_steered}
        self.seen: set[str] = set()
        self.kept: list[dict] = []
        self.counts = {"kept": 0, "truncated": 0, "empty": 0, "duplicate": 0}
        self.written, self.usable = {True: 0, False: 0}, {True: 0, False: 0}

    def add(self, records: list[dict]) -> "Tally":
        for rec in records:
            verdict = _verdict(rec, self.seen)
            steered = bool(rec.get("opener"))
            self.counts[verdict] += 1
            self.written[steered] += 1
            if verdict == "kept":
                self.seen.add(_key(rec["prompt"]))
                self.usable[steered] += 1
                if self.quota[steered] > 0:
                    self.quota[steered] -= 1
                    self.kept.append({"id": rec["id"], "prompt": rec["prompt"].strip()})
        return self

    def plan(self, rows: int, openers: list[str]) -> list[str | None]:
        """The opener (or None) of each of the next `rows` requests to write: rows go to the steered and the
        free group in proportion to what each still lacks divided by the share of its written requests that
        was usable (one more of each counted, so a new group starts at 1); the steered rows are spread evenly
        over the batch and take the openers in turn."""
        if not self.num_steered:
            return [None] * rows
        want = {g: self.quota[g] * (self.written[g] + 1) / (self.usable[g] + 1) for g in (True, False)}
        total = want[True] + want[False]
        steer_rows = round(rows * want[True] / total) if total else 0
        out: list[str | None] = []
        for i in range(rows):
            if (i + 1) * steer_rows // rows > i * steer_rows // rows:
                out.append(openers[(self.written[True] + sum(o is not None for o in out)) % len(openers)])
            else:
                out.append(None)
        return out


def steered_quota(num_prompts: int, openers: list[str], share: float) -> int:
    """How many of the num_prompts kept requests start with an opener."""
    return round(num_prompts * share) if openers and share > 0 else 0


def write_self_prompts(target, template, num_prompts: int, out_path: str | Path, *, temperature: float,
                       max_new_tokens: int, batch_size: int, seed: int = 0, cuda_graphs: bool = True,
                       openers: list[str] | None = None, opener_share: float = 0.0) -> tuple[list[dict], dict]:
    """Have the target write `num_prompts` distinct user requests -> ([{id, prompt}], summary). A share
    `opener_share` of the kept ones start with one of `openers` (the target writes the rest of the request)."""
    opening = user_turn_opening(template)
    openers = list(openers or [])
    tok = target.tokenizer
    opener_ids = {o: tok(o, add_special_tokens=False)["input_ids"] for o in openers}
    turn_end = user_turn_end(template)
    end_id = tok.get_added_vocab().get(turn_end)  # an added token is never part of a word: stop at it
    if end_id in template.stop_ids:
        turn_end = ""  # ChatML's <|im_end|>: generation stops there already
    stop_ids = template.stop_ids + ([end_id] if turn_end and end_id is not None else [])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else template.stop_ids[0]
    device = next(target.model.parameters()).device
    max_written = 2 * num_prompts
    num_steered = steered_quota(num_prompts, openers, opener_share)
    records = sorted(read_results(out_path).values(), key=lambda r: r["id"])
    tally = Tally(num_prompts, num_steered).add(records)
    kept, counts = tally.kept, tally.counts
    t0, num_tokens = time.perf_counter(), 0
    if len(kept) < num_prompts and len(records) < max_written:
        sink = ResultsFile(out_path)
        bar = progress(total=num_prompts, initial=len(kept), desc="self prompts", unit="prompt")
        try:
            while len(kept) < num_prompts and len(records) < max_written:
                start = len(records)
                rows = min(batch_size, max_written - start)
                generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + start)
                starts = tally.plan(rows, openers)
                results = generate_batch(target.model, [opening + opener_ids.get(o, []) for o in starts],
                                         max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
                                         temperature=temperature, generator=generator, cuda_graphs=cuda_graphs)
                batch = []
                for i, (o, r) in enumerate(zip(starts, results)):
                    text, ended = _request(tok, o, opener_ids.get(o, []), r["tokens"], turn_end)
                    batch.append({"id": f"self-{start + i:07d}", "prompt": text,
                                  "finish": "stop" if ended else r["finish"], "num_tokens": len(r["tokens"]),
                                  **({"opener": o} if o else {})})
                sink.append(batch)
                records += batch
                num_tokens += sum(r["num_tokens"] for r in batch)
                before = len(kept)
                tally.add(batch)
                kept, counts = tally.kept, tally.counts
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
    with_opener, written = num_steered - tally.quota[True], tally.written[True]  # kept and written with one
    if openers:
        print0(f"{with_opener} of the {len(kept)} kept requests start with an opener, {num_steered} asked "
               f"(data.self_prompt_opener_share={opener_share}); {written} of the {len(records)} written did"
               + ("" if with_opener == num_steered else
                  "; the steered ones were dropped too often: raise data.self_prompt_max_tokens"))
    summary = {"num_asked": num_prompts, "num_kept": len(kept), "num_written": len(records),
               "num_kept_with_opener": with_opener, "num_asked_with_opener": num_steered,
               "num_written_with_opener": written,
               "dropped": {k: v for k, v in counts.items() if k != "kept"}, "opening_tokens": len(opening),
               "seconds_this_run": round(time.perf_counter() - t0, 2), "num_tokens_this_run": num_tokens}
    return kept, summary
