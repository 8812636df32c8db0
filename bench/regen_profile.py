"""Where a step of batched regeneration goes: torch.profiler over a few decoding steps of one wide batch.

    python bench/regen_profile.py [--batch 512] [--new-tokens 48] [--prompt-tokens 200] [--compare]

Decodes one batch of built-in corpus prompts (cut to --prompt-tokens so every row is busy) with
eyas.data.regenerate.generate_batch, first untimed (warm-up), then under the profiler. Prints the
wall time per step, the device time per step, and the operators that take the most device and host
time. On a GPU, host time per step well above device time per step means the loop is bound by
Python and launches; the reverse names the kernels to fix. SmolLM2 in bf16 on CUDA (fp32 on a CPU).
"""

from __future__ import annotations

import argparse
import time

import torch

from eyas.data.corpus import default_prompts
from eyas.data.regenerate import generate_batch
from eyas.data.template import ChatTemplate, stop_token_ids
from eyas.target import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--compare", action="store_true",
                   help="time transformers' SDPA path against eyas' grouped decoding instead of profiling")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    target = load_target("smollm2", device="cuda" if cuda else "cpu", dtype="bf16" if cuda else "fp32")
    tok = target.tokenizer
    template = ChatTemplate(tok, stop_token_ids(tok, target.model.generation_config))
    prompts = [template.prompt_ids([{"role": "user", "content": q["prompt"]}])[:args.prompt_tokens]
               for q in default_prompts(args.batch)]
    never = [-1]  # no row stops: every step runs the whole batch

    def run():
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate_batch(target.model, prompts, max_new_tokens=args.new_tokens, stop_ids=never, pad_id=0)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run()
    wall = run()
    if args.compare:  # the same batch through transformers' own SDPA path (kv heads copied per layer)
        import eyas.data.regenerate as regen

        saved = regen._GroupedDecode.__enter__
        regen._GroupedDecode.__enter__ = lambda self: self
        try:
            run()
            plain = run()
        finally:
            regen._GroupedDecode.__enter__ = saved
        print(f"\nbatch {args.batch}, {args.new_tokens} new tokens after {max(len(x) for x in prompts)}-token prompts")
        print("| attention for decoding | wall ms per step (prefill included) | new tok/s |")
        print("|---|---|---|")
        for name, seconds in (("transformers SDPA (kv heads copied)", plain), ("eyas grouped SDPA", wall)):
            print(f"| {name} | {1000 * seconds / args.new_tokens:.2f} | {args.batch * args.new_tokens / seconds:,.0f} |")
        print(f"speed-up {plain / wall:.2f}x")
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run()
    events = prof.key_averages()
    dev_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    dev_total = sum(getattr(e, dev_key) for e in events) / 1000  # ms
    print(events.table(sort_by=dev_key, row_limit=14, max_name_column_width=60))
    if cuda:
        print(events.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
    width = max(len(x) for x in prompts)
    print(f"\nbatch {args.batch}, prompts padded to {width} tokens, {args.new_tokens} new tokens, "
          f"{'bf16 on ' + torch.cuda.get_device_name() if cuda else 'fp32 on the CPU'}")
    print("| wall ms per step (prefill included) | device ms per step (profiled) | new tok/s |")
    print("|---|---|---|")
    print(f"| {1000 * wall / args.new_tokens:.2f} | {dev_total / args.new_tokens:.2f} | "
          f"{args.batch * args.new_tokens / wall:,.0f} |")


if __name__ == "__main__":
    main()
