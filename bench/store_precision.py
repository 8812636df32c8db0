"""What a store's dtype does to the training labels: the target's next-token distribution from stored states.

    python bench/store_precision.py [--prompts 16] [--new-tokens 96]

Training reads the target's final hidden state (post-norm) from the store and turns it into the target's
next-token distribution with the target's lm_head: that distribution is what the draft learns to match. A
store in bf16 or fp8 rounds the state first. This measures, on SmolLM2's own answers to MT-bench first turns
(greedy, `--new-tokens` each, computed in fp32), how far the distribution from a stored-and-read state is
from the one the fp32 state gives, over the answer tokens (the ones under the loss mask):

- top-1 agreement: the share of tokens whose most likely next token is the same;
- KL(p_fp32 || p_stored) in nats, mean and 99th percentile;
- the relative error of the stored auxiliary states (max abs error / max abs value per token and layer),
  which the draft reads as its input features.

For scale, the row `bf16 compute` runs the same target in bf16 (as capture does on a GPU) and reads its
states unrounded: the labels move that much before any store is involved.

Rounding is done with the store's own codec (eyas/store/codec.py), so the figures are those of `eyas capture
--dtype bf16|fp8|fp8-aux` (fp8-aux: fp8 auxiliary states, bf16 final state). It says nothing of how much
acceptance a draft trained on fp8 states loses; it bounds how often its labels move.
"""

from __future__ import annotations

import argparse

import torch

from eyas.data.benchmarks import mtbench_questions
from eyas.store import codec
from eyas.target import load_target
from eyas.target.capture import FeatureCapture


def quantiles(x: torch.Tensor, q: float) -> float:
    return torch.quantile(x.float(), q).item() if x.numel() else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", type=int, default=16, help="MT-bench first turns")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(args.target, device="auto", dtype="fp32")
    tok, model = target.tokenizer, target.model
    capture = FeatureCapture(target)
    lm_head = target.lm_head
    target16 = load_target(args.target, device="auto", dtype="bf16")
    capture16 = FeatureCapture(target16)
    groups = capture.num_aux
    rows = {name: {"agree": [], "kl": [], "aux_err": []} for name in ("bf16 compute", "bf16", "fp8", "fp8-aux")}
    answer_tokens = 0
    for q in mtbench_questions()[: args.prompts]:
        text = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                       add_generation_prompt=True)
        prompt = tok(text, return_tensors="pt").input_ids.to(target.device)
        with torch.inference_mode():
            ids = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False)
        aux, final = capture(ids)  # [1, T, A*H], [1, T, H] fp32
        start = prompt.shape[1] - 1  # the states that predict the answer's tokens
        aux, final = aux[0, start:-1], final[0, start:-1]
        answer_tokens += final.shape[0]
        with torch.inference_mode():
            ref = torch.log_softmax(lm_head(final).float(), dim=-1)
            p_ref = ref.exp()
            aux16, final16 = capture16(ids)
            aux16, final16 = aux16[0, start:-1].float(), final16[0, start:-1].float()
            for name in rows:
                if name == "bf16 compute":
                    read_final, read_aux = final16, aux16
                else:
                    aux_dtype, final_dtype = codec.parts(name)
                    stored, scale = codec.encode(final, final_dtype, 1)
                    read_final = codec.decode(stored, scale)
                    a_stored, a_scale = codec.encode(aux, aux_dtype, groups)
                    read_aux = codec.decode(a_stored, a_scale)
                logp = torch.log_softmax(lm_head(read_final).float(), dim=-1)
                rows[name]["agree"].append(ref.argmax(-1) == logp.argmax(-1))
                rows[name]["kl"].append((p_ref * (ref - logp)).sum(-1))
                back = read_aux.view(aux.shape[0], groups, -1)
                orig = aux.view(aux.shape[0], groups, -1)
                err = (back - orig).abs().amax(-1) / orig.abs().amax(-1).clamp_min(1e-30)
                rows[name]["aux_err"].append(err.flatten())

    print(f"\n{target.name}, fp32 compute on {target.device}; {args.prompts} MT-bench first turns, "
          f"{answer_tokens} answer tokens ({args.new_tokens} new tokens each, greedy)")
    print("| states read | store bytes/token | top-1 agreement with fp32 | KL mean (nats) | KL p99 | aux rel. error mean | aux rel. error max |")
    print("|---|---|---|---|---|---|---|")
    hidden = target.hidden_size
    for name, r in rows.items():
        agree = torch.cat(r["agree"]).float().mean().item()
        kl = torch.cat(r["kl"])
        err = torch.cat(r["aux_err"])
        size = f"{codec.bytes_per_token(name, capture.num_aux, hidden):,}" if name in codec.PARTS else "-"
        print(f"| {name} | {size} | {100 * agree:.2f} % | "
              f"{kl.mean().item():.2e} | {quantiles(kl, 0.99):.2e} | {err.mean().item():.4f} | {err.max().item():.4f} |")


if __name__ == "__main__":
    main()
