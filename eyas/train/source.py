"""Where training batches come from: a hidden-state store, or any sample set plus a feature function.

`TrainSource` is everything the trainer needs besides the config: the batcher (samples -> batches),
the target's frozen embedding and lm_head, the target's HF config (for the draft's shape), its
identity, the aux layer ids (HF convention) and the draft vocabulary. Building one for the online
source (which runs the target) happens in eyas/stages/train.py, because eyas.train never imports
eyas.target.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from eyas.common import EyasError, warn
from eyas.train.data import Batcher, TailBatcher


def held_out_split(n: int, val_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices) of n samples: `val_samples` drawn with `seed`. Anything that trains on
    the same store beside eyas (bench/peer_specforge.py) leaves out the same samples through this function."""
    if val_samples > n // 2:
        raise EyasError(f"train.val_samples={val_samples} would hold out more than half of the {n} training "
                        f"samples; lower it (about 2 % of the data is usual) or set it to 0")
    held = sorted(random.Random(f"held-out {seed}").sample(range(n), val_samples))
    chosen = set(held)
    return [i for i in range(n) if i not in chosen], held


@dataclass
class TrainSource:
    samples: object  # map-style: len() and [i] -> sample dict
    lengths: list[int]
    embed_weight: torch.Tensor  # [V, H]
    lm_head_weight: torch.Tensor  # [V, H]
    target_config: dict  # the target's HF config as a dict
    target: dict | None  # identity: name, config_hash, tokenizer_hash
    aux_layers: list[int]  # HF convention
    d2t: torch.Tensor | None = None  # [Vd] offsets; None = full vocabulary
    t2d: torch.Tensor | None = None  # [V]
    feature_fn: Callable | None = None
    store: str | None = None
    target_model: str | None = None
    num_layers: int | None = None  # the target's decoder layers (exporters need it); None = from target_config
    tail: "GrowingStore | None" = None  # set when training consumes a store while it is being captured
    reader: object | None = None  # the StoreReader of a store source (it checks each shard's sha256)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_layers is None and self.target_config.get("num_hidden_layers"):
            self.num_layers = int(self.target_config["num_hidden_layers"])

    def close(self) -> None:
        """Stop background work (the store's checksum thread); samples can still be read."""
        if self.reader is not None:
            self.reader.close()

    def batcher(self, batch_tokens: int, seed: int, rank: int = 0, world_size: int = 1,
                sort: bool = True) -> Batcher | TailBatcher:
        if self.tail is not None:
            return TailBatcher(self.tail, batch_tokens, seed, rank, world_size, self.feature_fn, sort)
        return Batcher(self.lengths, self.samples.__getitem__, batch_tokens, seed, rank, world_size, self.feature_fn,
                       sort)

    def held_out_split(self, val_samples: int, seed: int) -> tuple[list[int], list[int]]:
        """(training indices, held-out indices): `val_samples` drawn with `seed`, the same on every rank."""
        return held_out_split(len(self.lengths), val_samples, seed)

    def batchers(self, batch_tokens: int, seed: int, rank: int = 0, world_size: int = 1,
                 val_samples: int = 0, sort: bool = True) -> tuple[Batcher | TailBatcher, Batcher | None]:
        """(training batcher, held-out batcher or None). Held-out samples never reach a training batch; `sort`
        applies to the training batches (the held-out ones are length-sorted: their order changes nothing)."""
        if not val_samples:
            return self.batcher(batch_tokens, seed, rank, world_size, sort), None
        if self.tail is not None:
            warn(f"train.val_samples={val_samples} is not used while training tails a store being captured "
                 f"(the store's size is not known yet): no held-out accuracy in this run")
            return self.batcher(batch_tokens, seed, rank, world_size, sort), None
        train_idx, held = self.held_out_split(val_samples, seed)
        fetch = self.samples.__getitem__

        def subset(indices: list[int], sort: bool = True) -> Batcher:
            return Batcher([self.lengths[i] for i in indices], lambda j: fetch(indices[j]), batch_tokens, seed,
                           rank, world_size, self.feature_fn, sort)

        val = subset(held)
        try:
            val.plan(0)
        except ValueError as e:
            raise EyasError(f"train.val_samples={val_samples}: {e}") from None
        return subset(train_idx, sort), val


