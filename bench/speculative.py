"""Speculative-decoding engine costs on a target: plain decoding vs transformers generate, the verify
pass as a function of its width, and chain/tree decoding with an untrained and an oracle draft.

    python bench/speculative.py                          # SmolLM2 on CPU (fp32), 3 MT-bench-like prompts, 48 tokens
    python bench/speculative.py --device cuda --new-tokens 256 --steps 3,5,7 --tree 10,8,60

An untrained draft accepts nothing, so its row is the engine's overhead (draft + wider verify per token).
The oracle draft proposes the target's own greedy tokens (tau = k + 1): its row is the ceiling the engine
reaches with a perfect draft at that shape; a trained draft lands in between. All greedy outputs are
checked against plain decoding. Timings are after one warm-up of each mode; batch 1.
"""

from __future__ import annotations

import argparse
import time

import torch

from eyas.speculative.bench import encode_turn, parse_tree
from eyas.speculative.engine import SpecEngine
from eyas.speculative.oracle import ScriptedDraft, untrained_draft
from eyas.speculative.target import TargetRunner, causal_mask
from eyas.layers import resolve_aux_layers
from eyas.target import load_target

PROMPTS = ["Explain in a few sentences why the sky is blue.",
           "Write a Python function that checks whether a number is prime.",
           "Give three tips for staying focused while studying."]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_cost(target, widths, context: int, reps: int) -> dict[int, float]:
    """Seconds per target forward of `w` new tokens after `context` cached ones."""
    runner = TargetRunner(target.model, None)
    ids = torch.randint(0, target.vocab_size, (1, context + max(widths)), device=target.device)
    cache = runner.new_cache(context + max(widths))
    runner.forward(cache, ids[:, :context], torch.arange(context, device=target.device)[None],
                   causal_mask(0, context, target.device), last_only=True, aux=False)
    cache.advance(context)
    out = {}
    for w in widths:
        pos = torch.arange(context, context + w, device=target.device)[None]
        mask = causal_mask(context, w, target.device)
        runner.forward(cache, ids[:, context:context + w], pos, mask, aux=False)  # warm-up
        sync(target.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            runner.forward(cache, ids[:, context:context + w], pos, mask, aux=False)
        sync(target.device)
        out[w] = (time.perf_counter() - t0) / reps
    return out


def run(fn, prompts, refs=None) -> tuple[float, float, bool, list]:
    """-> (tokens/s, tau pooled, all outputs equal refs, outputs)."""
    n, secs, acc, cycles, outs = 0, 0.0, 0, 0, []
    for i, ids in enumerate(prompts):
        res = fn(ids)
        outs.append(res.tokens)
        n += len(res.tokens)
        secs += res.total_s
        acc += sum(res.accepted_per_cycle)
        cycles += res.num_cycles
    same = refs is None or outs == refs
    return n / secs, (acc + cycles) / max(1, cycles), same, outs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--steps", default="3,5")
    p.add_argument("--tree", default="4,4,12")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(args.target, device=args.device, dtype=args.dtype)
    tok, dev = target.tokenizer, target.device
    aux = resolve_aux_layers(None, target.num_layers)
    prompts = [encode_turn(tok, [{"role": "user", "content": q}]) for q in (PROMPTS * 4)[: args.prompts]]
    new = args.new_tokens
    print(f"target {target.name} on {dev} ({target.dtype}), {torch.get_num_threads()} threads, "
          f"{len(prompts)} prompts x {new} new tokens (no eos stop), batch 1", flush=True)

    widths = sorted({1, 2, 4, 8, 16} | {k + 1 for k in map(int, args.steps.split(","))})
    cost = verify_cost(target, widths, context=256, reps=5)
    print("target forward after 256 cached tokens: " + ", ".join(f"{w} tok {s * 1000:.1f} ms" for w, s in cost.items()))

    rows = []
    plain = SpecEngine(target.model)
    plain.plain_generate(prompts[0], 8)
    tps, _, _, refs = run(lambda ids: plain.plain_generate(ids, new), prompts)
    rows.append(("plain decoding (eyas engine)", tps, 1.0, True))

    def hf(ids):
        x = torch.tensor([ids], device=dev)
        sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            y = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False, pad_token_id=tok.pad_token_id)
        sync(dev)
        from eyas.speculative.engine import GenResult

        return GenResult(tokens=y[0, x.shape[1]:].tolist(), total_s=time.perf_counter() - t0)

    hf(prompts[0])
    tps, _, _, _ = run(hf, prompts)  # min_new_tokens masks eos, so its text may differ after an eos
    rows.append(("transformers generate", tps, 1.0, None))

    untrained = SpecEngine(target.model, untrained_draft(target, min(8192, target.vocab_size))[0], aux)
    settings = [(f"chain-{k}", {"steps": int(k)}) for k in args.steps.split(",")]
    if args.tree:
        settings.append((f"tree-{args.tree.replace(',', 'x')}", {"tree": parse_tree(args.tree)}))
    for name, setting in settings:
        untrained.generate(prompts[0], 8, **setting)
        tps, tau, same, _ = run(lambda ids: untrained.generate(ids, new, **setting), prompts, refs)
        rows.append((f"{name}, untrained draft", tps, tau, same))

        def oracle_gen(ids, setting=setting):
            seq = ids + refs[prompts.index(ids)]
            engine = SpecEngine(target.model, ScriptedDraft(seq, target.vocab_size), aux)
            return engine.generate(ids, new, **setting)

        oracle_gen(prompts[0])
        tps, tau, same, _ = run(oracle_gen, prompts, refs)
        rows.append((f"{name}, oracle draft", tps, tau, same))

    base = rows[0][1]
    print(f"\n| mode | tokens/s | tau | vs plain | output = plain greedy |\n|---|---|---|---|---|")
    for name, tps, tau, same in rows:
        print(f"| {name} | {tps:.1f} | {tau:.2f} | {tps / base:.2f}x | {'-' if same is None else 'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
