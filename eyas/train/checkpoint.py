"""Atomic, self-describing checkpoints: RUN_DIR/step-NNNNNNN/ and the RUN_DIR/latest symlink.

A step directory is written under a temporary name, every file fsynced, then renamed into place;
only then is `latest` re-pointed (a new symlink renamed over the old one). A crash at any moment leaves
either the previous checkpoint or the new one, never half of one; a failed write (a full disk) removes
its temporary directory and names the cause. Older step directories beyond `keep_last` are deleted after
the new one is in place.

Nothing is pickled. A step directory holds:

    model.safetensors      the draft's weights (fp32, without the frozen embedding)
    draft.json             the draft's config, aux layers, features, target identity
    optimizer.safetensors  the optimizer's and scheduler's tensors, each under its path ("optimizer/state/0/exp_avg")
    optimizer.json         the rest of that state, tensors replaced by {"tensor": path}
    rng.safetensors        torch's (and each CUDA device's) generator state, uint8
    rng.json               Python's and numpy's generator states
    trainer_state.json     step, data position, counters
    config.yaml            the resolved run config

The JSON trees tag containers ({"dict": [[key, value], ...]}, {"list": [...]}, {"tuple": [...]}), so that
integer keys and tuples come back as they went in and the loaded state is the saved one exactly.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from eyas.common import EyasError, atomic_write_json, fsync_dir, nonfinite_tensors, read_json, save_config
from eyas.config import RunConfig

STEP_PREFIX = "step-"
PICKLED_FILES = ("optimizer.pt", "rng.pt")  # the files of the older, pickled layout: refused, never loaded


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"


# ---- tensors + JSON, no pickle

def to_tree(obj, tensors: dict, path: str):
    """`obj` as a JSON-safe tree; its tensors go into `tensors` under their path."""
    if isinstance(obj, torch.Tensor):
        if path in tensors:  # a key holding "/" met a nested one of the same spelling
            path = f"{path}#{len(tensors)}"
        tensors[path] = obj.detach().cpu().contiguous().clone()
        return {"tensor": path}
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"{path}: a key of type {type(key).__name__} cannot be saved")
        return {"dict": [[key, to_tree(value, tensors, f"{path}/{key}")] for key, value in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [to_tree(value, tensors, f"{path}/{i}") for i, value in enumerate(obj)]
        return {"tuple" if isinstance(obj, tuple) else "list": items}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{path}: a value of type {type(obj).__name__} cannot be saved in a checkpoint")


def from_tree(tree, tensors: dict, where: Path):
    """The object `to_tree` encoded (`where` names the file in errors)."""
    if not isinstance(tree, dict):
        return tree
    if len(tree) != 1:
        raise EyasError(f"{where}: not a checkpoint written by eyas (unexpected entry {sorted(tree)[:3]})")
    (tag, value), = tree.items()
    if tag == "tensor":
        if value not in tensors:
            raise EyasError(f"{where}: names tensor {value!r}, which its .safetensors file does not hold")
        return tensors[value]
    if tag == "dict":
        return {key: from_tree(item, tensors, where) for key, item in value}
    if tag in ("list", "tuple"):
        items = [from_tree(item, tensors, where) for item in value]
        return tuple(items) if tag == "tuple" else items
    raise EyasError(f"{where}: not a checkpoint written by eyas (unknown entry {tag!r})")


def save_tree(obj, directory: Path, stem: str) -> None:
    """`obj` as STEM.safetensors (its tensors) + STEM.json (everything else)."""
    from safetensors.torch import save_file

    tensors: dict = {}
    tree = to_tree(obj, tensors, stem)
    save_file(tensors, str(directory / f"{stem}.safetensors"))
    (directory / f"{stem}.json").write_text(json.dumps(tree) + "\n")


def load_tree(directory: Path, stem: str):
    from safetensors.torch import load_file

    tensors_path, json_path = directory / f"{stem}.safetensors", directory / f"{stem}.json"
    for path in (tensors_path, json_path):
        if not path.is_file():
            raise EyasError(f"{path} is missing: the checkpoint is incomplete; resume from another step directory "
                            f"or train into a new --out")
    try:
        tensors = load_file(str(tensors_path))
        tree = json.loads(json_path.read_text())
    except Exception as e:  # noqa: BLE001 -- safetensors' and json's errors do not name the file
        raise EyasError(f"{directory}/{stem}.*: unreadable ({type(e).__name__}: {e}); resume from another step "
                        f"directory or train into a new --out") from None
    return from_tree(tree, tensors, json_path)


# ---- random number generators

def rng_state() -> dict:
    """Every generator training draws from: Python's, numpy's, torch's and (if present) CUDA's."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- step directories

