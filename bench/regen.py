"""Local regeneration throughput: batch by batch against continuous batching, eager and CUDA-graphed.

    python bench/regen.py [--prompts 1024] [--slots 512] [--max-new-tokens 512] [--modes batches,eager,graphs]

Regenerates answers to built-in corpus prompts with SmolLM2 (bf16 on CUDA, fp32 on a CPU), greedy, as
`eyas prepare` does (prompts sorted by length), three ways over the same prompts in one process:

- `batches`: what eyas did before continuous batching: batches of --slots prompts one after the other,
  each decoded eagerly until its last row stops (rows dropped once half of the batch has stopped);
- `eager`: continuous batching, a finished row's slot given the next prompt, eager steps;
- `graphs`: continuous batching with each decoding step replayed as a CUDA graph (CUDA only).

Prints new tokens per second, decoding steps and how many answers equal the first mode's (in bf16 the
graphs attend over a few more, masked, columns than eager steps, which may flip a near-tie).
"""

from __future__ import annotations

import argparse
import time

import torch

from eyas.data.corpus import default_prompts
from eyas.data.regenerate import generate_batch, generate_stream
from eyas.data.template import ChatTemplate, stop_token_ids
from eyas.target import load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--modes", default="batches,eager,graphs")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    modes = [m for m in args.modes.split(",") if cuda or m != "graphs"]
    target = load_target("smollm2", device="cuda" if cuda else "cpu", dtype="bf16" if cuda else "fp32")
    tok, model = target.tokenizer, target.model
    template = ChatTemplate(tok, stop_token_ids(tok, model.generation_config))
    prompts = sorted((template.prompt_ids([{"role": "user", "content": q["prompt"]}])
                      for q in default_prompts(args.prompts)), key=len)
    kw = dict(max_new_tokens=args.max_new_tokens, stop_ids=template.stop_ids, pad_id=template.stop_ids[0])
    steps = []
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: steps.append(a[0].shape[1] == 1))

    def run(mode: str) -> list[dict]:
        if mode == "batches":
            out = []
            for b in range(0, len(prompts), args.slots):
                out += generate_batch(model, prompts[b:b + args.slots], cuda_graphs=False, **kw)
            return out
        got = {}
        for finished in generate_stream(model, prompts, slots=args.slots, cuda_graphs=mode == "graphs", **kw):
            got.update(finished)
        return [got[i] for i in range(len(prompts))]

    rows, first = [], None
    for mode in modes:
        run(mode) if mode == "graphs" else None  # capture the graphs before timing
        steps.clear()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = run(mode)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        new = sum(len(r["tokens"]) for r in out)
        first = first or out
        same = sum(a == b for a, b in zip(out, first))
        rows.append((mode, seconds, new, sum(steps), same))
        print(f"{mode}: {seconds:.1f} s, {new:,} new tokens, {new / seconds:,.0f} tok/s", flush=True)
    at_limit = sum(r["finish"] == "length" for r in first)
    print(f"\n{len(prompts)} corpus prompts (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens), {args.slots} slots, "
          f"up to {args.max_new_tokens} new tokens ({at_limit} reach the limit), "
          f"{'bf16 on ' + torch.cuda.get_device_name() if cuda else 'fp32 on the CPU'}")
    print("| mode | seconds | new tokens | new tok/s | decoding steps | answers equal to the first mode's | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for mode, seconds, new, n_steps, same in rows:
        print(f"| {mode} | {seconds:.1f} | {new:,} | {new / seconds:,.0f} | {n_steps:,} | {same}/{len(prompts)} | "
              f"{rows[0][1] / seconds:.2f}x |")


if __name__ == "__main__":
    main()
