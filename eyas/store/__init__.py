"""Hidden-state store: manifest, shard writer (atomic), reader (mmap), capture loop, verify."""

from eyas.store.capture_loop import capture
from eyas.store.reader import StoreReader

__all__ = ["StoreReader", "capture"]
