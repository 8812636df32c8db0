"""Operators per graph of a speculative cycle, counted on the CPU: what a launch-bound GPU pays for.

    python bench/cycle_ops.py --draft RUN/train [--steps 3,5] [--trees "4,4,12;8,6,40"]

On the H200 a SmolLM2 forward is bound by kernel launches, not by arithmetic (docs/PERFORMANCE.md: a
forward of 1 to 16 tokens costs the same), and a CUDA graph replays one kernel per operator. So the
number of operators a pass runs, relative to a plain decoding step, predicts its GPU time relative to
that step, without a GPU. This script runs each pass of the fixed-shape path (eyas/speculative/graphs.py)
once under the profiler, eagerly in fp32, and counts the ATen operators that would be kernels (leaf
operators other than views and allocations). The last table gives each pass in operators and in plain
steps, and per setting the predicted cycle cost in plain steps: speedup = tau / that cost, before host
work and launch gaps (which the GPU's `bench/cycle_phases.py` measures).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from eyas.speculative.build import build_engine
from eyas.data.benchmarks import mtbench_questions
from eyas.speculative.bench import encode_turn, settings_of
from eyas.speculative.engine import SpecEngine
from eyas.target import load_target

NOT_KERNELS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::as_strided",
               "aten::slice", "aten::select", "aten::t", "aten::transpose", "aten::expand", "aten::unsqueeze",
               "aten::squeeze", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::permute",
               "aten::detach", "aten::alias", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg",
               "aten::result_type", "aten::split", "aten::chunk", "aten::unbind", "aten::contiguous"}


def kernels(fn) -> int:
    """ATen leaf operators of one call of fn, views and allocations left out."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    leaves = [e for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    return sum(e.name not in NOT_KERNELS for e in leaves)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, help="a training run dir, step dir or export dir")
    p.add_argument("--steps", default="3,5", help="chain lengths ('' for none)")
    p.add_argument("--trees", default="4,4,12;8,4,24;8,6,40", help="tree shapes TOPK,DEPTH,TOTAL separated by ';'")
    args = p.parse_args()
    torch.set_num_threads(1)
    target = load_target("smollm2", device="cpu", dtype="fp32")
    loaded, _ = build_engine(target, args.draft)
    engine = SpecEngine(target.model, loaded.draft, loaded.runner.aux_layers, static=True)
    tok = target.tokenizer
    ids = encode_turn(tok, [{"role": "user", "content": mtbench_questions()[0]["turns"][0]}])
    settings = settings_of([int(k) for k in args.steps.split(",") if k.strip()], None)  # eval's names
    settings += [s for t in args.trees.split(";") if t.strip() for s in settings_of([], t.strip())]
    engine.plain_generate(ids, 4)  # makes the decoder and fills the caches
    dec = engine._decoder
    engine.runner.attach()
    try:
        n = len(ids) + 4  # the passes run (eagerly) at the width of the end of the generation
        plain = kernels(dec._at(dec._plain_buffers(), n)["step"])
        rows = [("plain step", plain, None)]
        for name, setting in settings:
            engine.generate(ids, 4, **setting)  # the passes' buffers, at a real cache state
            engine.runner.attach()
            if "steps" in setting:
                b, first = dec._chain_buffers(setting["steps"]), "chain"
            else:
                b, first = dec._tree_buffers(*setting["tree"]), "tree"
            passes = dec._at(b, dec.capacity)  # counts do not depend on the width
            counts = {phase: kernels(passes[phase]) for phase in (first, "verify", "rebuild")}
            for phase, n in counts.items():
                rows.append((f"{name} {phase}", n, None))
            rows.append((f"{name} cycle", sum(counts.values()), "cycle"))
    finally:
        engine.runner.detach()
    print(f"\nSmolLM2 fp32 on the CPU, fixed-shape passes run eagerly; prompt of {len(ids)} tokens")
    print("| pass | operators (kernels) | plain steps |")
    print("|---|---|---|")
    for name, n, kind in rows:
        label = f"**{name}**" if kind else name
        print(f"| {label} | {n} | {n / plain:.2f} |")


if __name__ == "__main__":
    main()
