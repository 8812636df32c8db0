"""The store's manifest: what a store holds, which shards are committed, and refusal of a wrong store.

Layout of STORE/ (docs/FORMATS.md and docs/INTERNALS.md "Store"):
  manifest.json             the committed state; replaced atomically after each shard is renamed into place
  manifest.rank-NNNNN.json  shards committed by rank N of a torchrun capture, merged into manifest.json at the end
  shard-NNNNN.safetensors   packed samples: input_ids, loss_mask, aux_hidden, final_hidden, offsets, sample_index
                            (+ aux_scale, final_scale for fp8); metadata "eyas" is JSON with sample_ids, dtype, aux_layers
  target_head.safetensors   embed_tokens.weight and lm_head.weight of the target
  summary.json              the last capture run's figures: wall_s, samples, tokens, tokens_per_s, bytes, ...

A shard is committed when a manifest names it; files that no manifest names are leftovers of a killed
run and are rewritten on resume.
"""

from __future__ import annotations

import json
from pathlib import Path

from eyas.common import EyasError, atomic_write_json, read_json

SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
HEAD_FILE = "target_head.safetensors"
SUMMARY = "summary.json"  # the last capture run's figures (wall_s, tokens_per_s, bytes_per_token, ...)
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# keys that must agree between a store on disk and a capture that resumes into it
# (compute_dtype: the target's own dtype; a resume in another would mix states of two precisions in one store)
RESUME_KEYS = ("schema_version", "target", "aux_layers", "dtype", "compute_dtype", "shard_tokens", "prepared", "plan")


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def rank_manifest_file(rank: int) -> str:
    return f"manifest.rank-{rank:05d}.json"


def read_manifest(store: str | Path) -> dict:
    path = Path(store) / MANIFEST
    if not path.is_file():
        raise EyasError(f"{store} is not a hidden-state store (no {MANIFEST}); create one with `eyas capture`")
    try:
        manifest = read_json(path)
    except (OSError, ValueError) as e:
        raise EyasError(f"{path} cannot be read ({e}); the store is damaged, recapture it") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise EyasError(f"{path} has schema_version {manifest.get('schema_version')!r}; this eyas reads "
                        f"{SCHEMA_VERSION}; recapture the store with this version")
    return manifest


def rank_shards(store: str | Path) -> list[dict]:
    """Shards committed by ranks of a data-parallel capture and not yet merged."""
    records = []
    for path in sorted(Path(store).glob("manifest.rank-*.json")):
        try:
            records += read_json(path)["shards"]
        except (OSError, ValueError, KeyError):
            continue  # a rank file is replaced atomically, so this is a race with the final merge
    return records


def committed_shards(store: str | Path, manifest: dict) -> list[dict]:
    """All committed shard records (manifest + unmerged rank files), one per index, by index."""
    by_index = {rec["index"]: rec for rec in rank_shards(store)}
    by_index.update({rec["index"]: rec for rec in manifest["shards"]})
    return [by_index[i] for i in sorted(by_index)]


def nonfinite_ids(shards: list[dict]) -> list[str]:
    """Ids of the samples whose captured states hold NaN or inf, as capture named them in the shard records."""
    return [sid for rec in shards for sid in rec.get("nonfinite_ids", ())]


def write_manifest(store: str | Path, manifest: dict) -> None:
    """Recompute the totals and replace manifest.json atomically."""
    shards = sorted(manifest["shards"], key=lambda r: r["index"])
    manifest["shards"] = shards
    manifest["num_samples"] = sum(r["num_samples"] for r in shards)
    manifest["num_tokens"] = sum(r["num_tokens"] for r in shards)
    manifest["num_bytes"] = sum(r["bytes"] for r in shards)
    atomic_write_json(Path(store) / MANIFEST, manifest)


def differing_keys(manifest: dict, expect: dict) -> list[str]:
    return [k for k, v in expect.items() if _normal(manifest.get(k)) != _normal(v)]


def check_expect(manifest: dict, expect: dict | None, store: str | Path, action: str = "read") -> None:
    """Raise an EyasError naming each key whose value differs from what the caller expects."""
    if not expect:
        return
    diffs = differing_keys(manifest, expect)
    if diffs:
        parts = "; ".join(f"{k}: expected {_short(expect[k])}, found {_short(manifest.get(k))}" for k in diffs)
        raise EyasError(f"refusing to {action} store {store}: it was written with different settings ({parts})")


def _normal(value):
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."
