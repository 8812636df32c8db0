"""Capture the target's residual streams at the aux layers and its final normed state, by forward hooks.

HF convention (docs/ALGORITHM.md section 1): id k in 1..n-1 is the output of decoder layer k-1; the final
state is the output of the final norm, i.e. the lm_head's input (HF `hidden_states[n]`). Only the base
model (`target.decoder`) runs, so no lm_head (a V-wide matmul) is computed, and transformers is never
asked for all hidden states.

`FeatureCapture` is a plain callable with no I/O; the store capture loop and the online training source
both use it.
"""

from __future__ import annotations

import torch

from eyas.layers import resolve_aux_layers


def _first(output):
    """Decoder layers return a tensor in transformers 5 and a tuple in older versions."""
    return output[0] if isinstance(output, (tuple, list)) else output


class FeatureCapture:
    """`(input_ids [B,T], attention_mask [B,T]) -> (aux_hidden [B,T,A*H], final_hidden [B,T,H])`."""

    def __init__(self, target, aux_layers: list[int] | None = None):
        self.target = target
        self.aux_layers = resolve_aux_layers(aux_layers, target.num_layers)

    @property
    def num_aux(self) -> int:
        return len(self.aux_layers)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        grabbed: dict[int, torch.Tensor] = {}
        handles = []

        def keep(key):
            def hook(_module, _inputs, output):
                grabbed[key] = _first(output)
            return hook

        layers = self.target.layers
        for k in self.aux_layers:
            handles.append(layers[k - 1].register_forward_hook(keep(k)))
        handles.append(self.target.norm.register_forward_hook(keep("final")))
        try:
            self.target.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        missing = [k for k in [*self.aux_layers, "final"] if k not in grabbed]
        assert not missing, f"hooks did not fire for {missing}: the model's layer layout is not the expected one"
        aux_hidden = torch.cat([grabbed[k] for k in self.aux_layers], dim=-1)  # [B, T, A*H]
        final_hidden = grabbed["final"]  # [B, T, H]
        return aux_hidden, final_hidden
