"""Benchmark `eyas prepare`: throughput in conversations/s, and in-process regeneration in tokens/s.

    python bench/prepare.py --conversations 10000            # prepare throughput (no regeneration)
    python bench/prepare.py --regen 48 --max-new-tokens 64   # regeneration with the target

The conversations are synthetic multi-turn ShareGPT/OpenAI records (1-3 turns, a system prompt on a
third of them) written to a temporary JSONL; the target is SmolLM2 unless --target says otherwise.
Results go to docs/PERFORMANCE.md by hand, with the command, the machine and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path


def synthetic(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = "the a model token draft target layer speculative decoding accept verify batch cache step".split()

    def sentence(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k)).capitalize() + "."

    out = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns += [("user", sentence(rng.randint(8, 40))), ("assistant", " ".join(sentence(12) for _ in range(rng.randint(2, 12))))]
        if i % 3 == 0:
            turns.insert(0, ("system", sentence(10)))
        if i % 2:
            out.append({"id": f"s{i}", "conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(r, r), "value": v}
                                                         for r, v in turns]})
        else:
            out.append({"id": f"s{i}", "messages": [{"role": r, "content": v} for r, v in turns]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--conversations", type=int, default=10000)
    ap.add_argument("--regen", type=int, default=0, help="prompts to regenerate with the target (0 = skip)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()

    import torch

    from eyas.stages import prepare
    from eyas.config import load_config
    from eyas.target import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, device="cpu", dtype="fp32")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.conversations:
            src = tmp / "conv.jsonl"
            src.write_text("".join(json.dumps(r) + "\n" for r in synthetic(args.conversations)))
            cfg = load_config("demo", ["data.regenerate=none", "data.max_length=4096", f"target.model={args.target}"])
            cfg.data.data = [str(src)]
            t0 = time.perf_counter()
            s = prepare.run(cfg, prepare.Inputs(tuple(cfg.data.data)), tmp / "out", target=target)
            dt = time.perf_counter() - t0
            print(f"prepare: {s['num_kept']} conversations, {s['num_tokens']} tokens in {dt:.1f} s = "
                  f"{s['num_kept'] / dt:.0f} conversations/s end to end (read, template, tokenize, write, vocab); "
                  f"template+tokenize alone {s['tokenize_conversations_per_s']:.0f} conversations/s")
        if args.regen:
            cfg = load_config("demo", [f"data.num_prompts={args.regen}", "data.regenerate=local",
                                       f"data.regen_max_new_tokens={args.max_new_tokens}",
                                       f"data.regen_batch_size={args.batch_size}", f"target.model={args.target}"])
            t0 = time.perf_counter()
            s = prepare.run(cfg, prepare.Inputs(tuple(cfg.data.data)), tmp / "regen", target=target)
            dt = time.perf_counter() - t0
            r = s["regeneration"]
            print(f"regenerate: {r['num_responses']} responses, {r['num_tokens']} new tokens in "
                  f"{r['seconds_this_run']:.1f} s = {r['num_tokens'] / r['seconds_this_run']:.1f} tokens/s "
                  f"(batch {args.batch_size}, max {args.max_new_tokens} new tokens, finish {r['finish']}); "
                  f"whole prepare {dt:.1f} s")


if __name__ == "__main__":
    main()
