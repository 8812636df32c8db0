"""`eyas verify`'s work: a store's files against its manifest, then samples recomputed with the target.

Recomputation runs each chosen sample alone (batch 1, no padding) through the same hooks as capture, in fp32,
and compares every stored layer (eyas.store.verify.judge_sample says how).
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.common import EyasError
from eyas.identity import differences
from eyas.store.reader import StoreReader
from eyas.store.verify import check_store, judge_sample, pick_samples, prepared_rows


def run(store: str | Path, *, target=None, target_model: str | None = None, device: str = "auto",
        num_samples: int = 4, seed: int = 0) -> dict:
    """The report of `eyas.store.verify.check_store`, with a row per recomputed (sample, layer) in "layers"
    and their problems added. The target: `target`, else `target_model`, else the one the manifest names."""
    store = Path(store)
    report = check_store(store)
    manifest = report.pop("manifest")
    if num_samples <= 0 or report["problems"]:
        return report
    if target is None:
        from eyas.target import load_target

        model = target_model or manifest.get("target_model")
        if not model:
            raise EyasError(f"{store} does not name its target; pass --target")
        target = load_target(model, device=device, dtype="fp32")  # the reference is always fp32
    rows, problems = recompute(store, manifest, target, num_samples, seed)
    report["layers"] = rows
    report["problems"] += problems
    return report


def recompute(store: Path, manifest: dict, target, num_samples: int, seed: int = 0) -> tuple[list[dict], list[str]]:
    """Rerun num_samples random samples through the target; one row per (sample, layer)."""
    from eyas.target.capture import FeatureCapture

    if differences(manifest["target"], target.identity):
        theirs = manifest["target"]
        return [], [f"target {target.name} (config {target.identity.get('config_hash')}) is not the store's "
                    f"target {theirs.get('name')} (config {theirs.get('config_hash')})"]
    reader = StoreReader(store)
    features = FeatureCapture(target, manifest["aux_layers"])
    prepared, row_of = prepared_rows(manifest)
    rows, problems = [], []
    for i in pick_samples(reader, num_samples, seed):
        sample = reader[i]
        ids = sample["input_ids"].to(target.device)[None]  # [1, T]
        aux, final = features(ids, torch.ones_like(ids))  # [1, T, A*H], [1, T, H]
        more_rows, more = judge_sample(i, sample, aux[0].float().cpu(), final[0].float().cpu(), manifest,
                                       prepared, row_of)
        rows += more_rows
        problems += more
    return rows, problems
