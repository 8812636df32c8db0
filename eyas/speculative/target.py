"""The target side of speculative decoding: a preallocated KV cache and one forward call.

`KVCache` speaks the part of the transformers `Cache` protocol that decoder layers use
(`update(k, v, layer_idx)`, `get_seq_length()`). It writes new keys/values after the committed
length, and the engine then either commits them as they are (`advance`), or keeps an arbitrary
subset such as an accepted tree path (`keep`), moved down to sit right after the committed part.
Nothing is ever recomputed from the start, and rolling back costs nothing: uncommitted entries are
simply overwritten by the next call.

`TargetRunner.forward` always passes an explicit 4D mask and explicit position ids, which
transformers hands to the attention unchanged, so one code path serves prefill, plain decoding,
chain verification (causal) and tree verification (ancestor mask). The aux hidden states of every
fed token come from forward hooks on the decoder layers in that same pass (HF index k is the
output of decoder layer k-1; docs/ALGORITHM.md section 1).

The buffers have a fixed capacity, so a later static-shape/CUDA-graph path only has to keep the
query length fixed and return the full buffers (the mask already covers unused slots).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys/values of every target layer in one buffer [L, B, kv_heads, capacity, head_dim]."""

    is_compileable = False

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device, batch: int = 1):
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # committed entries
        self.capacity = capacity

    # -- the transformers Cache protocol (what decoder layers call)
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        q = key_states.shape[2]
        end = self.length + q
        if end > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({end} tokens)")
        self.keys[layer_idx, :, :, self.length:end] = key_states
        self.values[layer_idx, :, :, self.length:end] = value_states
        return self.keys[layer_idx, :, :, :end], self.values[layer_idx, :, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    # -- what the engine calls after a forward
    def advance(self, num_tokens: int) -> None:
        """Commit the first `num_tokens` entries written by the last forward."""
        self.length += num_tokens

    def keep(self, offsets: list[int]) -> None:
        """Commit the entries at `length + offsets` (ascending) of the last forward, compacted.

        Moved one entry at a time (a tree path is at most its depth long): slice copies need no index
        tensor on the device, so no host-to-device copy; a chain path is already in place.
        """
        for i, off in enumerate(offsets):
            if off != i:  # ascending offsets: the source lies at or after every destination written so far
                src, dst = self.length + off, self.length + i
                self.keys[:, :, :, dst] = self.keys[:, :, :, src]
                self.values[:, :, :, dst] = self.values[:, :, :, src]
        self.length += len(offsets)


def cache_geometry(config) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a transformers decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def varying_shape_attention():
    """The SDPA backends for eager passes whose shapes change from call to call (prefills, the dynamic
    engine): all but cuDNN, which builds and caches an execution plan for each new shape before its first
    call. That plan pays off in the fixed-shape CUDA graphs of the static path (the fastest verify
    attention on an H200, docs/PERFORMANCE.md) but would be built again for every new prompt length."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class TargetRunner:
    """Runs the target over new tokens with a KVCache; optionally captures aux hidden states."""

    def __init__(self, model, aux_layers: list[int] | None):
        self.model = model
        self.aux_layers = list(aux_layers or [])
        self.layers = model.model.layers
        bad = [i for i in self.aux_layers if not 1 <= i <= len(self.layers) - 1]
        if bad:  # a hook on layer i - 1 reads hidden_states[i]; the last index is post-norm in HF, a hook's is not
            raise ValueError(f"aux layers {bad} lie outside 1..{len(self.layers) - 1} (HF hidden_states indices of this "
                             f"{len(self.layers)}-layer target whose states a layer hook can read)")
        self.attn_impl = getattr(model.config, "_attn_implementation", "sdpa")
        if self.attn_impl not in ("sdpa", "eager"):
            raise ValueError(f"speculative decoding needs sdpa or eager attention for tree masks, not {self.attn_impl!r}")
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        self.forward_tokens = 0  # every token the target has been fed (prefill included)

    def new_cache(self, capacity: int) -> KVCache:
        p = next(self.model.parameters())
        return KVCache(*cache_geometry(self.model.config), capacity, p.dtype, p.device)

    # -- aux capture: hooks live only while a generation runs (the target may be shared)
    def attach(self) -> None:
        if self._hooks or not self.aux_layers:
            return
        for hf_index in self.aux_layers:
            def hook(module, args, output, hf_index=hf_index):
                self._captured[hf_index] = output[0] if isinstance(output, tuple) else output
            self._hooks.append(self.layers[hf_index - 1].register_forward_hook(hook))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._captured.clear()

    def _mask(self, mask: torch.Tensor):
        if self.attn_impl == "sdpa":
            return mask
        dtype = next(self.model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

    @torch.no_grad()
    def forward(self, cache: KVCache, input_ids, position_ids, mask, last_only: bool = False, aux: bool = True,
                keep: torch.Tensor | None = None):
        """Feed input_ids [1, T] at position_ids [1, T] with mask [1, 1, T, length + T] (bool, True = attend).

        Returns (logits fp32 of every row [T, V], of the last [1, V], or of the K rows that the device
        tensor `keep` names [K, V]; aux_hidden [T, A*H] or None). The new entries are written after
        `cache.length` but not committed: call cache.advance or cache.keep.
        """
        self._captured.clear()
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=self._mask(mask),
                         past_key_values=cache, use_cache=True,
                         logits_to_keep=keep if keep is not None else 1 if last_only else 0)
        self.forward_tokens += input_ids.shape[1]
        logits = out.logits[0].float()
        hidden = None
        if aux and self.aux_layers:
            hidden = torch.cat([self._captured[k][0] for k in self.aux_layers], dim=-1)  # [T, A*H]
        self._captured.clear()
        return logits, hidden


class Positions:
    """Device buffers made once per generation, so that a cycle's position ids and causal masks are
    views or one comparison kernel, never tensors built on the host and copied over (each such copy
    waits for the device on CUDA)."""

    def __init__(self, capacity: int, device):
        self.ids = torch.arange(capacity, device=device)[None]  # [1, C]
        self.all_true = torch.ones(1, 1, 1, capacity, dtype=torch.bool, device=device)

    def at(self, start: int, num: int) -> torch.Tensor:
        """Position ids start..start+num-1, [1, num] (a view)."""
        return self.ids[:, start:start + num]

    def causal(self, past: int, new: int) -> torch.Tensor:
        """The same mask as causal_mask(past, new): a view for one new token, else one comparison."""
        if new == 1:
            return self.all_true[..., :past + 1]
        cols = self.ids[0, :past + new]
        return (cols[None, :] <= cols[past:, None])[None, None]


def causal_mask(past: int, new: int, device) -> torch.Tensor:
    """[1, 1, new, past + new]: every new token sees the past and the new tokens up to itself."""
    return torch.ones(new, past + new, dtype=torch.bool, device=device).tril(past)[None, None]


def tree_mask(past: int, parents: list[int], device) -> torch.Tensor:
    """[1, 1, T, past + T] for T tree nodes given as parent indices (-1 = root; parents come first).

    A node sees the committed past, its ancestors and itself.
    """
    t = len(parents)
    anc = torch.zeros(t, t, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    full = torch.cat([torch.ones(t, past, dtype=torch.bool), anc], dim=1)
    return full.to(device)[None, None]
