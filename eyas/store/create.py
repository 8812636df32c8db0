"""Creating, reopening and finishing a store on disk (the capture stage, eyas/stages/capture.py, fills it).

`target` here is anything with the loaded target's attributes (identity, config, num_layers, hidden_size,
vocab_size, dtype, embed_tokens, lm_head): the store package never imports the target's code.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

from eyas.common import EyasError, format_bytes
from eyas.ownership import claim
from eyas.store.batching import plan_fingerprint
from eyas.store.codec import parts
from eyas.store.manifest import HEAD_FILE, MANIFEST, RESUME_KEYS, SCHEMA_VERSION
from eyas.store.manifest import committed_shards, differing_keys, read_manifest, write_manifest
from eyas.store.shardfile import write_shard_file


def _scales_note(dtype: str) -> str | None:
    """The manifest's word on the fp8 parts' scales (None without fp8)."""
    names = [name for name, part in zip(("aux_scale [T, A]", "final_scale [T, 1]"), parts(dtype)) if part == "fp8"]
    return f"per token and layer: amax / 448, fp32 {', '.join(names)}" if names else None


def new_manifest(cfg, target, aux_layers: list[int], prepared, shards: list, dtype: str) -> dict:
    """The manifest of a new store of `target`'s states at `aux_layers` (HF ids) over `prepared`'s samples."""
    from eyas import __version__

    return {
        "schema_version": SCHEMA_VERSION,
        "target": target.identity,
        "target_model": cfg.target.model,
        "target_config": json.loads(target.config.to_json_string(use_diff=False)),
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "aux_layers": list(aux_layers),
        "final_hidden": "post_norm",
        "dtype": dtype,
        # the dtype the target computed in (the stored dtype may be lower): a resume in another one would mix
        # states of two precisions in one store
        "compute_dtype": str(target.dtype).removeprefix("torch."),
        "scales": _scales_note(dtype),
        "shard_tokens": cfg.capture.shard_tokens,
        "plan": {"num_shards": len(shards), "num_samples": len(prepared), "num_tokens": int(prepared.offsets[-1]),
                 "prepared_fingerprint": prepared.fingerprint, "fingerprint": plan_fingerprint(shards)},
        "prepared": {"path": prepared.path, "fingerprint": prepared.fingerprint},
        "target_head": None,
        "shards": [],
        "num_samples": 0,
        "num_tokens": 0,
        "num_bytes": 0,
        "complete": False,
        "eyas_version": __version__,
    }


def _check_writable(store: Path) -> None:
    try:
        store.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=store)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise EyasError(f"cannot write into {store} ({e.strerror or e}); make it writable or choose another --out"
                        + ("; the store already there stays valid" if (store / MANIFEST).is_file() else "")) from None


def open_store(store: Path, fresh: dict, target) -> dict:
    """Create a store or reopen one for resuming (rank 0 only). Returns the manifest to extend. A directory
    eyas did not make as a store is refused before anything in it is touched (eyas.ownership)."""
    claim(store, "capture")
    _check_writable(store)
    for leftover in store.glob(".*.tmp"):  # the store is eyas's: these are its own writes cut short
        leftover.unlink(missing_ok=True)
    if (store / MANIFEST).is_file():
        manifest = read_manifest(store)
        diffs = differing_keys(manifest, {k: fresh[k] for k in RESUME_KEYS})
        if diffs:
            was = f" (target.dtype: the store was computed in {manifest.get('compute_dtype')}, this run computes in " \
                  f"{fresh['compute_dtype']})" if "compute_dtype" in diffs else ""
            raise EyasError(f"{store} holds a capture made with other settings (differs in: {', '.join(diffs)}){was}; "
                            f"rerun with the original arguments to resume, or choose another --out")
        manifest["shards"] = committed_shards(store, manifest)
        write_manifest(store, manifest)
        for rank_file in store.glob("manifest.rank-*.json"):
            rank_file.unlink()
        return manifest
    # a head file alone is what a capture killed before its first manifest left: written again below
    foreign = [p.name for p in store.iterdir() if not p.name.startswith(".") and p.name != HEAD_FILE]
    if foreign:
        raise EyasError(f"{store} is not empty and holds no store ({', '.join(sorted(foreign)[:3])}, ...); "
                        f"choose an empty or new --out")
    head = {"embed_tokens.weight": target.embed_tokens.weight.detach().cpu().clone(),  # [V, H]
            "lm_head.weight": target.lm_head.weight.detach().cpu().clone()}  # [V, H]
    fresh["target_head"] = {"file": HEAD_FILE, "sha256": _write_head(store, head, target.identity)}
    write_manifest(store, fresh)
    return fresh


def _write_head(store: Path, head: dict, identity: dict) -> str:
    """target_head.safetensors, atomically: a failed write leaves no temporary file and no head. -> its sha256."""
    final, tmp = store / HEAD_FILE, store / f".{HEAD_FILE}.tmp"
    try:
        sha256 = write_shard_file(tmp, head, {"target": json.dumps(identity)})
        os.replace(tmp, final)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            need = sum(t.numel() * t.element_size() for t in head.values())
            raise EyasError(f"disk full while writing {final} (it needs about {format_bytes(need)}): free space "
                            f"on that device or choose another --out, then rerun the same command") from None
        if isinstance(e, OSError):
            raise EyasError(f"writing {final} failed ({e.strerror or e}); make the directory writable or choose "
                            f"another --out, then rerun the same command") from None
        raise
    return sha256


def finish_store(store: Path) -> dict:
    """Fold the ranks' records into manifest.json and mark it complete when every planned shard is there."""
    manifest = read_manifest(store)
    manifest["shards"] = committed_shards(store, manifest)
    manifest["complete"] = len(manifest["shards"]) == manifest["plan"]["num_shards"]
    write_manifest(store, manifest)
    for rank_file in store.glob("manifest.rank-*.json"):
        rank_file.unlink()
    return manifest
