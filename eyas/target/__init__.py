"""Targets: loading (HF dir, hub id, GGUF, the embedded SmolLM2, tiny models), aux layers, capture hooks."""

from eyas.target.layers import default_aux_layers, resolve_aux_layers, to_sglang_ids
from eyas.target.load import Target, load_target

__all__ = ["Target", "load_target", "default_aux_layers", "resolve_aux_layers", "to_sglang_ids"]
