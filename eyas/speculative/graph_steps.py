"""Capture and replay of the static path's passes, their reads back to the host, and compiled draft passes.

Eagerly, a small target is bound by the host: each of SmolLM2's 30 layers is a dozen kernel launches
and each launch some microseconds of Python and driver work, so a forward costs far more on the host
than on the GPU. A CUDA graph records the launches once and replays them with one call (`_Step`).

Results land in buffers allocated before capture, never in a graph's private pool (whose memory a replay
reuses), and reach the host through pinned memory and an event per read (`_Reads`), one cycle late: the
host queues cycle c + 1 before it reads cycle c, so the GPU does not idle while the host decides.

With compile_draft (`eyas eval --compile-draft`, on in the full preset), the draft-side passes (a chain's or a
tree's drafting with its ranking and masks, a rebuild) are compiled whole by torch.compile with static sizes
before their graphs are captured (`compiled_pass`): the draft then attends over the whole capacity (its masks
hide what it may not see), so a pass has one shape at every attended width and compiles once. Fused, a tree
16,4,48's draft phase costs 0.55 ms instead of 1.01 on an H200 (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch

from eyas.common import EyasError, capture_cuda_graph


class _Step:
    """`fn` (which writes its results into persistent buffers) captured as a CUDA graph and replayed,
    or simply called when graphs are off."""

    def __init__(self, fn, device: torch.device, graphs: bool, name: str, pool=None):
        self.fn, self.graph = fn, None
        if graphs:
            self.graph = capture_cuda_graph(fn, device, f"the {name} pass", "Decode eagerly instead with `eyas eval "
                                            "--no-cuda-graphs` (or --set eval.cuda_graphs=false)", pool=pool)

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class _Reads:
    """Small device results copied to pinned host memory without waiting, read back later in order."""

    def __init__(self, width: int, device: torch.device, slots: int = 4):
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(slots, width, dtype=torch.long, pin_memory=self.cuda)  # [slots, width]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(slots)]  # re-recorded per push

    def push(self, i: int, src: torch.Tensor) -> None:
        s = i % len(self.events)
        self.host[s].copy_(src, non_blocking=self.cuda)
        if self.cuda:
            self.events[s].record()

    def get(self, i: int) -> list[int]:
        s = i % len(self.events)
        if self.cuda:
            self.events[s].synchronize()
        return self.host[s].tolist()


def allow_recompiles(limit: int) -> None:
    """Raise dynamo's limit of compiled entries per code object to at least `limit`: there is one entry per
    pass and decoder, and chains of several lengths and rebuilds share code objects."""
    import torch._dynamo as dynamo

    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, limit)


def compiled_pass(fn, backend: str, name: str):
    """`fn` (a draft-side pass) compiled whole by `backend`, static sizes; fullgraph, so that a graph break
    is an error, not a silent eager pass. A compiler failure, at the first call, becomes an EyasError naming
    the way out."""
    import torch._dynamo as dynamo

    # FailOnRecompileLimitHit (fullgraph cannot fall back to eager) is not a TorchDynamoException
    limit_hit = getattr(dynamo.exc, "FailOnRecompileLimitHit", None)
    errors = (dynamo.exc.TorchDynamoException,) + ((limit_hit,) if limit_hit else ())
    try:
        compiled = torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
    except errors as e:  # an unknown backend, say
        raise _compile_failed(e, backend, name) from e

    def run() -> None:
        try:
            with torch.no_grad():  # one grad mode whoever calls: another would be another compilation
                compiled()
        except errors as e:  # compiling happens at the first call
            raise _compile_failed(e, backend, name) from e

    return run


def _compile_failed(e: Exception, backend: str, name: str) -> EyasError:
    first = " ".join([line.strip() for line in str(e).splitlines() if line.strip()][:2])[:300]
    return EyasError(f"torch.compile (backend {backend!r}) failed on the draft's pass ({name}): "
                     f"{type(e).__name__}: {first}. Compiling the draft is an experiment (eval.compile_draft); "
                     f"run without --compile-draft (or --set eval.compile_draft=false)")
