"""Which sample goes into which shard and which forward pass: deterministic, counted in tokens.

Samples are sorted longest first (ties by row), so padded batches waste little, an out-of-memory
error shows up in the first batches rather than hours in, and the same prepared data always gives the
same shards: a resumed capture writes bit-identical shards to an uninterrupted one.
"""

from __future__ import annotations

import numpy as np

from eyas.common import sha256_json

CPU_MAX_BUDGET = 16384  # larger CPU batches only cost memory
CUDA_MAX_BUDGET = 1 << 20


def plan_shards(lengths: np.ndarray, shard_tokens: int) -> list[np.ndarray]:
    """Rows in stored order, cut into shards of at most shard_tokens tokens (a longer sample gets its own)."""
    rows = np.lexsort((np.arange(len(lengths)), -np.asarray(lengths)))  # [N] longest first
    shards, current, tokens = [], [], 0
    for row in rows:
        n = int(lengths[row])
        if current and tokens + n > shard_tokens:
            shards.append(np.array(current, dtype=np.int64))
            current, tokens = [], 0
        current.append(int(row))
        tokens += n
    if current:
        shards.append(np.array(current, dtype=np.int64))
    return shards


def plan_fingerprint(shards: list[np.ndarray]) -> str:
    return sha256_json([s.tolist() for s in shards])[:16]


def next_batch(rows: np.ndarray, lengths: np.ndarray, budget: int) -> int:
    """How many of `rows`, from the first, the next forward pass takes: the longest run whose padded size
    (count x longest) fits the budget; one row at least."""
    count, longest = 0, 0
    for row in rows:
        longest_next = max(longest, int(lengths[row]))
        if count and (count + 1) * longest_next > budget:
            break
        longest, count = longest_next, count + 1
    return count


def token_batches(rows: np.ndarray, lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """Consecutive runs of rows whose padded size (count x longest) fits the budget; one row at least."""
    batches, start = [], 0
    while start < len(rows):
        count = next_batch(rows[start:], lengths, budget)
        batches.append(rows[start:start + count])
        start += count
    return batches


def activation_bytes_per_token(config, num_aux: int, elem_bytes: int, max_len: int) -> int:
    """A generous estimate of inference memory per token: hidden-sized buffers, the MLP's intermediate
    activations, captured states, and (where attention is not fused) one row of attention scores."""
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden
    inter = max(inter, getattr(config, "moe_intermediate_size", 0) * getattr(config, "num_experts_per_tok", 0))
    heads = config.num_attention_heads
    return elem_bytes * (12 * hidden + 4 * inter) + (num_aux + 1) * hidden * 4 + heads * max_len * 4


def auto_token_budget(target, num_aux: int, max_len: int, ram_budget_gb: float = 0.0) -> int:
    """Tokens per forward pass from free device memory (CUDA) or a RAM budget (CPU)."""
    import torch

    elem = torch.tensor([], dtype=target.dtype).element_size()
    per_token = activation_bytes_per_token(target.config, num_aux, elem, max_len)
    device = target.device
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget, cap = int(0.7 * free) // per_token, CUDA_MAX_BUDGET
    else:
        if ram_budget_gb > 0:
            ram = ram_budget_gb * 2**30
        else:
            import psutil

            ram = psutil.virtual_memory().available / 4  # a shared machine: take a quarter of what is free
        budget, cap = int(ram) // per_token, CPU_MAX_BUDGET
    return int(max(min(budget, cap), max_len, 64))
