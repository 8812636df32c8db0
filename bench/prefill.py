"""What a speculative eval's prefill costs per prompt, with and without cuDNN attention in its eager pass.

    python bench/prefill.py [--lengths 40] [--min-len 64] [--max-len 900]

The tenth session's eval (docs/PERFORMANCE.md) spent 109 ms per turn in prefill for the first setting it
ran (chain-3) and 41 ms for the second (the tree) on the same prompts: the prefill is eager, each prompt
length is a new shape, and SDPA's cuDNN backend builds an execution plan for every new shape before its
first call. The engine now leaves cuDNN out of its eager passes (`varying_shape_attention`), keeping it
for the fixed-shape CUDA graphs.

This times `SpecEngine.plain_generate(ids, 2)`'s prefill (SmolLM2, bf16, static path: the same
`GraphDecoder._prefill` the speculative settings use) over `--lengths` prompt lengths never seen before,
then over the same lengths again, for two arms in one process: `cudnn allowed` (the eager pass with
SDPA's default choice) and `eyas` (cuDNN left out). The arms take alternate lengths from one range, so
each arm's first round meets only new shapes.

`--cpu` runs the tiny random Llama on the CPU in fp32: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

import eyas.spec.graphs as graphs
from eyas.spec.engine import SpecEngine
from eyas.target import load_target


def prefill_ms(engine: SpecEngine, lengths: list[int], vocab: int, device) -> list[float]:
    out = []
    for n in lengths:
        ids = torch.randint(10, vocab - 10, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
        res = engine.plain_generate(ids, 2)
        out.append(res.prefill_s * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, default=40, help="distinct prompt lengths per arm")
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=900, help="the cache stays at 1,024 slots below about 1,000")
    ap.add_argument("--cpu", action="store_true", help="tiny random Llama on the CPU: checks the script only")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    target = load_target("tiny" if args.cpu else "smollm2", device=device, dtype="fp32" if args.cpu else "bf16")
    engine = SpecEngine(target.model, sync_timing=False, static=True)
    vocab = target.model.config.vocab_size
    engine.plain_generate(torch.tensor([[11] * 16], device=device), 2)  # graphs and kernels warmed once
    step = max(1, (args.max_len - args.min_len) // (2 * args.lengths))
    pool = list(range(args.min_len, args.min_len + 2 * args.lengths * step, step))[: 2 * args.lengths]
    arms = {"cudnn allowed": (pool[0::2], contextlib.nullcontext), "eyas (no cuDNN)": (pool[1::2], None)}
    rows = []
    original = graphs.varying_shape_attention
    for name, (lengths, ctx) in arms.items():
        graphs.varying_shape_attention = ctx or original
        try:
            first = prefill_ms(engine, lengths, vocab, device)
            again = prefill_ms(engine, lengths, vocab, device)
        finally:
            graphs.varying_shape_attention = original
        rows.append((name, len(lengths), f"{lengths[0]}..{lengths[-1]}", statistics.median(first), sum(first),
                     statistics.median(again), sum(again)))
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (script check only)"
    print(f"\n{target.identity['name']} {'fp32' if args.cpu else 'bf16'}, {gpu}; prefill of plain_generate(ids, 2), "
          f"static path, cache of {engine._decoder.capacity} slots")
    print("| arm | lengths | range | first time: median ms | first time: total ms | again: median ms | again: total ms |")
    print("|---|---|---|---|---|---|---|")
    for name, k, span, m1, t1, m2, t2 in rows:
        print(f"| {name} | {k} | {span} | {m1:.1f} | {t1:.0f} | {m2:.1f} | {t2:.0f} |")


if __name__ == "__main__":
    main()
