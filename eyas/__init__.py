"""eyas: train EAGLE-3 speculative-decoding drafts for any target LLM."""

__version__ = "0.1.0"
