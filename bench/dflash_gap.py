"""A DFlash draft on benchmark prompts: decoding against the training computation, and against teacher forcing.

    python bench/dflash_gap.py --draft DRAFT [--prompts 3] [--new-tokens 96] [--steps 15]

For each prompt (the first --prompts of HumanEval and of MT-bench's first turns, as `eyas eval` encodes them)
the speculative engine decodes greedily with chains of --steps, to the end of the turn at most (SmolLM2 in fp32
on the CPU, so its tokens are the target's), and every block it drafts is recorded with its anchor. Then the
training forward (eyas/train/dflash.py: the whole sequence's features as one context, every block under the
training mask) runs over the same sequence with the same anchors: its guesses must equal decoding's, block for
block. Last, the training forward with every answer position as an anchor gives the teacher-forced
acceptance length on those answers. Decoding and teacher forcing both low, and held-out tau high, means the draft
does not carry what it learnt to these prompts; a differing block means training and decoding disagree about the
draft's inputs.
"""

from __future__ import annotations

import argparse

import torch

import eyas.draft.dflash as dflash
from eyas.data.template import stop_token_ids
from eyas.speculative.bench import encode_turn, load_bench
from eyas.speculative.build import build_engine
from eyas.target import load_target
from eyas.target.capture import FeatureCapture
from eyas.train.dflash import training_mask


def training_guesses(draft, kv, seq: torch.Tensor, anchors: list[int], t: int) -> torch.Tensor:
    """The training forward's greedy guesses [n, block_size - 1] for blocks anchored at `anchors` of seq [1, t]."""
    bk = draft.cfg.block_size
    a = torch.tensor([anchors])
    keep = torch.ones_like(a, dtype=torch.bool)
    pos = a[:, :, None] + torch.arange(bk)
    ids = torch.full((1, len(anchors), bk), draft.cfg.mask_token_id)
    ids[:, :, 0] = seq[0, a[0]]
    hidden = draft(ids.view(1, -1), pos.view(1, -1), kv, training_mask(a, keep, t, bk)).view(len(anchors), bk, -1)
    return draft.lm_head(hidden[:, 1:]).argmax(-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, help="a DFlash training run, checkpoint or export directory")
    p.add_argument("--prompts", type=int, default=3, help="prompts per benchmark")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--steps", type=int, default=15, help="guesses a cycle (at most the block size - 1)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2", device="cpu", dtype="fp32")
    engine, info = build_engine(target, args.draft)
    draft, k = engine.draft, args.steps
    if getattr(draft, "method", "eagle3") != "dflash":
        raise SystemExit(f"{args.draft} is not a DFlash draft (bench/acceptance_gap.py scores EAGLE-3 drafts)")
    blocks: list[tuple[int, list[int]]] = []
    propose = dflash.propose_block

    def recording(draft_, context, anchor, start, n):
        out = propose(draft_, context, anchor, start, n)
        blocks.append((start, out.tolist()))
        return out

    dflash.propose_block = recording  # the engine imports it at each generation
    capture = FeatureCapture(target, info["aux"])
    tok = target.tokenizer
    eos = stop_token_ids(tok, getattr(target.model, "generation_config", None))
    sets = {name: [encode_turn(tok, [{"role": "user", "content": item["turns"][0]}])
                   for item in load_bench(bench, args.prompts)]
            for name, bench in (("HumanEval", "humaneval"), ("MT-bench first turns", "mt-bench-1"))}
    print(f"draft {args.draft}; SmolLM2 fp32 on the CPU; chains of {k}, {args.new_tokens} new tokens a prompt")
    print("| prompts | n | blocks decoded | blocks differing from the training forward | decoding tau | "
          "teacher-forced tau, every answer position an anchor |")
    print("|---|---|---|---|---|---|")
    for name, prompts in sets.items():
        accepted, forced, differ, decoded = [], [], 0, 0
        for ids in prompts:
            blocks.clear()
            res = engine.generate(ids, args.new_tokens, steps=k, eos_token_ids=eos)
            accepted += res.accepted_per_cycle
            seq = torch.tensor([ids + res.tokens])
            t = seq.shape[1]
            with torch.no_grad():
                aux, _ = capture(seq, torch.ones_like(seq))
                kv = draft.context_kv(draft.fuse(aux.float()), torch.arange(t)[None])
                guesses = training_guesses(draft, kv, seq, [s for s, _ in blocks], t)
                decoded += len(blocks)
                differ += sum(prop != g[:k].tolist() for (_, prop), g in zip(blocks, guesses))
                anchors = list(range(len(ids), t - 1))
                for a, row in zip(anchors, training_guesses(draft, kv, seq, anchors, t).tolist()):
                    n = 0
                    while n < min(k, t - 1 - a) and row[n] == int(seq[0, a + 1 + n]):
                        n += 1
                    forced.append(n)
        print(f"| {name} | {len(prompts)} | {decoded} | {differ} | {1 + sum(accepted) / len(accepted):.2f} | "
              f"{1 + sum(forced) / len(forced):.2f} |")


if __name__ == "__main__":
    main()
