"""Host memory for one shard's captured states, laid out as the shard file's tensors.

Each forward pass's rows are copied straight to their place in the shard (no concatenation later), and
the writer streams the regions to disk from there. On CUDA the regions are pinned and the copies run
on a separate copy stream: the copy of pass i overlaps the forward pass i+1 on the compute stream, and
the writer thread waits on the recorded events, never on the device as a whole. Buffers are reused
from a bounded pool (eyas/store/writer.py), so host memory stays bounded however long the capture.
"""

from __future__ import annotations

import torch


class ShardBuffer:
    """regions[name]: [capacity, width] in the storage dtype; rows [0, self.rows) are filled."""

    def __init__(self, layout: dict[str, tuple[int, torch.dtype]], capacity: int, pinned: bool = False):
        self.capacity = capacity
        self.regions = {name: torch.empty((capacity, width), dtype=dtype, pin_memory=pinned)  # [capacity, width]
                        for name, (width, dtype) in layout.items()}
        self.pinned = pinned
        self.rows = 0
        self.events: list = []  # torch.cuda.Event per pass, recorded after its copies were enqueued
        self.counts: list[torch.Tensor] = []  # per pass: [B] tokens per sample whose states hold NaN or inf

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.regions.values())

    def reset(self) -> None:
        self.rows, self.events, self.counts = 0, [], []

    def put(self, states: dict[str, torch.Tensor], copy_stream=None, nonfinite: torch.Tensor | None = None) -> None:
        """Append one pass's states ({name: [t, width]}, in sample order) after the rows already there, and
        its samples' counts of non-finite tokens (`nonfinite` [B], same order; see `nonfinite_per_sample`).

        With a copy stream (CUDA) the copy is asynchronous: it starts once the compute stream has produced
        the states, and the device tensors are kept alive (record_stream) until it is done."""
        t = next(iter(states.values())).shape[0]
        assert states.keys() == self.regions.keys() and all(x.shape[0] == t for x in states.values())
        assert self.rows + t <= self.capacity, f"a shard buffer of {self.capacity} rows cannot take {self.rows + t}"
        lo, hi = self.rows, self.rows + t
        if copy_stream is None:
            for name, x in states.items():
                self.regions[name][lo:hi].copy_(x)
            if nonfinite is not None:
                self.counts.append(nonfinite.clone())
        else:
            device = next(iter(states.values())).device
            copy_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(copy_stream):
                for name, x in states.items():
                    self.regions[name][lo:hi].copy_(x, non_blocking=True)
                    x.record_stream(copy_stream)  # the compute stream may not reuse this memory before the copy ends
                if nonfinite is not None:
                    host = torch.empty(nonfinite.shape, dtype=nonfinite.dtype, pin_memory=self.pinned)
                    host.copy_(nonfinite, non_blocking=True)
                    nonfinite.record_stream(copy_stream)
                    self.counts.append(host)
                done = torch.cuda.Event()
                done.record(copy_stream)
            self.events.append(done)
        self.rows = hi

    def wait(self) -> None:
        """Block until every copy into this buffer has landed (called by the writer thread)."""
        for event in self.events:
            event.synchronize()
        self.events = []

    def nonfinite_per_sample(self) -> list[int]:
        """Tokens per sample (in put order) whose captured states hold a NaN or inf; after `wait()`."""
        return [int(n) for counts in self.counts for n in counts.tolist()]

    def view(self, name: str) -> torch.Tensor:
        return self.regions[name][:self.rows]  # [rows, width], contiguous