class GrowingStore:
    """The samples of a store still being captured, numbered in shard-index order (stable as it grows).

    `wait_shard(i)` blocks until shard i is committed (polling the manifest through the reader) and
    returns the global indices of its samples; shards are taken strictly in index order, so numbering
    and the training plan do not depend on the order in which capture ranks commit them. Samples whose
    states hold NaN or inf (the shard's record says which) get no index: training never sees them.
    """

    def __init__(self, reader, poll_s: float = 2.0, timeout_s: float | None = 3600.0):
        self.reader = reader
        plan = reader.manifest.get("plan") or {}
        self.num_shards = int(plan.get("num_shards", len(reader.shards)))
        self.planned_tokens = int(plan.get("num_tokens", reader.manifest.get("num_tokens", 0)))
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.taken = 0  # shards taken so far
        self.where: list[tuple[int, int]] = []  # global sample -> (position in reader.shards, sample in shard)
        self.lengths: list[int] = []  # tokens per global sample
        self.skipped: list[str] = []  # ids of the samples left out: their states hold NaN or inf

    def __len__(self) -> int:
        return len(self.lengths)

    def _position(self, index: int) -> int | None:
        return next((pos for pos, rec in enumerate(self.reader.shards) if rec["index"] == index), None)

    def wait_shard(self, index: int) -> range:
        from eyas.common import print0

        assert index == self.taken, f"shards are taken in order; expected {self.taken}, got {index}"
        last_progress, told = time.time(), False
        while (pos := self._position(index)) is None:
            if self.reader.complete:
                raise EyasError(f"{self.reader.path} is complete but has no shard {index} of {self.num_shards}; "
                                f"run `eyas verify {self.reader.path}`")
            if self.timeout_s is not None and time.time() - last_progress > self.timeout_s:
                raise EyasError(f"no shard {index} in {self.reader.path} after {self.timeout_s:.0f} s and the capture "
                                f"is not complete; is `eyas capture` still running? rerun it to resume")
            if not told:
                print0(f"waiting for shard {index + 1}/{self.num_shards} of {self.reader.path} ...")
                told = True
            time.sleep(self.poll_s)
            if self.reader.refresh():
                last_progress = time.time()
        record, offsets = self.reader.shards[pos], self.reader._shard(pos).offsets  # [n+1]
        skip = set(record.get("nonfinite_samples", ()))
        if skip:
            warn(f"skipping {len(skip)} sample(s) of shard {index} of {self.reader.path} whose captured states hold "
                 f"NaN or inf ({', '.join(record.get('nonfinite_ids', [])[:5])})")
            self.skipped += record.get("nonfinite_ids", [])
        first = len(self.lengths)
        for j, n in enumerate((offsets[1:] - offsets[:-1]).tolist()):
            if j not in skip:
                self.where.append((pos, j))
                self.lengths.append(n)
        self.taken += 1
        if self.taken == self.num_shards and not self.lengths:
            raise EyasError(f"the captured states of every sample of {self.reader.path} hold NaN or inf: the target "
                            f"overflowed (with target.dtype=fp16, capture with bf16 or fp32); nothing to train on")
        return range(first, len(self.lengths))

    def __getitem__(self, g: int) -> dict:
        if not 0 <= g < len(self.lengths):
            raise IndexError(f"sample {g} is not in a shard taken so far ({len(self.lengths)} samples)")
        return self.reader.read(*self.where[g])


class KeptSamples:
    """A store's samples without those whose captured states hold NaN or inf, numbered 0..n-1."""

    def __init__(self, reader, keep: list[int]):
        self.reader, self.keep = reader, keep

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, i: int) -> dict:
        return self.reader[self.keep[i]]