def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(path)


def check_finite(weights: dict, what: str) -> None:
    """Refuse weights holding NaN or inf: such a draft is never written."""
    bad = list(nonfinite_tensors(weights))
    if bad:
        raise EyasError(f"{what}: the draft's weights hold NaN or inf ({', '.join(bad[:4])}), so they are not saved; "
                        f"the last good checkpoint is kept; lower train.lr, and check the data with `eyas verify`")


def _write_failed(err: OSError, final: Path) -> EyasError:
    run_dir = final.parent
    try:
        free = f"{shutil.disk_usage(run_dir).free / 2**30:.2f} GiB free"
    except OSError:
        free = "free space unknown"
    cause = "disk full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else (err.strerror or str(err))
    kept = latest_step_dir(run_dir)
    keep = f"{kept} is intact" if kept else "no earlier checkpoint exists"
    return EyasError(f"could not write checkpoint {final} ({cause}; {free} on {run_dir}); {keep}; free some space "
                     f"(or lower train.keep_last) and rerun with --resume")


def _write_step(tmp: Path, weights: dict, optim_state: dict, trainer_state: dict, draft_meta: dict,
                cfg: RunConfig) -> None:
    from safetensors.torch import save_file

    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "draft.json").write_text(json.dumps(draft_meta, indent=2) + "\n")
    save_tree(optim_state, tmp, "optimizer")
    save_tree(rng_state(), tmp, "rng")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
    save_config(cfg, tmp / "config.yaml")
    _fsync_tree(tmp)


def save_checkpoint(run_dir: Path, step: int, model_state: dict, optim_state: dict, trainer_state: dict,
                    draft_meta: dict, cfg: RunConfig, keep_last: int) -> Path:
    """Write step-N/ atomically, re-point `latest`, prune old steps. model_state excludes the embedding."""
    run_dir = Path(run_dir)
    final = run_dir / step_dir_name(step)
    tmp = run_dir / f".{final.name}.tmp"
    weights = {k: v.detach().cpu().contiguous() for k, v in model_state.items() if k != "embed_tokens.weight"}
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    check_finite(weights, f"checkpoint {final}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_step(tmp, weights, optim_state, trainer_state, draft_meta, cfg)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _write_failed(e, final) from None
        raise
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


def refuse_pickles(step_dir: Path) -> None:
    """A step directory holding a pickled file is refused before anything in it is read."""
    for name in PICKLED_FILES:
        if (step_dir / name).exists():
            raise EyasError(f"{step_dir / name}: a pickled checkpoint file (an older eyas, or not written by eyas); "
                            f"eyas never unpickles (it can run code): train into a new --out, or start this run "
                            f"fresh without --resume")


def load_checkpoint(step_dir: Path) -> dict:
    """Everything a resume needs: model weights, optimizer + scheduler state, trainer state, RNG, meta."""
    from safetensors.torch import load_file

    step_dir = Path(step_dir)
    refuse_pickles(step_dir)
    return {
        "model": load_file(str(step_dir / "model.safetensors")),
        "optim": load_tree(step_dir, "optimizer"),
        "rng": load_tree(step_dir, "rng"),
        "trainer_state": read_json(step_dir / "trainer_state.json"),
        "draft_meta": read_json(step_dir / "draft.json"),
        "dir": step_dir,
    }


def write_summary(run_dir: Path, summary: dict) -> None:
    atomic_write_json(Path(run_dir) / "summary.json", summary)
