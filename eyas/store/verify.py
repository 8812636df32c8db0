"""Checking a store: its files against its manifest, and stored states against recomputed ones.

Every problem is collected as one line; the store is good when the list is empty. Recomputation runs
each chosen sample alone (batch 1, no padding) through the same hooks and compares every stored layer two
ways. Relative error = max abs error / max abs reference value, against the storage dtype's tolerance
(codec.TOLERANCE): it catches a few corrupt values. And the median over the sample's tokens of each
token's error norm / its reference norm, against LAYER_TOLERANCE: a target's few huge activations make the
first figure blind to a neighbouring layer (SmolLM2's layers 27 and 28 differ by 0.012 of the largest
value), while each token's state differs from the next layer's by about a quarter of its norm. A NaN or
inf, stored or recomputed, fails both.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import torch

from eyas.common import sha256_file
from eyas.store.codec import STORAGE_DTYPES, TOLERANCE, parts
from eyas.store.manifest import HEAD_FILE, committed_shards, nonfinite_ids, read_manifest

# the largest median per-token relative error a stored layer may show: SmolLM2's neighbouring layers differ by
# 0.26-0.33 (median over a sample's tokens), while a bf16 capture recomputed in fp32 differs by at most 0.022
# and fp8 storage adds about 0.03
LAYER_TOLERANCE = 0.1


def check_files(store: Path, manifest: dict) -> list[str]:
    """sha256s, counts, shapes and dtypes of every committed shard, and the sums in the manifest."""
    from safetensors import safe_open

    problems = []
    head = manifest.get("target_head") or {}
    if not (store / HEAD_FILE).is_file():
        problems.append(f"{HEAD_FILE} is missing")
    elif head.get("sha256") and sha256_file(store / HEAD_FILE) != head["sha256"]:
        problems.append(f"{HEAD_FILE}: sha256 differs from the manifest (file changed or corrupt)")
    num_aux, hidden = len(manifest["aux_layers"]), manifest["hidden_size"]
    want_dtypes = dict(zip(("aux_hidden", "final_hidden"), (STORAGE_DTYPES[p] for p in parts(manifest["dtype"]))))
    seen_ids: set[str] = set()
    shards = committed_shards(store, manifest)
    for rec in shards:
        path = store / rec["file"]
        if not path.is_file():
            problems.append(f"{rec['file']}: missing")
            continue
        if path.stat().st_size != rec["bytes"]:
            problems.append(f"{rec['file']}: {path.stat().st_size} bytes, the manifest says {rec['bytes']}")
        if sha256_file(path) != rec["sha256"]:
            problems.append(f"{rec['file']}: sha256 differs from the manifest (file changed or corrupt)")
            continue
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets")  # [n+1]
            ids = json.loads(f.metadata()["eyas"])["sample_ids"]
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
            dtypes = {k: f.get_slice(k).get_dtype() for k in want_dtypes if k in shapes}
        n, t = len(offsets) - 1, int(offsets[-1])
        if n != rec["num_samples"] or len(ids) != n or t != rec["num_tokens"]:
            problems.append(f"{rec['file']}: {n} samples / {t} tokens inside, the manifest says "
                            f"{rec['num_samples']} / {rec['num_tokens']}")
        if bool((offsets[1:] <= offsets[:-1]).any()) or int(offsets[0]) != 0:
            problems.append(f"{rec['file']}: offsets are not strictly increasing from 0")
        want = {"input_ids": [t], "loss_mask": [t], "aux_hidden": [t, num_aux * hidden], "final_hidden": [t, hidden]}
        for key, shape in want.items():
            if shapes.get(key) != shape:
                problems.append(f"{rec['file']}: {key} has shape {shapes.get(key)}, expected {shape}")
        for key, want_dtype in want_dtypes.items():
            if key in dtypes and dtypes[key] != _st_dtype(want_dtype):
                problems.append(f"{rec['file']}: {key} is {dtypes[key]}, the manifest's dtype {manifest['dtype']} "
                                f"stores it as {_st_dtype(want_dtype)}")
        dup = seen_ids.intersection(ids)
        if dup:
            problems.append(f"{rec['file']}: sample ids stored twice, e.g. {sorted(dup)[:3]}")
        seen_ids.update(ids)
    if manifest["shards"]:
        for key, field in (("num_samples", "num_samples"), ("num_tokens", "num_tokens")):
            total = sum(r[field] for r in manifest["shards"])
            if manifest.get(key) != total:
                problems.append(f"manifest {key} is {manifest.get(key)}, its shards sum to {total}")
    if manifest.get("complete"):
        if len(shards) != manifest["plan"]["num_shards"]:
            problems.append(f"manifest says complete with {len(shards)} of {manifest['plan']['num_shards']} shards")
        if len(seen_ids) != manifest["plan"]["num_samples"]:
            problems.append(f"complete store holds {len(seen_ids)} samples, the plan has {manifest['plan']['num_samples']}")
    return problems


def _st_dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3"}[dtype]


def pick_samples(reader, num_samples: int, seed: int) -> list[int]:
    """`num_samples` random samples to recompute; those capture flagged with NaN or inf are listed by
    `check_store`'s report and skipped by training, not judged."""
    flagged = reader.nonfinite()
    finite = [i for i in range(len(reader)) if i not in flagged]
    return sorted(random.Random(seed).sample(finite, min(num_samples, len(finite))))