def load_vocab_file(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    if "d2t" not in tensors or "t2d" not in tensors:
        raise EyasError(f"{path} holds no d2t/t2d tensors; point --vocab at a prepared vocab.safetensors")
    return tensors["d2t"].long(), tensors["t2d"].bool()


def find_vocab(manifest: dict) -> Path | None:
    """The draft vocabulary of the prepared data the store was captured from (its manifest names it), if
    that directory still holds one."""
    prepared = manifest.get("prepared") or {}
    path = Path(prepared["path"]) / "vocab.safetensors" if prepared.get("path") else None
    return path if path is not None and path.is_file() else None


def store_lengths(reader) -> list[int]:
    """Tokens per sample from the shards' offsets (no feature is read)."""
    if getattr(reader, "lengths", None) is not None:
        return [int(n) for n in reader.lengths]
    lengths: list[int] = []
    for pos in range(len(reader.shards)):
        offsets = reader._shard(pos).offsets  # [n+1]
        lengths += (offsets[1:] - offsets[:-1]).tolist()
    return lengths


def store_source(store: str | Path, expect: dict | None = None, vocab: str | Path | None = None, *,
                 tail: bool = False, poll_s: float = 2.0, timeout_s: float | None = 3600.0) -> TrainSource:
    """A TrainSource over a store; `expect` (manifest keys) makes a mismatching store an error.

    With `tail`, the store may still be being captured: training takes its shards as they are committed.
    Every shard's sha256 is checked against the manifest's before a sample of it is used (eyas/store/reader.py).
    """
    from safetensors.torch import load_file

    from eyas.store import StoreReader

    store = Path(store)
    reader = StoreReader(store, expect=expect, check_sha256=True)
    manifest = reader.manifest
    head_path = store / "target_head.safetensors"
    if not head_path.is_file():
        raise EyasError(f"{head_path} is missing; the store was not written by `eyas capture` (it needs the target's head)")
    head = load_file(str(head_path))
    embed, lm_head = head["embed_tokens.weight"], head["lm_head.weight"]
    if embed.shape != (manifest["vocab_size"], manifest["hidden_size"]) or lm_head.shape != embed.shape:
        raise EyasError(f"{head_path}: embed {tuple(embed.shape)} / lm_head {tuple(lm_head.shape)} do not match the "
                        f"manifest's vocab_size={manifest['vocab_size']}, hidden_size={manifest['hidden_size']}")
    vocab_path = Path(vocab) if vocab else find_vocab(manifest)
    d2t = t2d = None
    if vocab_path is not None:
        d2t, t2d = load_vocab_file(vocab_path)
        if len(t2d) != manifest["vocab_size"]:
            raise EyasError(f"{vocab_path}: t2d covers {len(t2d)} target ids but the store's target has "
                            f"vocab_size={manifest['vocab_size']}; use the vocabulary prepared for this target")
    else:
        warn(f"no draft vocabulary found for {store}: the prepared data its manifest names has none (pass --vocab "
             f"PREPARED/vocab.safetensors); "
             f"using the full target vocabulary ({manifest['vocab_size']})")
    growing = GrowingStore(reader, poll_s, timeout_s) if tail else None
    lengths = [] if tail else store_lengths(reader)
    samples = reader
    bad = {} if tail else reader.nonfinite()
    if bad:
        if len(bad) == len(reader):
            raise EyasError(f"the captured states of every sample of {store} hold NaN or inf: the target overflowed "
                            f"(with target.dtype=fp16, capture with bf16 or fp32); nothing to train on")
        keep = [i for i in range(len(reader)) if i not in bad]
        warn(f"skipping {len(bad)} of {len(reader)} samples of {store} whose captured states hold NaN or inf "
             f"({', '.join(list(bad.values())[:5])}{', ...' if len(bad) > 5 else ''})")
        samples, lengths = KeptSamples(reader, keep), [lengths[i] for i in keep]
    return TrainSource(
        samples=samples, lengths=lengths, embed_weight=embed, lm_head_weight=lm_head,
        target_config=manifest.get("target_config") or {}, target=manifest.get("target"),
        aux_layers=list(manifest["aux_layers"]), d2t=d2t, t2d=t2d, store=str(store),
        target_model=(manifest.get("target") or {}).get("name"), num_layers=manifest.get("num_layers"),
        tail=growing, reader=reader,
    )
