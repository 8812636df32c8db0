"""Data: conversations -> token ids + assistant loss masks; the prompt corpus; regeneration; draft vocabulary."""

from eyas.data.prepare import load_prepared, prepare
from eyas.data.vocab import load_vocab

__all__ = ["prepare", "load_prepared", "load_vocab"]
