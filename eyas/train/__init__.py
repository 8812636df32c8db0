"""Training of the EAGLE-3 draft with training-time test (TTT).

- `ttt.py`: the vectorised, unrolled TTT forward and loss (the exact index arithmetic is documented there).
- `kernels.py`: the fast path's attention (dense GEMM or FlexAttention) and fused lm_head + soft cross-entropy.
- `data.py`: token-budget batches, deterministic per (seed, epoch), resumable, sharded by rank; tailing a live store.
- `source.py`: `TrainSource` (samples + frozen target head + vocab) and `store_source(store, expect=...)`.
- `loop.py`: `train(cfg, out_dir, source, resume=False) -> summary dict`.
- `checkpoint.py`, `metrics.py`, `dist.py`: atomic step dirs, metrics sinks, DDP/FSDP2 under torchrun.

This package never imports eyas.target: the online source's feature function is built by the caller.
"""

from eyas.train.loop import train
from eyas.train.source import TrainSource, store_source
from eyas.train.ttt import simulated_tau, ttt_forward

__all__ = ["train", "TrainSource", "store_source", "ttt_forward", "simulated_tau"]
