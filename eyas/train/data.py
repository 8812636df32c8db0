"""Token-budget batches over a map-style set of samples, deterministic per (seed, epoch) and resumable.

A sample is a dict with `input_ids [T]`, `loss_mask [T]` and, for a store, `aux_hidden [T, A*H]` and
`final_hidden [T, H]`. Without stored features a `feature_fn(input_ids [B,T], attention_mask [B,T]) ->
(aux_hidden, final_hidden)` computes them per batch (the online source). A batch is the dict of
docs/INTERNALS.md "Training batches", right-padded.

Batching: the epoch's samples are shuffled with (seed, epoch) and packed greedily so that
`num_samples * longest <= batch_tokens`; then the batches are shuffled. With `sort` (train.batching=sorted)
the shuffled samples are first cut into windows of 256 and sorted by length inside a window (little padding,
but each batch holds samples of one length, which trains a worse draft: docs/PERFORMANCE.md). Under DDP each
rank takes every world_size-th batch of the same plan (the plan is truncated to a multiple of world_size so that every
rank runs the same number of steps). A sample longer than `batch_tokens` is truncated to it.
The data position is (epoch, index of the next batch in this rank's plan).

`stream` reads and pads batches in a background thread, two ahead of the training step (into pinned
memory on CUDA, copied asynchronously): the store's reads overlap the step's compute. Each batch carries
its own data position, so a checkpoint saved mid-epoch resumes at the batch after the one trained on.

Tailing a store that is still being captured (`TailBatcher`): epoch 0 is planned shard by shard as the
capture commits them, in shard-index order; consecutive shards are grouped until a group holds
`TAIL_GROUP_BATCHES` batches' worth of tokens (or is the last), and each group is packed and shuffled
like a window above. The plan depends only on the shards' contents, never on when they were committed,
so a resume replays it exactly. Under DDP a group's batch count is rounded up to a multiple of
world_size by repeating some of its batches. Epochs 1.. are planned over the complete store as above.
"""

from __future__ import annotations

import contextlib
import math
import queue
import random
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

SAMPLES_PER_WINDOW = 256
TAIL_GROUP_BATCHES = 16


def pack(order: list[int], lengths, batch_tokens: int, sort: bool = True) -> list[list[int]]:
    """Batches of sample indices, packed so that n * longest <= budget: with `sort`, windows of `order` sorted
    by length (little padding); without, in `order` as it is (each batch a random mix of lengths)."""
    windows = ([sorted(order[w:w + SAMPLES_PER_WINDOW], key=lambda i: lengths[i])
                for w in range(0, len(order), SAMPLES_PER_WINDOW)] if sort else [order])
    batches: list[list[int]] = []
    for window in windows:
        current: list[int] = []
        longest = 0
        for i in window:
            t = min(batch_tokens, lengths[i])
            if current and (len(current) + 1) * max(longest, t) > batch_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, t)
        if current:
            batches.append(current)
    return batches


def collate_host(fetch, indices: list[int], batch_tokens: int, pin: bool = False) -> dict:
    """The right-padded batch dict of the samples `fetch(i)` for i in indices, in host memory (pinned if `pin`)."""
    samples = [fetch(i) for i in indices]
    lengths = [min(len(s["input_ids"]), batch_tokens) for s in samples]
    b, t = len(samples), max(lengths)
    batch = {
        "input_ids": torch.zeros(b, t, dtype=torch.long, pin_memory=pin),
        "attention_mask": torch.zeros(b, t, dtype=torch.bool, pin_memory=pin),
        "loss_mask": torch.zeros(b, t, dtype=torch.float32, pin_memory=pin),
    }
    if "aux_hidden" in samples[0]:
        for key in ("aux_hidden", "final_hidden"):
            like = samples[0][key]
            batch[key] = torch.zeros(b, t, like.shape[-1], dtype=like.dtype, pin_memory=pin)
    for row, (s, n) in enumerate(zip(samples, lengths)):
        batch["input_ids"][row, :n] = torch.as_tensor(s["input_ids"][:n], dtype=torch.long)
        batch["attention_mask"][row, :n] = True
        batch["loss_mask"][row, :n] = torch.as_tensor(s["loss_mask"][:n]).float()
        if "aux_hidden" in batch:
            batch["aux_hidden"][row, :n] = torch.as_tensor(s["aux_hidden"][:n])
            batch["final_hidden"][row, :n] = torch.as_tensor(s["final_hidden"][:n])
    return batch


