"""The hidden-state store as a format: manifest, shard files, the atomic writer, the mmap reader, checks.

It never runs a target: the capture stage (eyas/stages/capture.py) fills a store, `eyas verify`
(eyas/stages/verify.py) recomputes samples against one.
"""

from eyas.store.reader import StoreReader

__all__ = ["StoreReader"]
