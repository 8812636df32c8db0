"""What a speculative eval's prefill costs per prompt: eager with and without cuDNN attention, and graphed.

    python bench/prefill.py [--lengths 40] [--min-len 64] [--max-len 900]

An eager eval on an H200 spent 109 ms per turn in prefill for the first setting it
ran (chain-3) and 41 ms for the second (the tree) on the same prompts: the prefill was eager, each prompt
length a new shape, and SDPA's cuDNN backend builds an execution plan for every new shape before its
first call. Leaving cuDNN out of eager passes (`varying_shape_attention`) was the first answer; the
static path now pads the prompt to a multiple of `PREFILL_STEP` tokens and replays one CUDA graph per
padded length (captured before the clock starts, like the decoding graphs).

This times `SpecEngine.plain_generate(ids, 2)`'s prefill (SmolLM2, bf16, static path: the same
`GraphDecoder._prefill` the speculative settings use) over `--lengths` prompt lengths never seen before,
then over the same lengths again, for three arms in one process: `eager, cuDNN allowed` (SDPA's default
choice), `eager, no cuDNN` and `graphed` (padded to PREFILL_STEP). The arms take interleaved lengths from
one range, so each arm's first round meets only lengths new to it. `first round s` is the wall time of the
first round, graph captures included.

`--cpu` runs the tiny random Llama on the CPU in fp32: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import eyas.speculative.graphs as graphs
from eyas.speculative.engine import SpecEngine
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
    step = max(1, (args.max_len - args.min_len) // (3 * args.lengths))
    pool = list(range(args.min_len, args.min_len + 3 * args.lengths * step, step))[: 3 * args.lengths]
    arms = {"eager, cuDNN allowed": (pool[0::3], 0, contextlib.nullcontext),
            "eager, no cuDNN": (pool[1::3], 0, None),
            f"graphed, padded to {graphs.PREFILL_STEP}": (pool[2::3], graphs.PREFILL_STEP, None)}
    rows = []
    original = graphs.varying_shape_attention, graphs.PREFILL_STEP
    for name, (lengths, prefill_step, ctx) in arms.items():
        graphs.varying_shape_attention, graphs.PREFILL_STEP = ctx or original[0], prefill_step
        try:
            t0 = time.perf_counter()
            first = prefill_ms(engine, lengths, vocab, device)
            wall = time.perf_counter() - t0
            again = prefill_ms(engine, lengths, vocab, device)
        finally:
            graphs.varying_shape_attention, graphs.PREFILL_STEP = original
        rows.append((name, len(lengths), f"{lengths[0]}..{lengths[-1]}", statistics.median(first), sum(first), wall,
                     statistics.median(again), sum(again)))
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (script check only)"
    print(f"\n{target.identity['name']} {'fp32' if args.cpu else 'bf16'}, {gpu}; prefill of plain_generate(ids, 2), "
          f"static path, cache of {engine._decoder.capacity} slots")
    print("| arm | lengths | range | first time: median ms | first time: total ms | first round s | again: median ms "
          "| again: total ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, k, span, m1, t1, wall, m2, t2 in rows:
        print(f"| {name} | {k} | {span} | {m1:.1f} | {t1:.0f} | {wall:.1f} | {m2:.1f} | {t2:.0f} |")

if __name__ == "__main__":
    main()
