"""Storage dtypes of hidden states: fp32, bf16, and fp8 (e4m3) with one fp32 scale per token and layer.

fp8 keeps 3 mantissa bits, so each value is stored within about 6% of its token-and-layer maximum;
per-layer scales matter because the residual stream grows by orders of magnitude with depth.
"""

from __future__ import annotations

import torch

from eyas.store.manifest import FP8_MAX

STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
BYTES_PER_VALUE = {"fp32": 4, "bf16": 2, "fp8": 1}
# max abs error / max abs value a stored layer may show against a recomputation (eyas verify)
TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2, "fp8": 1e-1}


def encode(x: torch.Tensor, dtype: str, groups: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, G*D] float -> (stored [N, G*D], scale [N, G] fp32 for fp8 else None)."""
    if dtype != "fp8":
        return x.to(STORAGE_DTYPES[dtype]).contiguous(), None
    n, width = x.shape
    x = x.float().view(n, groups, width // groups)  # [N, G, D]
    scale = x.abs().amax(dim=-1).clamp_min(1e-30) / FP8_MAX  # [N, G]
    q = (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)  # [N, G, D]
    return q.view(n, width).contiguous(), scale.contiguous()


def decode(stored: torch.Tensor, scale: torch.Tensor | None, out_dtype=torch.float32) -> torch.Tensor:
    """Inverse of encode: stored [N, G*D] (+ scale [N, G]) -> [N, G*D] in out_dtype."""
    if scale is None:
        return stored.to(out_dtype)
    n, width = stored.shape
    groups = scale.shape[-1]
    x = stored.float().view(n, groups, width // groups) * scale.float().unsqueeze(-1)  # [N, G, D]
    return x.view(n, width).to(out_dtype)


def bytes_per_token(dtype: str, num_aux: int, hidden: int) -> int:
    """Stored bytes per token: hidden states, scales, input_ids (int32) and loss_mask (uint8)."""
    values = (num_aux + 1) * hidden * BYTES_PER_VALUE[dtype]
    scales = (num_aux + 1) * 4 if dtype == "fp8" else 0
    return values + scales + 4 + 1


def state_layout(dtype: str, num_aux: int, hidden: int) -> dict[str, tuple[int, torch.dtype]]:
    """The captured per-token tensors of a shard: name -> (width, storage dtype)."""
    layout = {"aux_hidden": (num_aux * hidden, STORAGE_DTYPES[dtype]), "final_hidden": (hidden, STORAGE_DTYPES[dtype])}
    if dtype == "fp8":
        layout.update(aux_scale=(num_aux, torch.float32), final_scale=(1, torch.float32))
    return layout
