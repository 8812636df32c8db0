"""Write shards on a background thread: pack, write to a temporary name, fsync, rename, commit.

The capture loop hands over a shard's pieces (host tensors, each with a CUDA event to wait for when
the device-to-host copy is still in flight) and goes on computing. This thread waits for the copies,
packs the pieces into one safetensors file, makes it durable, renames it into place and only then
names it in the manifest (replaced atomically). A write error (full disk, no permission) is kept and
raised in the capture loop at its next call, as an EyasError that says how much space was needed;
everything committed before stays valid.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from eyas.common import EyasError, atomic_write_json, format_bytes, fsync_dir, sha256_file
from eyas.store.manifest import rank_manifest_file, shard_file, write_manifest


@dataclass
class Piece:
    """The captured states of consecutive samples of one shard, packed (no padding)."""

    aux: torch.Tensor  # [t, A*H] storage dtype
    final: torch.Tensor  # [t, H] storage dtype
    aux_scale: torch.Tensor | None  # [t, A] fp32 (fp8 only)
    final_scale: torch.Tensor | None  # [t, 1] fp32 (fp8 only)
    ready: object = None  # a torch.cuda.Event recorded after the copy to host, or None


@dataclass
class ShardJob:
    index: int
    rows: np.ndarray  # [n] rows of the prepared dataset, in stored order
    sample_ids: list[str]
    input_ids: list[np.ndarray]  # n arrays [T_i]
    loss_mask: list[np.ndarray]
    pieces: list[Piece] = field(default_factory=list)
    tokens_left: int = 0  # tokens of this and the later shards of this rank (to say how much space is needed)


def write_shard_file(path: Path, tensors: dict, metadata: dict) -> None:
    """Write a safetensors file and fsync it (the one place that touches the disk; tests inject errors here)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pack(job: ShardJob, dtype: str, aux_layers: list[int]) -> tuple[dict, dict]:
    for piece in job.pieces:
        if piece.ready is not None:
            piece.ready.synchronize()
    lengths = np.array([len(x) for x in job.input_ids], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # [n+1]
    tensors = {
        "input_ids": torch.from_numpy(np.concatenate(job.input_ids).astype(np.int32)),  # [T]
        "loss_mask": torch.from_numpy(np.concatenate(job.loss_mask).astype(np.uint8)),  # [T]
        "aux_hidden": torch.cat([p.aux for p in job.pieces]),  # [T, A*H]
        "final_hidden": torch.cat([p.final for p in job.pieces]),  # [T, H]
        "offsets": torch.from_numpy(offsets),  # [n+1]
        "sample_index": torch.from_numpy(np.asarray(job.rows, dtype=np.int64)),  # [n]
    }
    if dtype == "fp8":
        tensors["aux_scale"] = torch.cat([p.aux_scale for p in job.pieces])  # [T, A]
        tensors["final_scale"] = torch.cat([p.final_scale for p in job.pieces])  # [T, 1]
    num_tokens = int(offsets[-1])
    assert tensors["aux_hidden"].shape[0] == num_tokens, "captured tokens do not match the shard's samples"
    # one metadata key: safetensors writes a multi-key metadata map in a per-process random order,
    # and shards must be byte-identical across runs (resume) and processes (ranks)
    metadata = {"eyas": json.dumps({"schema_version": 1, "dtype": dtype, "aux_layers": aux_layers,
                                    "sample_ids": job.sample_ids}, sort_keys=True)}
    return tensors, metadata


class ShardWriter:
    """Commits shards in the background. `submit` blocks when `depth` shards are already waiting."""

    def __init__(self, store: Path, manifest: dict, *, rank: int = 0, world_size: int = 1,
                 bytes_per_token: int = 0, depth: int = 2):
        self.store = Path(store)
        self.manifest = manifest
        self.rank, self.world_size = rank, world_size
        self.bytes_per_token = bytes_per_token
        self.mine: list[dict] = []  # records committed by this process
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="eyas-shard-writer", daemon=True)
        self._thread.start()

    def submit(self, job: ShardJob) -> None:
        self._raise_if_failed()
        self._queue.put(job)
        self._raise_if_failed()

    def close(self) -> list[dict]:
        """Wait for every submitted shard to be committed; raise the first write error."""
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        return self.mine

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self.error is not None:
                continue  # drain; nothing after a failed shard is committed
            try:
                self._commit(job)
            except OSError as e:
                self.error = self._explain(e, job)
            except BaseException as e:  # noqa: BLE001 -- re-raised in the capture loop
                self.error = e

    def _commit(self, job: ShardJob) -> None:
        tensors, metadata = pack(job, self.manifest["dtype"], self.manifest["aux_layers"])
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + (1 << 20)
        free = shutil.disk_usage(self.store).free
        if free < need:
            raise OSError(errno.ENOSPC, f"only {format_bytes(free)} free")
        final = self.store / shard_file(job.index)
        tmp = self.store / f".{final.name}.tmp"
        try:
            write_shard_file(tmp, tensors, metadata)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.store)
        record = {"index": job.index, "file": final.name, "sha256": sha256_file(final),
                  "num_samples": len(job.rows), "num_tokens": int(tensors["offsets"][-1]),
                  "bytes": final.stat().st_size}
        self.mine.append(record)
        if self.world_size == 1:
            self.manifest["shards"].append(record)
            write_manifest(self.store, self.manifest)
        else:
            atomic_write_json(self.store / rank_manifest_file(self.rank), {"rank": self.rank, "shards": self.mine})

    def _explain(self, e: OSError, job: ShardJob) -> EyasError:
        done = len(self.mine)
        kept = f"the {done} shard(s) committed by this run and all earlier ones stay valid; rerun the same command to resume"
        tokens = sum(len(x) for x in job.input_ids)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            shard_need = tokens * self.bytes_per_token
            rest = max(job.tokens_left, tokens) * self.bytes_per_token
            try:
                free = format_bytes(shutil.disk_usage(self.store).free)
            except OSError:
                free = "unknown"
            return EyasError(f"no space left on the device of {self.store} while writing shard {job.index}: it needs "
                             f"about {format_bytes(shard_need)}, the rest of the capture about {format_bytes(rest)}, "
                             f"free: {free}; free space or choose another --out; {kept}")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return EyasError(f"cannot write shard {job.index} into {self.store} ({e.strerror or e}); make the directory "
                             f"writable or choose another --out; {kept}")
        return EyasError(f"writing shard {job.index} into {self.store} failed ({e}); {kept}")
