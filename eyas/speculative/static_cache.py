"""The fixed-capacity caches of the static (CUDA graph) path, and the capacities a generation needs.

A CUDA graph fixes every shape and every address, so the caches do too:

- the target's KV cache has a fixed capacity C; a forward writes its T entries at the slots named by a
  device tensor (slot = position) and attends over the first W slots with the mask `slot <= position`,
  W the attended width (graphs.py picks it per pass);
- the draft's cache works the same way (fixed storage, writes at device slots, masks over W slots).

The host keeps an upper bound of the device's committed length and never queues a pass that could write
past C: the `*_capacity` functions below are those bounds, checked before a generation starts.
"""

from __future__ import annotations

import torch

from eyas.draft.cache import DraftCache
from eyas.speculative.target import KVCache


def plain_capacity(n: int, max_new: int) -> int:
    """Cache slots that plain decoding of max_new tokens after an n-token prompt may write (two steps ahead)."""
    return n + max_new + 3


def chain_capacity(n: int, max_new: int, k: int) -> int:
    """Cache slots that chains of k may write: up to two cycles in flight beyond the host's last read, and
    each cycle writes k + 1 slots after the committed ones."""
    return n + max_new + 3 * (k + 1) + 1


def tree_capacity(n: int, max_new: int, topk: int, depth: int, total: int) -> int:
    """Cache slots that trees may write: as for chains, with a cycle writing up to max(total + 1 target
    slots, (depth - 1) * topk draft slots, depth + 1 rebuilt ones) after the committed ones."""
    return n + max_new + 3 * max(total + 1, (depth - 1) * topk, depth + 1) + 1


class StaticKVCache(KVCache):
    """The target's cache with writes at device slots (`self.slots`, set before each forward) and reads
    of the first `self.width` slots; the caller's mask hides what a query may not see."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots: torch.Tensor | None = None
        self.width = self.capacity

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.slots, key_states)
        self.values[layer_idx].index_copy_(2, self.slots, value_states)
        return self.keys[layer_idx][:, :, :self.width], self.values[layer_idx][:, :, :self.width]


class StaticDraftCache(DraftCache):
    """The draft's cache with writes at device slots and reads of the first `self.width` slots (see above)."""

    __slots__ = ("slots", "width")

    def __init__(self, k_store: torch.Tensor, v_store: torch.Tensor):
        super().__init__(k_store, v_store)
        self.slots: torch.Tensor | None = None
        self.width = k_store.shape[2]

    @property
    def key(self) -> torch.Tensor:
        return self.k_store[:, :, :self.width]

    @property
    def value(self) -> torch.Tensor:
        return self.v_store[:, :, :self.width]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> "StaticDraftCache":
        self.k_store.index_copy_(2, self.slots, k)
        self.v_store.index_copy_(2, self.slots, v)
        return self


def draft_pass(draft, hidden, ids, position_ids, mask, k_store, v_store, slots):
    """The draft's forward over its whole static cache given as tensors (entries written at `slots`): what
    `GraphDecoder._draft` runs under compile_draft, so that a compiled pass traces no writes to the decoder's
    cache object. -> (hidden_out [1, T, H], logits [1, T, Vd])."""
    cache = StaticDraftCache(k_store, v_store)  # reads every slot: its width is the stores'
    cache.slots = slots
    out = draft(hidden, ids, position_ids, past_key_values=cache, attention_mask=mask)
    return out.hidden_out, out.logits
