"""Shard files: safetensors written in one streaming pass that hashes the bytes as it writes them.

The bytes are exactly those of `safetensors.torch.save_file` (tests/store/test_shardfile.py holds it to
that), but nothing is copied first: a tensor given as a list of parts (consecutive row blocks) is
written part by part, straight from the (pinned) host buffers the capture copied into, and the sha256
of the file comes out of the same pass, so committing a shard never reads it back.

Format (safetensors): 8-byte little-endian header length, a JSON header (`__metadata__` first, then
each tensor's dtype, shape and byte range, in safetensors' own order), padded with spaces to a
multiple of 8 bytes, then the tensors' raw bytes in that order.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

CHUNK_BYTES = 64 << 20  # hash and write in slices this big: large enough for full-speed syscalls, small enough for caches
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
             torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_ORDER: dict[tuple, list[str]] = {}


def file_order(dtypes: dict[str, torch.dtype]) -> list[str]:
    """The order safetensors lays tensors out in (by dtype, then name), asked of safetensors itself
    with one-element stand-ins, so that a change of that rule in a new version cannot break identity."""
    key = tuple(sorted((name, str(dt)) for name, dt in dtypes.items()))
    if key not in _ORDER:
        from safetensors.torch import save

        raw = save({name: torch.zeros(1, dtype=dt) for name, dt in dtypes.items()})
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])  # keeps the file's key order
        _ORDER[key] = [name for name in header if name != "__metadata__"]
    return _ORDER[key]


def _parts(value) -> list[torch.Tensor]:
    parts = list(value) if isinstance(value, (list, tuple)) else [value]
    assert parts and all(p.dtype == parts[0].dtype and p.shape[1:] == parts[0].shape[1:] for p in parts), \
        "the parts of one tensor must share dtype and trailing shape"
    return [p.detach().cpu().contiguous() for p in parts]


def _shape(parts: list[torch.Tensor]) -> list[int]:
    if parts[0].dim() == 0:
        assert len(parts) == 1
        return []
    return [sum(int(p.shape[0]) for p in parts), *map(int, parts[0].shape[1:])]


def header_bytes(layout: list[tuple[str, str, list[int], int]], metadata: dict | None) -> bytes:
    """layout: (name, safetensors dtype, shape, nbytes) in file order -> length prefix + padded JSON header."""
    doc: dict = {"__metadata__": metadata} if metadata else {}
    start = 0
    for name, dtype, shape, nbytes in layout:
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + nbytes]}
        start += nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_all(fd: int, digest, view: memoryview) -> None:
    for start in range(0, len(view), CHUNK_BYTES):
        chunk = view[start:start + CHUNK_BYTES]
        digest.update(chunk)  # releases the GIL: several writer threads hash at once
        while chunk:
            chunk = chunk[os.write(fd, chunk):]


def write_shard_file(path: str | Path, tensors: dict, metadata: dict | None) -> str:
    """Write a safetensors file in one pass and fsync it; returns the file's sha256 (hex).

    `tensors` maps a name to a CPU tensor or to a list of parts concatenated along dim 0. This is the
    one function that writes shard bytes to disk (tests inject disk errors here)."""
    parts = {name: _parts(value) for name, value in tensors.items()}
    layout = []
    for name in file_order({name: p[0].dtype for name, p in parts.items()}):
        nbytes = sum(p.numel() * p.element_size() for p in parts[name])
        layout.append((name, ST_DTYPES[parts[name][0].dtype], _shape(parts[name]), nbytes))
    digest = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _write_all(fd, digest, memoryview(header_bytes(layout, metadata)))
        for name, *_ in layout:
            for part in parts[name]:
                if part.numel():
                    _write_all(fd, digest, memoryview(part.reshape(-1).view(torch.uint8).numpy()))
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest()
