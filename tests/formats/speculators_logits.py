"""Run where speculators imports (speculators_env.speculators_command): load an eyas export with speculators'
own config and model classes and write its per-TTT-step draft logits for the given inputs.

usage: python speculators_logits.py EXPORT_DIR INPUTS.safetensors OUTPUTS.safetensors [EXPORT_DIR IN OUT ...]
(several triples in one process: importing speculators takes most of the time)

INPUTS holds aux_hidden [1, T, A*H] fp32, input_ids [1, T], position_ids [1, T] and ttt_steps [1].
OUTPUTS gets logits [K, 1, T, Vd] (the lm_head outputs of speculators' forward, one per TTT step)
and the d2t/t2d buffers speculators loaded (when the draft vocab is reduced), and `layout`: its config's
fc_norm and norm_output and whether it built the per-aux norms.
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def main(export_dir: str, inputs_path: str, outputs_path: str) -> None:
    inputs = load_file(inputs_path)
    config = Eagle3SpeculatorConfig.from_pretrained(export_dir)
    # dense masks instead of flex attention, which wants a compiler on CPU
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(export_dir, config=config, dtype=torch.float32).eval()
    # speculators fills a missing embedding from the verifier only if it finds NaN there, but with
    # transformers 5.19 a missing weight comes back as uninitialised memory (often zeros), so an export
    # without embed_tokens (eyas's default: engines take the target's) would run on garbage. Load it
    # from the verifier with speculators' own loader, as it means to.
    model._load_verifier_weights(overwrite_embed_tokens=True)

    logits = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().clone()))
    ids = inputs["input_ids"].long()
    with torch.no_grad():
        model(hidden_states=inputs["aux_hidden"], input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=inputs["position_ids"].long(), ttt_steps=int(inputs["ttt_steps"][0]))
    out = {"logits": torch.stack(logits).contiguous()}
    if model.d2t is not None:
        out["d2t"], out["t2d"] = model.d2t.contiguous(), model.t2d.contiguous()
    out["aux_layer_ids"] = torch.tensor(model.config.eagle_aux_hidden_state_layer_ids)
    out["layout"] = torch.tensor([model.config.fc_norm, model.config.norm_output, model.fc_norm is not None])
    save_file(out, outputs_path)


if __name__ == "__main__":
    args = sys.argv[1:]
    assert args and len(args) % 3 == 0, __doc__
    for i in range(0, len(args), 3):
        main(*args[i:i + 3])
