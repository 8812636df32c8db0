"""Read a store: random access per sample through memory maps, rank splits, and tailing a live capture.

Only committed shards are visible (those a manifest names), so a reader may run while `eyas capture`
is still writing; `tail()` yields each newly committed shard's samples until the manifest says the
capture is complete.

With `check_sha256` (training), every committed shard's sha256 is computed against the manifest's by
background threads (half the CPU cores, at most 4), in commit order, as soon as the reader sees the
shard. A sample is read only from a shard whose hash matched: a read that reaches a shard first hashes
it in the reading thread (or waits for the thread already at it), so the data position never decides
what was checked. Any mismatch, found by either, fails the next read with an error naming the shard.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import queue
import threading
import time
from pathlib import Path

import torch

from eyas.common import EyasError
from eyas.store.codec import decode
from eyas.store.manifest import check_expect, committed_shards, read_manifest


class _Shard:
    """One open shard file (safetensors mmap); small index tensors are read once."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.file = safe_open(str(path), framework="pt")
        self.offsets = self.file.get_tensor("offsets")  # [n+1]
        self.sample_index = self.file.get_tensor("sample_index")  # [n]
        self.sample_ids = json.loads(self.file.metadata()["eyas"])["sample_ids"]
        self.scales = {name for name in ("aux_scale", "final_scale") if name in self.file.keys()}  # fp8 parts

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        return self.file.get_slice(name)[a:b]


