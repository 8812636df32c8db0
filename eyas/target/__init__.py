"""Targets: loading (HF dir, hub id, GGUF, the embedded SmolLM2, tiny models) and the capture hooks.

Layer ids (which residual streams EAGLE-3 reads, in each engine's numbering) are in eyas.layers."""

from eyas.target.load import Target, load_target

__all__ = ["Target", "load_target"]
