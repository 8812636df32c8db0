"""Training metrics: one fixed-format line per interval, metrics.jsonl, TensorBoard, curves.png at the end.

Only rank 0 writes. Records are flat dicts with unit-bearing keys, e.g.
{"step": 120, "loss": 2.41, "loss_0": ..., "acc_0": 0.71, ..., "tau_sim": 3.1, "lr": 1e-4,
 "tokens_per_s": 42000.0, "peak_mem_GiB": 3.1, "elapsed_s": 61.0}; acc_k are measured on the training
batches of the interval. With train.val_samples, the records of the scoring steps also carry val_loss,
val_acc_k and val_tau_sim: the same measures on samples never trained on; val_tau_fresh the simulated tau over
the held-out tokens outside repeats (loop.repeat_mask) and val_fresh_share their share of the loss tokens.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from eyas.common import print0


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def format_line(rec: dict, total_steps: int, ttt: int) -> str:
    tok = rec["tokens_per_s"]
    rate = f"{tok / 1000:.1f}k" if tok >= 1000 else f"{tok:.0f}"
    accs = " ".join(f"acc{k} {rec[f'acc_{k}']:.2f}" for k in range(ttt))
    line = (f"step {rec['step']}/{total_steps} | loss {rec['loss']:.3f} | {accs} | tau {rec['tau_sim']:.2f} | "
            f"lr {rec['lr']:.1e} | {rate} tok/s | {rec['peak_mem_GiB']:.1f} GiB")
    if "val_acc_0" in rec:
        val_accs = " ".join(f"{rec[f'val_acc_{k}']:.2f}" for k in range(ttt))
        line += f"\n  held-out: loss {rec['val_loss']:.3f} | acc0..{ttt - 1} {val_accs} | tau {rec['val_tau_sim']:.2f}"
        if "val_tau_fresh" in rec:
            line += f" ({rec['val_tau_fresh']:.2f} outside repeats, {rec['val_fresh_share']:.0%} of the tokens)"
    return line


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, resume_step: int | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        if resume_step is not None and self.path.is_file():
            # drop records written after the checkpoint we resume from (they will be recomputed)
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resume_step)
        except ImportError:
            self.tb = None

    def log(self, rec: dict, total_steps: int, ttt: int) -> None:
        if not self.enabled:
            return
        print0(format_line(rec, total_steps, ttt))
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, rec["step"])
            self.tb.flush()

    def close(self, ttt: int) -> Path | None:
        if not self.enabled:
            return None
        if self.tb is not None:
            self.tb.close()
        return plot_curves(self.path, ttt)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: Path, ttt: int) -> Path | None:
    """curves.png beside metrics.jsonl: total loss, per-step loss and acc_k against the step."""
    records = read_metrics(metrics_path) if Path(metrics_path).is_file() else []
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records], color="black", label="total (weighted)")
    for k in range(ttt):
        ax_loss.plot(steps, [r[f"loss_{k}"] for r in records], alpha=0.7, label=f"loss_{k}")
        ax_acc.plot(steps, [r[f"acc_{k}"] for r in records], label=f"acc_{k}")
    held = [r for r in records if "val_acc_0" in r]
    if held:
        ax_acc.plot([r["step"] for r in held], [r["val_acc_0"] for r in held], "k--", marker="o", label="held-out acc_0")
    ax_loss.set(xlabel="optimizer step", ylabel="soft cross-entropy", title="loss")
    ax_acc.set(xlabel="optimizer step", ylabel="top-1 agreement with target", title="acc_k", ylim=(0, 1))
    ax_loss.legend(fontsize=7)
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    out = Path(metrics_path).parent / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