def to_device(batch: dict, device="cpu", feature_fn=None) -> dict:
    """A host batch moved to `device` (asynchronously from pinned memory), features computed if it has none."""
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if "aux_hidden" not in batch:
        assert feature_fn is not None, "samples carry no features and no feature_fn was given"
        aux, final = feature_fn(batch["input_ids"], batch["attention_mask"])
        batch["aux_hidden"], batch["final_hidden"] = aux.clone(), final.clone()  # out of inference mode
    return batch


def pad_rows(batch: dict, min_tokens: int, max_tokens: int | None = None) -> dict:
    """The batch with empty rows appended (zeros, masks off) until it has at least 2 rows and `min_tokens`
    positions, but never more than `max_tokens` positions (the token budget that sized memory); unchanged
    if it has them already.

    For compiled training steps: the packer's leftover batches (the last of each 256-sample window) can
    have one row or a few thousand tokens, and on the H200 each such batch made all K unrolled steps
    compile again (a one-row batch is specialised; inductor's size-dependent fusion decisions, taken on a
    big batch, fail below a threshold). Empty rows carry no loss and no statistics (docs/PERFORMANCE.md).
    """
    b, t = batch["input_ids"].shape
    rows = max(2, -(-min_tokens // t))
    if max_tokens is not None:
        rows = min(rows, max_tokens // t)
    if b >= rows:
        return batch
    out = {}
    for key, x in batch.items():
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == b:
            x = torch.cat([x, x.new_zeros((rows - b, *x.shape[1:]))])
        out[key] = x
    return out


def collate(fetch, indices: list[int], batch_tokens: int, feature_fn=None, device="cpu") -> dict:
    """collate_host then to_device, in this thread."""
    return to_device(collate_host(fetch, indices, batch_tokens), device, feature_fn)


_DONE = object()


def prefetched(items: Iterator, depth: int = 2, join_s: float = 10.0) -> Iterator:
    """The items of `items`, produced by a background thread up to `depth` ahead of the consumer.

    Reading a batch from the store and padding it (a few hundred ms for 65k tokens of features) then
    overlaps the previous step's compute. An exception in the producer is raised here, at the item where
    it happened. Closing this generator stops the producer and waits for it: a thread left inside torch
    when the interpreter exits can abort the process ("terminate called without an active exception").
    The wait is bounded by `join_s`: a producer that is not done by then is not inside one batch's torch
    work but waiting for data (a store still being captured), and is left to end with the process.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((_DONE, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            put((_DONE, e))

    thread = threading.Thread(target=produce, name="eyas-batch-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join(join_s)  # one item's production away, unless it waits for a shard


@dataclass
class Batcher:
    lengths: list[int]  # tokens per sample
    fetch: Callable[[int], dict]  # sample index -> sample dict
    batch_tokens: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    feature_fn: Callable | None = None  # online source: (input_ids, attention_mask) -> (aux, final)
    sort: bool = True  # length-sorted windows (train.batching=sorted), else shuffled mixes of lengths

    def __post_init__(self):
        if not self.lengths:
            raise ValueError("no training samples: the store or prepared data set is empty")

    def plan(self, epoch: int) -> list[list[int]]:
        """This rank's batches (lists of sample indices) for one epoch."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        batches = pack(order, self.lengths, self.batch_tokens, self.sort)
        rng.shuffle(batches)
        usable = len(batches) - len(batches) % self.world_size
        if usable == 0:
            raise ValueError(f"{len(batches)} batch(es) per epoch cannot be shared by {self.world_size} ranks; "
                             f"lower train.batch_tokens or add data")
        return batches[:usable][self.rank::self.world_size]

    def batches_per_epoch(self) -> int:
        return len(self.plan(0))

    def collate(self, indices: list[int], device="cpu") -> dict:
        return collate(self.fetch, indices, self.batch_tokens, self.feature_fn, device)

    def host_stream(self, epoch: int, start: int, pin: bool = False) -> Iterator[tuple[int, int, dict]]:
        """Endless (epoch, next_index, host batch) from a data position; epochs roll over."""
        while True:
            plan = self.plan(epoch)
            for i in range(start, len(plan)):
                yield epoch, i + 1, collate_host(self.fetch, plan[i], self.batch_tokens, pin)
            epoch, start = epoch + 1, 0

    def stream(self, epoch: int, start: int, device="cpu") -> Iterator[tuple[int, int, dict]]:
        """Endless (epoch, next_index, batch on device): batches are read and padded a step ahead."""
        return _on_device(self.host_stream(epoch, start, _pin(device)), device, self.feature_fn)


@dataclass
class TailBatcher:
    """Batches from a store that is still being written (see the module docstring).

    `store` is a GrowingStore (eyas/train/source.py): `num_shards`, `planned_tokens`, `wait_shard(i)` ->
    the range of global sample indices of shard i (blocks until it is committed), `lengths` (so far) and
    `[g]` -> sample.
    """

    store: object
    batch_tokens: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    feature_fn: Callable | None = None
    sort: bool = True

    def batches_per_epoch(self) -> int:
        """An estimate made before the store is complete: planned tokens / batch_tokens, per rank."""
        return max(1, math.ceil(self.store.planned_tokens / self.batch_tokens / self.world_size))

    def first_epoch(self) -> Iterator[list[int]]:
        """This rank's batches of epoch 0, group by group, waiting for shards as needed."""
        pending: list[int] = []
        group = 0
        for i in range(self.store.num_shards):
            pending += list(self.store.wait_shard(i))
            tokens = sum(min(self.batch_tokens, self.store.lengths[g]) for g in pending)
            if tokens < TAIL_GROUP_BATCHES * self.batch_tokens and i < self.store.num_shards - 1:
                continue
            rng = random.Random(f"tail {self.seed} {group}")
            order = list(pending)
            rng.shuffle(order)
            batches = pack(order, self.store.lengths, self.batch_tokens, self.sort)
            rng.shuffle(batches)
            extra = -len(batches) % self.world_size  # every rank must run the same number of steps
            batches += [batches[j % len(batches)] for j in range(extra)]
            yield from batches[self.rank::self.world_size]
            pending, group = [], group + 1

    def later_epochs(self) -> Batcher:
        return Batcher(list(self.store.lengths), self.store.__getitem__, self.batch_tokens, self.seed,
                       self.rank, self.world_size, self.feature_fn, self.sort)

    def host_stream(self, epoch: int, start: int, pin: bool = False) -> Iterator[tuple[int, int, dict]]:
        if epoch == 0:
            for i, indices in enumerate(self.first_epoch()):
                if i >= start:
                    yield 0, i + 1, collate_host(self.store.__getitem__, indices, self.batch_tokens, pin)
            epoch, start = 1, 0
        yield from self.later_epochs().host_stream(epoch, start, pin)

    def stream(self, epoch: int, start: int, device="cpu") -> Iterator[tuple[int, int, dict]]:
        return _on_device(self.host_stream(epoch, start, _pin(device)), device, self.feature_fn)


def _pin(device) -> bool:
    return torch.device(device).type == "cuda"


def _on_device(host: Iterator[tuple[int, int, dict]], device, feature_fn) -> Iterator[tuple[int, int, dict]]:
    with contextlib.closing(prefetched(host)) as items:  # closing this stream stops and joins the reader
        for epoch, index, batch in items:
            yield epoch, index, to_device(batch, device, feature_fn)
