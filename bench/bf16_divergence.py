"""How often greedy decoding paths of different shapes leave plain greedy decoding in low precision.

    python bench/bf16_divergence.py                       # SmolLM2, bf16, CPU, 6 MT-bench first turns, 128 tokens
    python bench/bf16_divergence.py --dtype fp32          # the control: every path must match

Each prompt is decoded by the dynamic engine's plain decoding (the reference), the dynamic engine's chain,
the static (CUDA-graph) path's chain and the static path's plain decoding, with an untrained draft (so
every token comes from the target). In fp32 all four agree; in bf16 passes of different shapes (query
width, attended cache length) round differently and near-ties between the top two logits flip. Prints,
per path, how many prompts differ and the first differing token of each.
"""

from __future__ import annotations

import argparse

import torch

from eyas.data.benchmarks import mtbench_questions
from eyas.speculative.bench import encode_turn
from eyas.speculative.engine import SpecEngine
from eyas.speculative.oracle import untrained_draft
from eyas.target import load_target


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2", device=args.device, dtype=args.dtype)
    draft, aux = untrained_draft(target, 8192)
    plain = SpecEngine(target.model)
    dyn = SpecEngine(target.model, draft, aux)
    static = SpecEngine(target.model, draft, aux, static=True)
    static_plain = SpecEngine(target.model, static=True)
    paths = {"dynamic chain": lambda ids: dyn.generate(ids, args.new_tokens, steps=args.steps),
             "static chain": lambda ids: static.generate(ids, args.new_tokens, steps=args.steps),
             "static plain": lambda ids: static_plain.plain_generate(ids, args.new_tokens)}
    firsts = {name: [] for name in paths}
    for q in mtbench_questions()[:args.prompts]:
        ids = encode_turn(target.tokenizer, [{"role": "user", "content": q["turns"][0]}])
        ref = plain.plain_generate(ids, args.new_tokens).tokens
        for name, run in paths.items():
            firsts[name].append(first_difference(run(ids).tokens, ref))
    print(f"\nSmolLM2 {args.dtype} on {args.device}: {args.prompts} MT-bench first turns, {args.new_tokens} new tokens, "
          f"chain {args.steps}, untrained draft; reference: the dynamic engine's plain greedy decoding")
    print("| path | prompts differing | first differing token per prompt |\n|---|---|---|")
    for name, f in firsts.items():
        print(f"| {name} | {sum(x is not None for x in f)} of {len(f)} | {', '.join('-' if x is None else str(x) for x in f)} |")


if __name__ == "__main__":
    main()
