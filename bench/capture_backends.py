"""Capture throughput of the two target backends side by side: the capture stage on the same synthetic
prepared data, once through transformers (target.backend=hf) and once through a vLLM engine (vllm), each into
its own store; tokens/s from each store's summary.json (the engine's start is outside the timed loop, as
loading the target is; it is printed on its own).

    python bench/capture_backends.py                                   # SmolLM2, fp32, CPU
    python bench/capture_backends.py --samples 64 --min-len 64 --max-len 256 --engine '{"tensor_parallel_size": 2}'
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.config import load_config  # noqa: E402
from eyas.stages import capture  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="any load_target spec vLLM can load")
    p.add_argument("--backends", default="hf,vllm")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=192)
    p.add_argument("--dtype", default="fp32", help="target.dtype (the stored dtype is bf16)")
    p.add_argument("--engine", default='{"max_model_len": 1024}', help="target.engine for vLLM, as JSON")
    p.add_argument("--workdir", default=None)
    return p.parse_args()


def main(args: argparse.Namespace | None = None) -> None:
    from capture import make_prepared  # bench/capture.py: the same synthetic data

    from eyas.target import load_target

    args = args or parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="eyas-bench-backends-"))
    t0 = time.perf_counter()
    target = load_target(args.model, device="cpu", dtype=args.dtype)
    load_s = time.perf_counter() - t0
    prepared = make_prepared(work / "prepared", args.samples, args.min_len, args.max_len, target.vocab_size)
    rows = []
    for backend in args.backends.split(","):
        sets = [f"target.model={args.model}", "target.device=cpu", f"target.dtype={args.dtype}", "capture.dtype=bf16",
                f"target.backend={backend}", f"target.engine={args.engine}"]
        store = work / f"store-{backend}"
        shutil.rmtree(store, ignore_errors=True)
        t0 = time.perf_counter()
        summary = capture.run(load_config(None, sets), capture.Inputs(prepared), store, target=target)
        rows.append((backend, summary["tokens"], summary["tokens_per_s"], time.perf_counter() - t0 - summary["wall_s"]))
        shutil.rmtree(store, ignore_errors=True)
    print(f"\n{args.model} {args.dtype}, {args.samples} samples of {args.min_len}-{args.max_len} tokens "
          f"(HF load {load_s:.1f} s)")
    print(f"{'backend':8} {'tokens':>8} {'tok/s':>9} {'outside the loop (s)':>21}")
    for backend, tokens, rate, outside in rows:
        print(f"{backend:8} {tokens:>8,} {rate:>9,.0f} {outside:>21.1f}")
    print(json.dumps({b: r for b, _, r, _ in rows}))


if __name__ == "__main__":
    main()
