"""Aux layer ids in the Hugging Face `output_hidden_states` convention (docs/ALGORITHM.md section 1).

Index 0 is the embedding output, index k in 1..n-1 the residual stream after decoder layer k-1,
index n the *normed* last state (the lm_head's input). Aux ids are residual streams: 1..n-1.

Bad ids are a user error (`ConfigError`, a `ValueError`): the CLI prints the one-line message.
"""

from __future__ import annotations

from eyas.config import ConfigError


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's [2, n//2, n-3]; for very shallow models, three ids spread over 1..n-1."""
    n = num_layers
    if n < 2:
        raise ConfigError(f"a target with {n} decoder layer(s) has no residual stream to capture; "
                          f"EAGLE-3 needs a target with at least 2 layers")
    ids = [2, n // 2, n - 3]
    if all(1 <= i <= n - 1 for i in ids) and ids == sorted(set(ids)):
        return ids
    spread = sorted({1, max(1, n // 2), n - 1})
    return spread


def resolve_aux_layers(requested: list[int] | None, num_layers: int) -> list[int]:
    """Validate user ids (in range, distinct, ascending) or return the default."""
    if requested is None:
        return default_aux_layers(num_layers)
    ids = list(requested)
    n = num_layers
    if not ids:
        raise ConfigError(f"target.aux_layers is empty; give ids in 1..{n - 1} or null for the default "
                          f"{default_aux_layers(n)}")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n - 1]
    if bad:
        hint = " (index n is the normed final state, stored separately as final_hidden)" if n in bad else ""
        raise ConfigError(
            f"target.aux_layers={ids}: ids {bad} are out of range for a {n}-layer target: residual-stream ids are "
            f"1..{n - 1} in the Hugging Face output_hidden_states convention{hint}; "
            f"the default is {default_aux_layers(n)}"
        )
    if ids != sorted(set(ids)):
        raise ConfigError(f"target.aux_layers={ids}: ids must be distinct and ascending, e.g. {sorted(set(ids))}")
    return ids


def to_sglang_ids(hf_ids: list[int]) -> list[int]:
    """SGLang counts 0-based layer outputs: HF index minus one."""
    return [i - 1 for i in hf_ids]
