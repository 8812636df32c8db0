"""Storage dtypes of hidden states: fp32, bf16, and fp8 (e4m3) with one fp32 scale per token and layer.

fp8 keeps 3 mantissa bits, so each value is stored within about 6% of its token-and-layer maximum;
per-layer scales matter because the residual stream grows by orders of magnitude with depth.

A store's dtype names the dtype of each part (`PARTS`): `fp8-aux` keeps the auxiliary states (the draft's
input features) in fp8 and the final state, from which training takes the target's distribution, in bf16.
An fp8 final state moves the target's top-1 token at 3.5 % of SmolLM2's answer tokens, 2.6 times as often
as computing in bf16 does (`bench/store_precision.py`, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch

from eyas.store.manifest import FP8_MAX

STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# max abs error / max abs value a stored layer may show against a recomputation (eyas verify)
TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2, "fp8": 1e-1}
# a store's dtype -> (dtype of the auxiliary states, dtype of the final state)
# (the names are eyas.config.STORE_DTYPES, which the config and `eyas capture --dtype` accept)
PARTS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "bf16"), "fp8": ("fp8", "fp8"), "fp8-aux": ("fp8", "bf16")}


def parts(dtype: str) -> tuple[str, str]:
    """(aux dtype, final dtype) of a store dtype."""
    if dtype not in PARTS:
        raise ValueError(f"unknown store dtype {dtype!r}; known: {', '.join(PARTS)}")
    return PARTS[dtype]


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
    return sum(width * (torch.finfo(dt).bits // 8) for width, dt in state_layout(dtype, num_aux, hidden).values()) + 4 + 1


def state_layout(dtype: str, num_aux: int, hidden: int) -> dict[str, tuple[int, torch.dtype]]:
    """The captured per-token tensors of a shard: name -> (width, storage dtype); a scale per token and layer
    beside each part stored in fp8."""
    aux, final = parts(dtype)
    layout = {"aux_hidden": (num_aux * hidden, STORAGE_DTYPES[aux]), "final_hidden": (hidden, STORAGE_DTYPES[final])}
    if aux == "fp8":
        layout["aux_scale"] = (num_aux, torch.float32)
    if final == "fp8":
        layout["final_scale"] = (1, torch.float32)
    return layout
