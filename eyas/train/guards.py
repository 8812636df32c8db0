"""What keeps a training run from being lost or wasted: stop signals, wall-clock saves, a memory estimate
made before the first step, and the check that a resumed run trains the same shape as the checkpoint.

Stop signals. SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) set a flag that the loop reads
after each optimizer step; it then writes a checkpoint and stops with an error that says where it saved.
A second signal ends the process at once (KeyboardInterrupt / SystemExit(143)). Handlers are installed
only in the main thread (Python's rule); elsewhere training runs without them.

Memory. The estimate is a lower bound, so that a run it refuses certainly does not fit: fp32 weights,
gradients and both AdamW moments of the trainable parameters (16 bytes each), the frozen embedding and
target head, one batch of features, the target's distribution over the draft vocabulary, and four
hidden-sized fp32 tensors per token and unrolled step kept for the backward (the measured peaks are about
twice this: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch

from eyas.common import EyasError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
HEADROOM = 1.2  # refuse only an estimate above this multiple of the available memory
# the train.* keys a resumed run must share with its checkpoint: each changes the shape of a step or the plan
# of batches it reads (the draft's shape, aux layers and features are compared through draft.json)
RESUME_KEYS = ("ttt", "batch_tokens", "grad_accum", "features", "seed")


class StopSignals:
    """`requested` names the first SIGTERM/SIGINT received inside the `with` block (None until then)."""

    def __init__(self):
        self.requested: str | None = None
        self._saved: dict = {}

    def _on_signal(self, signum, frame) -> None:
        if self.requested is not None:  # the second signal: stop now, without a checkpoint
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._saved = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._saved.items():
            signal.signal(s, handler)


class SaveClock:
    """Whether `minutes` of wall time have passed since the last checkpoint (never with minutes = 0)."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60.0
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self.last >= self.seconds

    def saved(self) -> None:
        self.last = time.monotonic()


def stopped_error(signame: str, step: int, total_steps: int, step_dir: Path) -> EyasError:
    return EyasError(f"stopped by {signame} after step {step}/{total_steps}; checkpoint saved in {step_dir}; rerun "
                     f"the same command with --resume to continue from it")


# ---- memory

def available_bytes(device: torch.device) -> tuple[int | None, str]:
    """(bytes this process can still take on `device`, where that figure comes from); None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device} (torch.cuda.mem_get_info)"
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # processes sharing this host's memory
        share = f" for each of {ranks} local ranks" if ranks > 1 else ""
        return int(line.split()[1]) * 1024 // ranks, f"MemAvailable{share} (/proc/meminfo)"
    return None, "unknown"


def estimate_bytes(draft, tc, lm_head_weight: torch.Tensor, num_aux: int) -> dict[str, int]:
    """A lower bound of training's peak memory, by part (module docstring)."""
    hidden, draft_vocab = draft.cfg.hidden_size, draft.cfg.draft_vocab_size
    tokens = tc.batch_tokens
    return {
        "weights, gradients and AdamW state": 16 * draft.num_trainable_params(),
        "embedding and target head": 4 * draft.embed_tokens.weight.numel()
        + lm_head_weight.numel() * lm_head_weight.element_size(),
        "features of a batch": 4 * tokens * (num_aux + 1) * hidden,
        "activations": 4 * 4 * tokens * tc.ttt * hidden + 4 * tokens * draft_vocab,
    }


def check_memory(draft, tc, lm_head_weight: torch.Tensor, num_aux: int, device: torch.device) -> None:
    """Stop before the first step when the estimate clearly exceeds the memory available on `device`."""
    parts = estimate_bytes(draft, tc, lm_head_weight, num_aux)
    need = sum(parts.values())
    have, where = available_bytes(device)
    if have is None or need <= HEADROOM * have:
        return
    gib = lambda n: f"{n / 2**30:,.1f} GiB"  # noqa: E731
    biggest = max(parts, key=parts.get)
    raise EyasError(f"training with train.ttt={tc.ttt} and train.batch_tokens={tc.batch_tokens} needs at least "
                    f"{gib(need)} ({biggest} {gib(parts[biggest])}) but {gib(have)} is {where}; lower "
                    f"train.batch_tokens (and raise train.grad_accum to keep the tokens per step) or train.ttt")


# ---- resume

def check_resume_config(step_dir: Path, cfg) -> None:
    """The checkpoint's config.yaml must agree with this run's on RESUME_KEYS, or the error names them."""
    import yaml

    path = Path(step_dir) / "config.yaml"
    if not path.is_file():
        return
    try:
        saved = (yaml.safe_load(path.read_text()) or {}).get("train") or {}
    except yaml.YAMLError as e:
        raise EyasError(f"{path}: not readable YAML ({e.__class__.__name__}); resume from another step directory or "
                        f"train into a new --out") from None
    ours = cfg.train
    differ = [(k, saved[k], getattr(ours, k)) for k in RESUME_KEYS
              if k in saved and not _same(saved[k], getattr(ours, k))]
    if differ:
        said = ", ".join(f"train.{k} is {a!r} there and {b!r} now" for k, a, b in differ)
        sets = " ".join(f"--set train.{k}={a}" for k, a, _ in differ)
        raise EyasError(f"cannot resume from {step_dir}: {said}; resume with the checkpoint's values ({sets}) or "
                        f"train into a new --out")


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    return a == b
