"""Helpers for store tests: prepared directories built directly (the layout of docs/INTERNALS.md)."""

import json

import numpy as np


def make_prepared(path, num_samples=24, vocab=259, min_len=5, max_len=40, seed=0):
    """A prepared dir with random token ids (< vocab) and an assistant-like loss mask on the tail."""
    import datasets

    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=num_samples)
    ids, masks = [], []
    for n in lengths:
        ids.append(rng.integers(0, vocab, size=n).astype(np.int32).tolist())
        start = int(rng.integers(1, n))
        masks.append([0] * start + [1] * (n - start))
    datasets.Dataset.from_dict({
        "sample_id": [f"s{i:04d}" for i in range(num_samples)], "input_ids": ids, "loss_mask": masks,
    }).save_to_disk(str(path / "dataset"))
    (path / "prepare.json").write_text(json.dumps({"source": "store tests", "num_kept": int(num_samples)}))
    return path


def tiny_cfg(**capture):
    from eyas.config import load_config

    sets = [f"capture.{k}={v}" for k, v in capture.items()]
    return load_config("tiny", ["target.device=cpu", *sets])


def capture_argv(prepared, store, *sets, threads=None):
    """`eyas capture` on the tiny target in a fresh interpreter, with this process's thread count
    (CPU float results may depend on it, and resumed stores are compared bit for bit)."""
    import sys

    import torch

    threads = threads or torch.get_num_threads()
    boot = f"import sys, torch; torch.set_num_threads({threads}); from eyas.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["capture", "--config", "tiny", "--set", "target.device=cpu", "--data", str(prepared), "--out", str(store)]
    for s in sets:
        args += ["--set", s]
    return [sys.executable, "-c", boot, *args]


POISON = 7  # token id whose embedding `poison_embeddings` turns into NaN


def poisoned_prepared(path, poisoned: dict[int, int], num_samples=20, seed=1, min_len=8, max_len=29):
    """A prepared dir of random ids >= 10, but sample i of `poisoned` has POISON at position poisoned[i].
    Returns (path, lengths)."""
    import datasets

    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for i in range(num_samples):
        n = int(rng.integers(min_len, max_len + 1))
        row = rng.integers(10, 259, size=n).tolist()
        if i in poisoned:
            row[poisoned[i]] = POISON
        ids.append(row)
        masks.append([0] * 3 + [1] * (n - 3))
    datasets.Dataset.from_dict({"sample_id": [f"s{i:04d}" for i in range(num_samples)], "input_ids": ids,
                                "loss_mask": masks}).save_to_disk(str(path / "dataset"))
    (path / "prepare.json").write_text(json.dumps({"source": "nonfinite test", "num_kept": num_samples}))
    return path, [len(r) for r in ids]


def poison_embeddings(target):
    """Make the target's embedding of POISON NaN (as an overflowing fp16 layer would), through a hook."""
    def hook(module, args, out):
        return out.masked_fill((args[0] == POISON)[..., None], float("nan"))

    target.embed_tokens.register_forward_hook(hook)
    return target


def capture(cfg, prepared, store, target=None) -> dict:
    """The capture stage (eyas.stages.capture.run) from a prepared directory into `store`."""
    from eyas.stages import capture as stage

    return stage.run(cfg, stage.Inputs(prepared=prepared), store, target=target)