class ShardChecksums:
    """The sha256 of each shard, checked once, off the reading path where possible (see the module docstring).

    A big store takes a while (sha256 runs at about 1 GB/s per thread): the first batches, which draw
    samples from many shards, may wait for some; they are read while the draft is set up (and compiled)."""

    CHUNK = 8 << 20  # hashlib releases the GIL on big blocks: reading threads keep running meanwhile

    def __init__(self, store: Path):
        self.store = store
        self._todo: queue.Queue = queue.Queue()
        self._guard = threading.Lock()
        self._locks: dict[int, threading.Lock] = {}
        self._wanted: dict[int, tuple[Path, str | None]] = {}
        self._checked: set[int] = set()
        self.failure: str | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def add(self, pos: int, path: Path, sha256: str | None) -> None:
        """Queue shard `pos` (its file and the manifest's sha256) for the background thread."""
        with self._guard:
            self._wanted[pos], self._locks[pos] = (path, sha256), threading.Lock()
            if not self._threads:
                workers = max(1, min(4, (os.cpu_count() or 2) // 2))
                self._threads = [threading.Thread(target=self._run, name="eyas-store-sha256", daemon=True)
                                 for _ in range(workers)]
                for thread in self._threads:
                    thread.start()
        self._todo.put(pos)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pos = self._todo.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._check(pos)
            except Exception:  # noqa: BLE001 -- an unreadable file fails the read that needs it, with its own error
                continue

    def _check(self, pos: int) -> None:
        with self._locks[pos]:
            if pos in self._checked:
                return
            path, want = self._wanted[pos]
            if want is not None and self.failure is None:
                digest = hashlib.sha256()
                with open(path, "rb") as f:
                    while block := f.read(self.CHUNK):
                        digest.update(block)
                if digest.hexdigest() != want:
                    self.failure = (f"{path}: its sha256 differs from the one the store's manifest records (the file "
                                    f"changed or is corrupt), so training stops before using it; run `eyas verify "
                                    f"{self.store}` to see which samples, then capture the store again")
            self._checked.add(pos)

    def ensure(self, pos: int) -> None:
        """Return once shard `pos` is known good; raise EyasError for a mismatch (in it or any shard)."""
        if pos not in self._checked and pos in self._locks:
            self._check(pos)
        if self.failure is not None:
            raise EyasError(self.failure)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5.0)


class StoreReader:
    """`reader[i]` -> {sample_id, input_ids [T], loss_mask [T], aux_hidden [T, A*H], final_hidden [T, H]}."""

    def __init__(self, path: str | Path, expect: dict | None = None, dtype: torch.dtype = torch.float32, *,
                 check_sha256: bool = False):
        self.path = Path(path)
        self.dtype = dtype
        self.checksums = ShardChecksums(self.path) if check_sha256 else None
        self.manifest = read_manifest(self.path)
        check_expect(self.manifest, expect, self.path)
        self._open: dict[int, _Shard] = {}
        self.shards: list[dict] = []
        self._starts: list[int] = []  # first global sample index of each shard
        self.refresh()

    def refresh(self) -> list[dict]:
        """Pick up shards committed since the last call; returns the new shard records."""
        self.manifest = read_manifest(self.path)
        known = {rec["index"] for rec in self.shards}
        new = [rec for rec in committed_shards(self.path, self.manifest) if rec["index"] not in known]
        for rec in new:  # appended in commit-discovery order, so global indices never move
            self._starts.append(len(self))
            self.shards.append(rec)
            if self.checksums is not None:
                self.checksums.add(len(self.shards) - 1, self.path / rec["file"], rec.get("sha256"))
        return new

    def close(self) -> None:
        """Stop the background checksum thread (if any); reads still check each shard before using it."""
        if self.checksums is not None:
            self.checksums.close()

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def aux_layers(self) -> list[int]:
        return self.manifest["aux_layers"]

    def __len__(self) -> int:
        return (self._starts[-1] + self.shards[-1]["num_samples"]) if self.shards else 0

    def nonfinite(self) -> dict[int, str]:
        """{index: sample id} of the committed samples whose captured states hold NaN or inf (capture's flags)."""
        return {start + j: sid for start, rec in zip(self._starts, self.shards)
                for j, sid in zip(rec.get("nonfinite_samples", ()), rec.get("nonfinite_ids", ()))}

    def _shard(self, pos: int) -> _Shard:
        if pos not in self._open:
            path = self.path / self.shards[pos]["file"]
            if not path.is_file():
                raise EyasError(f"{path} is named in the manifest but missing; run `eyas verify {self.path}`")
            want, size = self.shards[pos].get("bytes"), path.stat().st_size  # cheap; the checksums are verify's
            if want is not None and size != want:
                raise EyasError(f"{path} holds {size:,} bytes, the manifest says {want:,}: the file was cut or "
                                f"replaced; run `eyas verify {self.path}`, and capture again if it fails")
            try:
                self._open[pos] = _Shard(path)
            except Exception as e:  # noqa: BLE001 -- safetensors' own errors do not name the file
                raise EyasError(f"{path}: not a readable shard ({type(e).__name__}: {e}); run "
                                f"`eyas verify {self.path}`") from None
        return self._open[pos]

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")
        pos = bisect.bisect_right(self._starts, i) - 1
        return self.read(pos, i - self._starts[pos])

    def read(self, pos: int, j: int) -> dict:
        """Sample j of the pos-th committed shard (with check_sha256: once its sha256 matched)."""
        shard = self._shard(pos)
        if self.checksums is not None:
            self.checksums.ensure(pos)
        a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
        aux_scale = shard.rows("aux_scale", a, b) if "aux_scale" in shard.scales else None  # [T, A]
        final_scale = shard.rows("final_scale", a, b) if "final_scale" in shard.scales else None  # [T, 1]
        return {
            "sample_id": shard.sample_ids[j],
            "input_ids": shard.rows("input_ids", a, b).long(),  # [T]
            "loss_mask": shard.rows("loss_mask", a, b).long(),  # [T]
            "aux_hidden": decode(shard.rows("aux_hidden", a, b), aux_scale, self.dtype),  # [T, A*H]
            "final_hidden": decode(shard.rows("final_hidden", a, b), final_scale, self.dtype),  # [T, H]
        }

    def indices(self, rank: int, world_size: int) -> list[int]:
        """This rank's share of the samples (strided, so shares differ by at most one sample)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        return list(range(rank, len(self), world_size))

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def tail(self, poll_s: float = 1.0, timeout_s: float | None = 3600.0):
        """Yield the samples of every committed shard, then of each newly committed one, until complete.

        Raises EyasError when nothing new is committed for timeout_s (a capture that died)."""
        pos, last_progress = 0, time.time()
        while True:
            while pos < len(self.shards):
                for j in range(self.shards[pos]["num_samples"]):
                    yield self.read(pos, j)
                pos += 1
                last_progress = time.time()
            if self.complete:  # a complete manifest names every shard, and refresh() read them all
                return
            if timeout_s is not None and time.time() - last_progress > timeout_s:
                raise EyasError(f"no new shard in {self.path} for {timeout_s:.0f} s and the capture is not complete; "
                                f"is `eyas capture` still running? rerun it to resume")
            time.sleep(poll_s)
            self.refresh()
