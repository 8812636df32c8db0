"""Write shards on background threads: stream to a temporary name (hashing as it goes), fsync, rename, commit.

The capture loop takes a shard buffer from a bounded pool, fills it with the shard's forward passes
(device-to-host copies still in flight, each with a CUDA event), hands it over and goes on computing.
A writer thread waits for that buffer's copies, streams the shard file from it in one pass that also
computes the sha256 (eyas/store/shardfile.py), fsyncs, renames it into place and only then names it
in the manifest (replaced atomically, under a lock); then the buffer goes back to the pool. Shards are
independent, so several threads write at once; the pool bounds host memory and, when every buffer is
waiting to be written, makes the capture loop wait (`wait_s` says for how long: writes are the bound).

A write error (full disk, no permission) is kept and raised in the capture loop at its next call, as
an EyasError that says how much space was needed; every shard committed before stays valid, and no
queued shard is written after it.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eyas.common import EyasError, atomic_write_json, format_bytes, fsync_dir
from eyas.store.manifest import rank_manifest_file, shard_file, write_manifest
from eyas.store.shardfile import write_shard_file
from eyas.store.staging import ShardBuffer

STAGING_MAX_BYTES = 16 << 30  # host memory for shard buffers per host, at most (and at most an eighth of the RAM)


@dataclass
class ShardJob:
    index: int
    rows: np.ndarray  # [n] rows of the prepared dataset, in stored order
    sample_ids: list[str]
    input_ids: list[np.ndarray]  # n arrays [T_i]
    loss_mask: list[np.ndarray]
    buffer: ShardBuffer | None  # the shard's captured states (copies may still be in flight); None once released
    tokens_left: int = 0  # tokens of this and the later shards of this rank (to say how much space is needed)


def _local_ranks() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # torchrun: the ranks sharing this host


def default_writer_threads() -> int:
    return max(1, min(4, (os.cpu_count() or 1) // _local_ranks()))


def default_staging_bytes() -> int:
    try:
        import psutil

        limit = min(STAGING_MAX_BYTES, psutil.virtual_memory().total // 8)
    except ImportError:
        limit = STAGING_MAX_BYTES
    return limit // _local_ranks()


def shard_tensors(job: ShardJob, dtype: str, aux_layers: list[int]) -> tuple[dict, dict]:
    """The shard file's tensors (the states as views of the buffer, no copy) and its metadata."""
    lengths = np.array([len(x) for x in job.input_ids], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # [n+1]
    num_tokens = int(offsets[-1])
    assert job.buffer.rows == num_tokens, "captured tokens do not match the shard's samples"
    tensors = {
        "input_ids": torch.from_numpy(np.concatenate(job.input_ids).astype(np.int32)),  # [T]
        "loss_mask": torch.from_numpy(np.concatenate(job.loss_mask).astype(np.uint8)),  # [T]
        "offsets": torch.from_numpy(offsets),  # [n+1]
        "sample_index": torch.from_numpy(np.asarray(job.rows, dtype=np.int64)),  # [n]
    }
    tensors.update({name: job.buffer.view(name) for name in job.buffer.regions})  # [T, A*H], [T, H] (+ scales)
    # one metadata key: safetensors writes a multi-key metadata map in a per-process random order,
    # and shards must be byte-identical across runs (resume) and processes (ranks)
    metadata = {"eyas": json.dumps({"schema_version": 1, "dtype": dtype, "aux_layers": aux_layers,
                                    "sample_ids": job.sample_ids}, sort_keys=True)}
    return tensors, metadata


class ShardWriter:
    """Commits shards on `num_threads` threads; `buffer()` hands out shard buffers from a bounded pool
    (allocated up front: at most `staging_bytes`, default min(16 GiB, RAM/8), and at least two buffers)."""

    def __init__(self, store: Path, manifest: dict, layout: dict, capacity: int, *, pinned: bool = False,
                 rank: int = 0, world_size: int = 1, bytes_per_token: int = 0, num_threads: int = 0,
                 staging_bytes: int = 0):
        self.store = Path(store)
        self.manifest = manifest
        self.capacity = max(1, capacity)
        self.rank, self.world_size = rank, world_size
        self.bytes_per_token = bytes_per_token
        buffer_bytes = self.capacity * sum(w * torch.empty(0, dtype=dt).element_size() for w, dt in layout.values())
        num_threads = num_threads or default_writer_threads()
        # one buffer filling, one waiting, one per thread writing; fewer when shards are big
        self.max_buffers = int(max(2, min(num_threads + 2, (staging_bytes or default_staging_bytes()) // buffer_bytes)))
        self.num_threads = max(1, min(num_threads, self.max_buffers - 1))
        self.mine: list[dict] = []  # records committed by this process
        self.num_bytes = 0  # bytes of the shards this process committed
        self.busy_s = 0.0  # summed over threads: time spent writing and committing shards
        self.wait_s = 0.0  # time the capture loop waited for a free buffer (writes were behind)
        self.error: BaseException | None = None  # the first failure, until raised in the capture loop
        self._failed = False  # stays set: nothing queued after a failure is written
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._free: queue.Queue = queue.Queue()
        t0 = time.perf_counter()  # the whole pool up front: a bounded, predictable amount, pinned once
        for _ in range(self.max_buffers):
            self._free.put(ShardBuffer(layout, self.capacity, pinned))
        self.alloc_s = time.perf_counter() - t0
        self._threads = [threading.Thread(target=self._run, name=f"eyas-shard-writer-{i}", daemon=True)
                         for i in range(self.num_threads)]
        for thread in self._threads:
            thread.start()

    def buffer(self) -> ShardBuffer:
        """An empty shard buffer from the pool; waits while every buffer is still being written."""
        self._raise_if_failed()
        t0 = time.perf_counter()
        while True:
            try:
                buf = self._free.get(timeout=0.05)
                break
            except queue.Empty:
                self._raise_if_failed()
        self.wait_s += time.perf_counter() - t0
        buf.reset()
        return buf

    def submit(self, job: ShardJob) -> None:
        self._raise_if_failed()
        self._jobs.put(job)

    def close(self) -> list[dict]:
        """Wait for every submitted shard to be committed; raise the first write error."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._raise_if_failed()
        return self.mine

    def _raise_if_failed(self) -> None:
        with self._lock:
            err, self.error = self.error, None
        if err is not None:
            raise err

    def _fail(self, err: BaseException) -> None:
        with self._lock:
            self._failed = True
            if self.error is None:
                self.error = err

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if not self._failed:
                    t0 = time.perf_counter()
                    self._commit(job)
                    with self._lock:
                        self.busy_s += time.perf_counter() - t0
            except OSError as e:
                self._fail(self._explain(e, job))
            except BaseException as e:  # noqa: BLE001 -- re-raised in the capture loop
                self._fail(e)
            finally:
                self._release(job)

    def _release(self, job: ShardJob) -> None:
        """Hand the job's buffer back to the pool (once), after any copy into it has landed."""
        if job.buffer is None:
            return
        try:
            job.buffer.wait()
        except BaseException as e:  # noqa: BLE001 -- a device error; the buffer is still safe to reuse after it
            self._fail(e)
        buf, job.buffer = job.buffer, None
        self._free.put(buf)

    def _commit(self, job: ShardJob) -> None:
        job.buffer.wait()
        nonfinite = job.buffer.nonfinite_per_sample()  # [n] tokens per sample with a NaN or inf in its states
        tensors, metadata = shard_tensors(job, self.manifest["dtype"], self.manifest["aux_layers"])
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + (1 << 20)
        free = shutil.disk_usage(self.store).free
        if free < need:
            raise OSError(errno.ENOSPC, f"only {format_bytes(free)} free")
        final = self.store / shard_file(job.index)
        tmp = self.store / f".{final.name}.tmp"
        num_tokens = job.buffer.rows
        try:
            sha256 = write_shard_file(tmp, tensors, metadata)
            del tensors
            self._release(job)  # the bytes are on disk: the next shard may fill this buffer during the commit
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.store)
        record = {"index": job.index, "file": final.name, "sha256": sha256, "num_samples": len(job.rows),
                  "num_tokens": num_tokens, "bytes": final.stat().st_size, "nonfinite_tokens": sum(nonfinite)}
        flagged = [j for j, n in enumerate(nonfinite) if n]
        if flagged:  # training skips these samples (eyas/train/source.py)
            record["nonfinite_samples"] = flagged
            record["nonfinite_ids"] = [job.sample_ids[j] for j in flagged]
        with self._lock:  # one manifest, several threads: commits are serialised, in any index order
            self.mine.append(record)
            self.num_bytes += record["bytes"]
            if self.world_size == 1:
                self.manifest["shards"].append(record)
                write_manifest(self.store, self.manifest)
            else:
                atomic_write_json(self.store / rank_manifest_file(self.rank),
                                  {"rank": self.rank, "shards": sorted(self.mine, key=lambda r: r["index"])})

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
