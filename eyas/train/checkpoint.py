"""Atomic, self-describing checkpoints: RUN_DIR/step-NNNNNNN/ and the RUN_DIR/latest symlink.

A step directory is written under a temporary name, every file fsynced, then renamed into place;
only then is `latest` re-pointed (a new symlink renamed over the old one). A crash at any moment leaves
either the previous checkpoint or the new one, never half of one. Older step directories beyond
`keep_last` are deleted after the new one is in place.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from eyas.common import atomic_write_json, fsync_dir, read_json, save_config
from eyas.config import RunConfig

STEP_PREFIX = "step-"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(path)


def save_checkpoint(run_dir: Path, step: int, model_state: dict, optim_state: dict, trainer_state: dict,
                    draft_meta: dict, cfg: RunConfig, keep_last: int) -> Path:
    """Write step-N/ atomically, re-point `latest`, prune old steps. model_state excludes the embedding."""
    from safetensors.torch import save_file

    run_dir = Path(run_dir)
    final = run_dir / step_dir_name(step)
    tmp = run_dir / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in model_state.items() if k != "embed_tokens.weight"}
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "draft.json").write_text(json.dumps(draft_meta, indent=2) + "\n")
    torch.save(optim_state, tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
    save_config(cfg, tmp / "config.yaml")
    _fsync_tree(tmp)
    if final.exists():  # a rerun of the same step (e.g. the final save after a resume at that step)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(run_dir)
    link_tmp = run_dir / ".latest.tmp"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    os.symlink(final.name, link_tmp)
    os.replace(link_tmp, run_dir / "latest")
    fsync_dir(run_dir)
    for old in list_steps(run_dir)[:-keep_last]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_steps(run_dir: Path) -> list[Path]:
    """Complete step directories, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    steps = [p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)
             and (p / "trainer_state.json").is_file()]
    return sorted(steps, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def latest_step_dir(run_dir: Path) -> Path | None:
    link = Path(run_dir) / "latest"
    if link.is_symlink() and (link.resolve() / "trainer_state.json").is_file():
        return link.resolve()
    steps = list_steps(run_dir)
    return steps[-1] if steps else None


def load_checkpoint(step_dir: Path) -> dict:
    """Everything a resume needs: model weights, optimizer + scheduler state, trainer state, RNG, meta."""
    from safetensors.torch import load_file

    step_dir = Path(step_dir)
    return {
        "model": load_file(str(step_dir / "model.safetensors")),
        "optim": torch.load(step_dir / "optimizer.pt", weights_only=False),
        "rng": torch.load(step_dir / "rng.pt", weights_only=False),
        "trainer_state": read_json(step_dir / "trainer_state.json"),
        "draft_meta": read_json(step_dir / "draft.json"),
        "dir": step_dir,
    }


def write_summary(run_dir: Path, summary: dict) -> None:
    atomic_write_json(Path(run_dir) / "summary.json", summary)
