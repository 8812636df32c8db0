"""The capture stage's forward passes: a shard's rows -> token-budgeted passes of the target -> its states
in a host buffer, lowering the budget and retrying when a pass runs out of memory."""

from __future__ import annotations

import numpy as np
import torch

from eyas.common import EyasError, warn
from eyas.data.prepared import Prepared
from eyas.store.batching import next_batch
from eyas.store.codec import encode, parts
from eyas.store.staging import ShardBuffer
from eyas.target.capture import FeatureCapture


class BatchRunner:
    """A shard's rows -> token-budgeted forward passes -> its states in a host buffer; on OOM, a smaller budget.

    An out-of-memory error halves the token budget (until the failed pass's rows no longer fit in one
    pass) and re-plans the rest of the shard from the failed pass on, for this and every later shard.
    Budgets stay the first budget over a power of two, so a budget forced 4x too large ends at the one
    that fits and forms exactly the batches a run with that budget forms: the store is bit-identical.
    """

    def __init__(self, features: FeatureCapture, prepared: Prepared, dtype: str, budget: int,
                 inject_oom_tokens: int = 0, pad_id: int = 0):
        self.features, self.prepared, self.dtype = features, prepared, dtype
        self.budget, self.inject_oom_tokens, self.pad_id = budget, inject_oom_tokens, pad_id
        self.device = features.target.device
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.num_splits = 0  # forward passes that ran out of memory and were re-planned smaller

    def run_shard(self, rows: np.ndarray, buffer: ShardBuffer, on_pass=None) -> None:
        lengths = self.prepared.lengths
        start = 0
        while start < len(rows):
            batch = rows[start:start + next_batch(rows[start:], lengths, self.budget)]
            try:
                states, nonfinite = self._forward(batch)
            except torch.OutOfMemoryError as e:
                reason = str(e).splitlines()[0][:120] if str(e) else "out of memory"
            else:
                buffer.put(states, self.copy_stream, nonfinite)
                del states, nonfinite
                start += len(batch)
                if on_pass is not None:
                    on_pass(int(lengths[batch].sum()))
                continue
            # here, outside the except block, the failed pass's tensors (held by the traceback) are freed
            self._shrink(rows[start:], batch, reason)

    def _shrink(self, rest: np.ndarray, failed: np.ndarray, reason: str) -> None:
        lengths = self.prepared.lengths
        padded = len(failed) * int(lengths[failed].max())
        if len(failed) == 1:
            raise EyasError(f"one sample of {padded} tokens does not fit in memory ({reason}); "
                            f"lower data.max_length or use a device with more memory")
        self.num_splits += 1
        while self.budget > 1 and next_batch(rest, lengths, self.budget) >= len(failed):
            self.budget //= 2
        warn(f"out of memory on a forward pass of {len(failed)} samples ({padded} padded tokens): {reason}; "
             f"token budget now {self.budget}, retrying with {next_batch(rest, lengths, self.budget)} samples")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _forward(self, rows: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(the stored states of the rows' real tokens, [B] tokens per row whose states hold a NaN or inf)."""
        lengths = self.prepared.lengths[rows]
        batch, longest = len(rows), int(lengths.max())
        if self.inject_oom_tokens and batch * longest > self.inject_oom_tokens:
            raise torch.OutOfMemoryError(f"injected: {batch * longest} tokens > capture.inject_oom_tokens")
        ids = np.full((batch, longest), self.pad_id, dtype=np.int64)  # [B, L], right padding
        mask = np.zeros((batch, longest), dtype=np.int64)  # [B, L]
        for b, row in enumerate(rows):
            ids[b, :lengths[b]] = self.prepared.input_ids(row)
            mask[b, :lengths[b]] = 1
        # flat positions of the real tokens, samples in row order: computed here, so that unpadding on the
        # device needs no device-to-host sync (a boolean mask index would wait for the forward pass)
        real = np.concatenate([b * longest + np.arange(n) for b, n in enumerate(lengths)])  # [t]
        owner = np.repeat(np.arange(batch), lengths)  # [t] the row of each real token
        ids_t, mask_t, real_t, owner_t = (self._to_device(a) for a in (ids, mask, real, owner))
        aux, final = self.features(ids_t, mask_t)  # [B, L, A*H], [B, L, H]
        aux = aux.reshape(batch * longest, -1).index_select(0, real_t)  # [t, A*H]
        final = final.reshape(batch * longest, -1).index_select(0, real_t)  # [t, H]
        # a token's states hold a NaN or inf iff their sum does (one read, no [t, A*H] mask). Summed in fp32: an
        # fp16 sum overflows at 65504, which a target's massive activations reach with every value finite (only
        # values near 1e34 overflow here). Counted per row on the device, read by the writer thread
        bad = ~(torch.isfinite(aux.sum(-1, dtype=torch.float32)) & torch.isfinite(final.sum(-1, dtype=torch.float32)))
        nonfinite = torch.zeros(batch, dtype=torch.int32, device=aux.device).index_add_(0, owner_t, bad.int())  # [B]
        aux_dtype, final_dtype = parts(self.dtype)
        aux_q, aux_s = encode(aux, aux_dtype, self.features.num_aux)
        final_q, final_s = encode(final, final_dtype, 1)
        states = {"aux_hidden": aux_q, "final_hidden": final_q}
        if aux_s is not None:
            states["aux_scale"] = aux_s
        if final_s is not None:
            states["final_scale"] = final_s
        return states, nonfinite

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Through pinned memory on CUDA: a copy from pageable memory may wait for the device to be idle."""
        t = torch.from_numpy(array)
        return t.pin_memory().to(self.device, non_blocking=True) if self.copy_stream is not None else t.to(self.device)
