"""Which GPUs `eyas run` schedules on and `eyas gpus` lists: a --gpus list, or CUDA_VISIBLE_DEVICES as CUDA
reads it, as NVML device indices."""

from __future__ import annotations

import os

from eyas.common import EyasError
from eyas.gpu import nvml


def parse_gpus(text: str, option: str = "--gpus") -> list[int]:
    """'0,1,3' -> [0, 1, 3]; anything else is an EyasError that says what the option takes."""
    items = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in items if not (v.isascii() and v.isdigit())]
    if bad or len(set(items)) != len(items):
        what = f"{', '.join(repr(v) for v in bad)} is not a device index" if bad else "a device is named twice"
        raise EyasError(f"{option} {text!r}: {what}; give device indices separated by commas, e.g. 0,1 "
                        f"(`eyas gpus` lists them)")
    return [int(v) for v in items]


def default_pool() -> list[int]:
    """The GPUs CUDA_VISIBLE_DEVICES names (indices or GPU-UUIDs, as CUDA reads it: up to the first entry
    that names no device), as NVML indices; without it every GPU NVML sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [g.index for g in nvml.gpus()]
    known = nvml.gpus()
    pool = []
    for entry in (v.strip() for v in visible.split(",")):
        if entry.isascii() and entry.isdigit():
            pool.append(int(entry))
            continue
        if entry.startswith("MIG-"):
            raise EyasError(f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}); eyas run schedules whole GPUs: "
                            f"give their indices with --gpus")
        # CUDA takes any unique prefix of a GPU's UUID
        match = [g.index for g in known if g.uuid and entry.startswith("GPU-") and g.uuid.startswith(entry)]
        if len(match) != 1:
            break  # CUDA ignores this entry and every one after it
        pool.append(match[0])
    return pool
