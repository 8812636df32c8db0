"""Small shared helpers: printing on rank 0, seeding, device and dtype choice, atomic writes, hashes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from eyas.config import RunConfig

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class EyasError(RuntimeError):
    """An error meant for the user: printed as one line by the CLI, no traceback."""


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only, flushed (logs from subprocesses must not sit in a buffer)."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def warn(msg: str) -> None:
    if rank() == 0:
        print(f"warning: {msg}", file=sys.stderr, flush=True)


def seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def nonfinite_tensors(tensors: dict) -> dict[str, int]:
    """{name: how many NaN or infinite values} of the floating-point tensors that hold any, in their order."""
    import torch

    counts = {}
    for name, value in tensors.items():
        if value.is_floating_point():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                counts[name] = bad
    return counts


def choose_device(name: str = "auto"):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EyasError(f"device {name!r} was asked for but CUDA is not available; use --set target.device=cpu")
    return dev


def choose_dtype(name: str, device) -> "torch.dtype":  # noqa: F821
    """'auto' is bf16 on CUDA and fp32 on CPU."""
    import torch

    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, DTYPES[name])


# ---------------------------------------------------------------- files

def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, rename over `path`, fsync the dir."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | Path) -> Any:
    with open(path) as f:
        return json.load(f)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl) held for the block; released if the process dies."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def cache_dir() -> Path:
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML next to an artifact (atomically)."""
    import yaml

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def capture_cuda_graph(fn, device, what: str, way_out: str, pool=None):
    """`fn` (which writes its results into buffers allocated before) warmed up on a side stream, then
    captured as a CUDA graph (in `pool` if given, a memory pool that graphs never replayed at once may
    share). A pass that waits for the host cannot be captured: the error names `what` and `way_out`."""
    import torch

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):  # lazy initialisation (cuBLAS workspaces, kernels) must happen outside capture
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
    except RuntimeError as e:  # torch.AcceleratorError is one; the CUDA context may be unusable after it
        raise EyasError(
            f"capturing {what} as a CUDA graph failed ({str(e).splitlines()[0]}); this is a bug in eyas (an "
            f"operation in the pass waits for the host). {way_out} and report the error") from e
    return graph


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def progress(iterable=None, **kwargs):
    """A tqdm bar on rank 0 (rates and ETA), silent elsewhere."""
    from tqdm.auto import tqdm

    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("mininterval", 1.0)
    return tqdm(iterable, disable=rank() != 0 or kwargs.pop("disable", False), **kwargs)


REPEAT_NGRAM = 8  # the context length that makes a token "in a repeat" (eval's tau split, training's held-out split)


def repeated_contexts(seq: list[int], answer: list[bool], n: int = REPEAT_NGRAM) -> list[bool]:
    """Per position t of a token sequence: whether its n preceding tokens, all answer tokens, form an n-gram of
    answer tokens that already ended before t. A draft predicts such a stretch (a loop of the target's, a quoted
    line) almost perfectly, so tau there says little about tau elsewhere."""
    out, seen, run = [False] * len(seq), set(), 0  # run: answer tokens in a row ending at t - 1
    for t, is_answer in enumerate(answer):
        if run >= n:  # seq[t - n:t] is all answer: checked against the earlier ones, then kept
            gram = tuple(seq[t - n:t])
            out[t] = gram in seen
            seen.add(gram)
        run = run + 1 if is_answer else 0
    return out
