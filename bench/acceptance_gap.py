"""Where a trained draft's acceptance goes: its own training data against benchmark prompts.

    python bench/acceptance_gap.py --draft RUN/train --prepared RUN/prepared/dataset

For each prompt the speculative engine decodes greedily (chain of --steps, SmolLM2 in fp32 on the CPU by
default, so the engine's tokens are the target's). Then the training computation (the TTT forward of
eyas/train/ttt.py, teacher-forced) scores the draft on exactly those tokens. The two must agree: if the
engine accepted much less than the teacher-forced accuracy, the engine and the training would disagree
about the draft's inputs (a bug); if both are low on benchmark prompts and high on training prompts,
the draft does not generalise beyond its data. A last row scores the stored training responses whole,
the figure `eyas train` logs (on data the draft has seen).

Prints one table: per prompt set, the engine's tau and acceptance rate by position (the fraction of
cycles whose draft token i was accepted, given that token i-1 was), and the teacher-forced accuracy by
step on the same tokens.
"""

from __future__ import annotations

import argparse

import torch

from eyas.speculative.build import build_engine
from eyas.data.benchmarks import humaneval_prompts, mtbench_questions
from eyas.speculative.bench import encode_turn
from eyas.target import load_target
from eyas.target.capture import FeatureCapture
from eyas.train.ttt import ttt_forward


class Scorer:
    """Teacher-forced accuracy per TTT step of the draft on given token sequences, pooled."""

    def __init__(self, target, draft, aux_layers: list[int], steps: int):
        self.capture = FeatureCapture(target, aux_layers)
        self.lm_head = target.model.lm_head.weight.detach().float()
        self.draft, self.steps = draft, steps

    def __call__(self, seq: list[int], start: int) -> tuple[list[int], list[int]]:
        """(correct, count) per step over the positions from `start` on."""
        ids = torch.tensor([seq])
        aux, final = self.capture(ids, torch.ones_like(ids))
        loss_mask = torch.zeros(ids.shape, dtype=torch.float32)
        loss_mask[0, start:] = 1
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool), "loss_mask": loss_mask,
                 "aux_hidden": aux.float(), "final_hidden": final.float()}
        with torch.no_grad():
            res = ttt_forward(self.draft, batch, self.lm_head, self.steps, impl="reference")
        return res.correct_k, res.count_k


def conditional_rates(accepted: list[int], steps: int) -> list[float]:
    """P(draft token i accepted | token i-1 accepted) from the accepted count of each cycle."""
    reached = [sum(1 for a in accepted if a >= i) for i in range(steps + 1)]
    return [reached[i + 1] / reached[i] if reached[i] else 0.0 for i in range(steps)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, help="a training run directory (RUN/train) or a checkpoint")
    p.add_argument("--prepared", help="the prepared data set the draft was trained on (RUN/prepared/dataset)")
    p.add_argument("--prompts", type=int, default=6, help="prompts per set")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2", device="cpu", dtype=args.dtype)
    engine, info = build_engine(target, args.draft)
    draft = engine.draft.float()
    score = Scorer(target, draft, info["aux"], args.steps)

    sets: dict[str, list[list[int]]] = {}
    stored: list[tuple[list[int], int]] = []
    if args.prepared:
        from datasets import load_from_disk

        data = load_from_disk(args.prepared)
        stride = max(1, len(data) // args.prompts)
        for i in range(0, stride * args.prompts, stride):
            row = data[i]
            start = row["loss_mask"].index(1)  # the first assistant token: the prompt is what precedes it
            stored.append((row["input_ids"], start))
        sets["training prompts"] = [ids[:start] for ids, start in stored]
    sets["MT-bench first turns"] = [encode_turn(target.tokenizer, [{"role": "user", "content": q["turns"][0]}])
                                    for q in mtbench_questions()[:args.prompts]]
    sets["HumanEval (as a user turn, like eyas eval)"] = [
        encode_turn(target.tokenizer, [{"role": "user", "content": t["prompt"]}]) for t in humaneval_prompts()[:args.prompts]]

    rows = []
    for name, prompts in sets.items():
        accepted, correct, count = [], [0] * args.steps, [0] * args.steps
        for ids in prompts:
            res = engine.generate(ids, args.new_tokens, steps=args.steps)
            accepted += res.accepted_per_cycle
            c, n = score(ids + res.tokens, len(ids))
            correct = [a + b for a, b in zip(correct, c)]
            count = [a + b for a, b in zip(count, n)]
        tau = 1 + sum(accepted) / max(1, len(accepted))
        rows.append((name, len(prompts), f"{tau:.2f}", conditional_rates(accepted, args.steps),
                     [c / max(n, 1) for c, n in zip(correct, count)]))
    if stored:
        correct, count = [0] * args.steps, [0] * args.steps
        for ids, start in stored:
            c, n = score(ids, start)
            correct = [a + b for a, b in zip(correct, c)]
            count = [a + b for a, b in zip(count, n)]
        rows.append(("training responses as stored (whole)", len(stored), "-", None,
                     [c / max(n, 1) for c, n in zip(correct, count)]))

    print(f"\ndraft {args.draft}; SmolLM2 {args.dtype} on the CPU; chain {args.steps}, {args.new_tokens} new tokens per prompt")
    print("| prompts | n | engine tau | engine acceptance by position (conditional) | teacher-forced accuracy by step |")
    print("|---|---|---|---|---|")
    for name, n, tau, engine_rates, forced in rows:
        eng = " ".join(f"{x:.2f}" for x in engine_rates) if engine_rates else "-"
        print(f"| {name} | {n} | {tau} | {eng} | {' '.join(f'{x:.2f}' for x in forced)} |")


if __name__ == "__main__":
    main()
