"""The draft's KV cache: preallocated storage written in place, rolled back by length.

A `DraftCache` is a length over two storage tensors [B, nkv, capacity, head_dim] (RoPE already applied
to the keys). A forward that appends T entries writes them at slots length..length+T-1 and returns a
new `DraftCache` of length + T on the same storage; only when the storage is full is it replaced by one
of about twice the capacity (one copy, so appending costs O(T) amortised instead of a copy of the whole
cache per step). `crop(n)` rolls back by length: the next append simply overwrites the entries past n.

The objects are cheap values over shared storage, so a cache stays valid as long as nothing has been
appended through a *shorter* cache of the same storage (then its tail was overwritten). That is how
the engine uses it: one live cache, cut back to the committed length and extended again. Under
autograd (an input requiring grad) appends concatenate instead, so the training path keeps exactly
the old out-of-place semantics.

It behaves like the old `(k, v)` tuple: `cache[0]`, `cache[1]` and `k, v = cache` give the valid
views [B, nkv, length, head_dim]. A plain `(k, v)` tuple is still accepted as `past_key_values`; it is
never written into (its first append copies it into new storage).
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 64  # slots of a grown storage at least


class DraftCache:
    __slots__ = ("k_store", "v_store", "length")

    def __init__(self, k_store: torch.Tensor, v_store: torch.Tensor, length: int | None = None):
        self.k_store, self.v_store = k_store, v_store
        self.length = k_store.shape[2] if length is None else int(length)
        assert 0 <= self.length <= k_store.shape[2] and k_store.shape[2] == v_store.shape[2], "bad cache length"

    @classmethod
    def wrap(cls, past) -> "DraftCache | None":
        """None, a DraftCache, or a (k, v) tuple (used as storage that is full, so never written)."""
        if past is None or isinstance(past, DraftCache):
            return past
        k, v = past
        return cls(k, v)

    @classmethod
    def empty(cls, like: torch.Tensor, capacity: int) -> "DraftCache":
        """An empty cache with room for `capacity` entries shaped like `like` [B, nkv, *, head_dim]."""
        b, h, _, d = like.shape
        return cls(like.new_empty(b, h, capacity, d), like.new_empty(b, h, capacity, d), 0)

    @property
    def capacity(self) -> int:
        return self.k_store.shape[2]

    @property
    def key(self) -> torch.Tensor:
        return self.k_store[:, :, :self.length]

    @property
    def value(self) -> torch.Tensor:
        return self.v_store[:, :, :self.length]

    # tuple-like access, as the old (k, v) past_key_values
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        return (self.key, self.value)[i]

    def __iter__(self):
        yield self.key
        yield self.value

    def __repr__(self) -> str:
        return f"DraftCache(length={self.length}, capacity={self.capacity}, shape={tuple(self.k_store.shape)})"

    def crop(self, n: int) -> "DraftCache":
        """The first n entries (roll back by length; nothing is copied)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a draft cache of length {self.length} to {n}")
        return DraftCache(self.k_store, self.v_store, n)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> "DraftCache":
        """This cache plus k, v [B, nkv, T, head_dim]: written in place after `length`, growing if full."""
        n, t = self.length, k.shape[2]
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or self.k_store.requires_grad
                                        or self.v_store.requires_grad):
            # autograd may have saved the storage for backward: stay out of place, as before
            return DraftCache(torch.cat([self.key, k], dim=2), torch.cat([self.value, v], dim=2))
        ks, vs = self.k_store, self.v_store
        if n + t > self.capacity:
            grown = DraftCache.empty(k, max(n + t, 2 * self.capacity, MIN_CAPACITY))
            ks, vs = grown.k_store, grown.v_store
            ks[:, :, :n].copy_(self.key)
            vs[:, :, :n].copy_(self.value)
        ks[:, :, n:n + t].copy_(k)
        vs[:, :, n:n + t].copy_(v)
        return DraftCache(ks, vs, n + t)
