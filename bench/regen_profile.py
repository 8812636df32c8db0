"""Where a step of batched regeneration goes: torch.profiler over a few decoding steps of one wide batch.

    python bench/regen_profile.py [--batch 512] [--new-tokens 48] [--prompt-tokens 200] [--compare]
                                  [--variant matmul]

Decodes one batch of built-in corpus prompts (cut to --prompt-tokens so every row is busy) with
eyas.data.regenerate.generate_batch, eagerly (the step as it runs without CUDA graphs; bench/regen.py
times regeneration as eyas runs it), first untimed (warm-up), then under the profiler. Prints the
wall time per step, the device time per step, and the operators that take the most device and host
time. On a GPU, host time per step well above device time per step means the loop is bound by
Python and launches; the reverse names the kernels to fix. SmolLM2 in bf16 on CUDA (fp32 on a CPU).

`--variant matmul` decodes with a candidate that is not in eyas yet: the one-token grouped attention as two
batched matmuls and a softmax over the cache slice as it is (strided, no copy), instead of SDPA, which
may copy a non-contiguous slice first. `--compare` times transformers' path, eyas' grouped SDPA and the
candidate side by side (the candidate's tokens are compared with grouped SDPA's).
"""

from __future__ import annotations

import argparse
import functools
import time
from contextlib import nullcontext

import torch

import eyas.data.regenerate as regen
from eyas.data.corpus import default_prompts
from eyas.data.regenerate import generate_batch
from eyas.data.template import ChatTemplate, stop_token_ids
from eyas.target import load_target


GROUPED_SDPA = regen.grouped_decode_sdpa  # eyas' path, before use_variant swaps it


def matmul_decode(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  **kwargs):
    """Candidate: a one-token grouped query as matmul, softmax, matmul over the strided cache slice."""
    b, num_heads, q_len, head_dim = query.shape
    num_kv = key.shape[1]
    if q_len != 1 or num_heads == num_kv:
        return GROUPED_SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else head_dim ** -0.5
    q = query.reshape(b, num_kv, num_heads // num_kv, head_dim)  # [B, KV, g, D]
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [B, KV, g, L]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, KV, g, D]
    return out.reshape(b, num_heads, 1, head_dim).transpose(1, 2), None


class use_variant:
    """Within the block, eyas' grouped decoding goes through `fn` instead of grouped_decode_sdpa."""

    def __init__(self, fn):
        self.fn, self.saved = fn, None

    def __enter__(self):
        self.saved = regen.grouped_decode_sdpa
        regen.grouped_decode_sdpa = self.fn
        return self

    def __exit__(self, *exc):
        regen.grouped_decode_sdpa = self.saved


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--compare", action="store_true",
                   help="time transformers' SDPA path, eyas' grouped decoding and the matmul candidate instead of "
                        "profiling")
    p.add_argument("--variant", choices=["grouped", "matmul"], default="grouped",
                   help="what to profile: eyas' grouped SDPA or the matmul candidate")
    return p.parse_args()


def batch_prompts(target, batch: int, prompt_tokens: int) -> list[list[int]]:
    """`batch` built-in corpus prompts in the chat template, cut to `prompt_tokens` so every row is busy."""
    tok = target.tokenizer
    template = ChatTemplate(tok, stop_token_ids(tok, target.model.generation_config))
    return [template.prompt_ids([{"role": "user", "content": q["prompt"]}])[:prompt_tokens]
            for q in default_prompts(batch)]


def decode(target, prompts, new_tokens: int, cuda: bool, keep=None) -> float:
    """Seconds to decode the batch eagerly; each row's new tokens are appended to `keep` if given."""
    never = [-1]  # no row stops: every step runs the whole batch
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = generate_batch(target.model, prompts, max_new_tokens=new_tokens, stop_ids=never, pad_id=0,
                         cuda_graphs=False)
    if cuda:
        torch.cuda.synchronize()
    if keep is not None:
        keep.extend(r["tokens"] for r in out)
    return time.perf_counter() - t0


def time_transformers_path(run) -> float:
    """Seconds of the same batch through transformers' own SDPA path (kv heads copied per layer), after a warm-up."""
    saved = regen._GroupedDecode.__enter__
    regen._GroupedDecode.__enter__ = lambda self: self
    try:
        run()
        return run()
    finally:
        regen._GroupedDecode.__enter__ = saved


def print_comparison(batch: int, new_tokens: int, prompts, plain: float, wall: float, candidate: float,
                     candidate_tokens: list, grouped_tokens: list) -> None:
    print(f"\nbatch {batch}, {new_tokens} new tokens after {max(len(x) for x in prompts)}-token prompts")
    print("| attention for decoding | wall ms per step (prefill included) | new tok/s |")
    print("|---|---|---|")
    for name, seconds in (("transformers SDPA (kv heads copied)", plain), ("eyas grouped SDPA", wall),
                          ("candidate: grouped matmul, no SDPA", candidate)):
        print(f"| {name} | {1000 * seconds / new_tokens:.2f} | {batch * new_tokens / seconds:,.0f} |")
    same = sum(a == b for a, b in zip(candidate_tokens, grouped_tokens))
    print(f"grouped SDPA {plain / wall:.2f}x and candidate {plain / candidate:.2f}x of transformers' path; "
          f"candidate rows equal to grouped SDPA's: {same}/{len(grouped_tokens)}")


def profile_decode(run, cuda: bool, matmul: bool) -> float:
    """One decode under torch.profiler; prints the top operators and returns the device ms in all."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof, (use_variant(matmul_decode) if matmul else nullcontext()):
        run()
    events = prof.key_averages()
    dev_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    if cuda:  # the kernels only: an operator's row repeats the time of the kernels it launched
        from torch.autograd import DeviceType

        dev_total = sum(e.self_device_time_total for e in events
                        if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1000  # ms
    else:
        dev_total = sum(e.self_cpu_time_total for e in events) / 1000
    print(events.table(sort_by=dev_key, row_limit=14, max_name_column_width=60))
    if cuda:
        print(events.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
    return dev_total


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    target = load_target("smollm2", device="cuda" if cuda else "cpu", dtype="bf16" if cuda else "fp32")
    prompts = batch_prompts(target, args.batch, args.prompt_tokens)
    run = functools.partial(decode, target, prompts, args.new_tokens, cuda)

    if args.variant == "matmul" or args.compare:
        with use_variant(matmul_decode):
            run()
            candidate_tokens = []
            candidate = run(candidate_tokens)
    if args.variant == "matmul" and not args.compare:
        wall = candidate
    else:
        run()
        grouped_tokens = []
        wall = run(grouped_tokens)
    if args.compare:
        plain = time_transformers_path(run)
        print_comparison(args.batch, args.new_tokens, prompts, plain, wall, candidate, candidate_tokens, grouped_tokens)
        return
    dev_total = profile_decode(run, cuda, args.variant == "matmul")
    width = max(len(x) for x in prompts)
    print(f"\nbatch {args.batch}, prompts padded to {width} tokens, {args.new_tokens} new tokens, "
          f"{'bf16 on ' + torch.cuda.get_device_name() if cuda else 'fp32 on the CPU'}")
    print("| wall ms per step (prefill included) | device ms per step (profiled) | new tok/s |")
    print("|---|---|---|")
    print(f"| {1000 * wall / args.new_tokens:.2f} | {dev_total / args.new_tokens:.2f} | "
          f"{args.batch * args.new_tokens / wall:,.0f} |")


if __name__ == "__main__":
    main()