def judge_sample(i: int, sample: dict, aux: torch.Tensor, final: torch.Tensor, manifest: dict,
                 prepared=None, row_of: dict | None = None) -> tuple[list[dict], list[str]]:
    """The stored states of `sample` (index i) against recomputed ones (aux [T, A*H], final [T, H], fp32):
    one row per layer, and a problem line per layer out of tolerance (and when the prepared data, if still
    there, holds other tokens for it)."""
    aux_tol, final_tol = (TOLERANCE[p] for p in parts(manifest["dtype"]))
    hidden = manifest["hidden_size"]
    names = [f"aux {k}" for k in manifest["aux_layers"]] + ["final"]
    stored = list(sample["aux_hidden"].split(hidden, dim=-1)) + [sample["final_hidden"]]
    fresh = list(aux.split(hidden, dim=-1)) + [final]
    rows, problems = [], []
    for name, s, f in zip(names, stored, fresh):
        tol = final_tol if name == "final" else aux_tol
        s = s.float()
        err = (s - f).abs().max().item()  # NaN if either holds one
        rel = err / max(f.abs().max().item(), 1e-30)
        per_token = ((s - f).norm(dim=-1) / f.norm(dim=-1).clamp_min(1e-30)).median().item()
        ok = math.isfinite(rel) and rel <= tol and math.isfinite(per_token) and per_token <= LAYER_TOLERANCE
        rows.append({"sample": i, "sample_id": sample["sample_id"], "layer": name, "max_abs": err, "rel": rel,
                     "per_token": per_token, "ok": ok})
        if not (math.isfinite(err) and math.isfinite(per_token)):
            problems.append(f"sample {sample['sample_id']} {name}: NaN or inf in the stored or recomputed states")
        elif rel > tol:
            problems.append(f"sample {sample['sample_id']} {name}: relative error {rel:.2e} > {tol:.0e}")
        elif per_token > LAYER_TOLERANCE:
            problems.append(f"sample {sample['sample_id']} {name}: each token's state differs from the "
                            f"recomputed one by {per_token:.2f} of its norm (median) > {LAYER_TOLERANCE}: another "
                            f"layer's states, or another target's")
    if prepared is not None:
        row = (row_of or {}).get(sample["sample_id"])
        if row is None or not np.array_equal(prepared.input_ids(row), sample["input_ids"].numpy()) \
                or not np.array_equal(prepared.loss_mask(row), sample["loss_mask"].numpy()):
            problems.append(f"sample {sample['sample_id']}: input_ids/loss_mask differ from the prepared data")
    return rows, problems


def prepared_rows(manifest: dict):
    """(prepared data, {sample_id: row}) the store was made from, when still there and unchanged."""
    from eyas.data.prepared import load_prepared_arrays

    info = manifest.get("prepared") or {}
    if not info.get("path") or not (Path(info["path"]) / "dataset").is_dir():
        return None, {}
    prepared = load_prepared_arrays(info["path"])
    if prepared.fingerprint != info.get("fingerprint"):
        return None, {}
    return prepared, {sid: r for r, sid in enumerate(prepared.sample_ids)}


def check_store(store: str | Path) -> dict:
    """The file-level checks; -> {"problems": [...], "layers": [], "num_shards", "num_samples", ...}: no
    problems = the files are what the manifest says (recomputing samples is eyas.stages.verify's)."""
    store = Path(store)
    manifest = read_manifest(store)
    shards = committed_shards(store, manifest)
    return {"problems": check_files(store, manifest), "layers": [], "num_shards": len(shards),
            "nonfinite_ids": nonfinite_ids(shards), "num_samples": manifest["num_samples"],
            "num_tokens": manifest["num_tokens"], "complete": bool(manifest.get("complete")),
            "dtype": manifest["dtype"], "manifest": manifest}
