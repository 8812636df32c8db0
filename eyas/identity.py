"""Which target a file was made for, and one rule for deciding whether it is the target at hand.

A target's identity is a dict `{name, config_hash, tokenizer_hash}`: `eyas.target.load_target` computes it
when it loads a model, and every file made from a target records it (prepare.json, a store's
manifest.json, a draft's draft.json or eyas.json). Stages compare identities with `check_target` only.

The rule: the hashes decide wherever both sides know them (a model directory and the same model from the
hub have different names but the same config and tokenizer); the name decides only when no hash is known
on both sides (a config names its target before anything is loaded). A side that records nothing (a draft
from another trainer) matches anything: there is nothing to compare.
"""

from __future__ import annotations

from pathlib import Path

from eyas.common import EyasError
from eyas.config import TINY_TARGETS

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
HASHES = ("config_hash", "tokenizer_hash")


def target_name(model: str) -> str:
    """The identity name of `target.model` (a built-in name, a .gguf file, a model directory or a hub id),
    the one `load_target(model)` gives, without loading anything."""
    if model in TINY_TARGETS:
        return model
    if model == "smollm2":
        return SMOLLM2_NAME
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        return path.stem
    return path.name if path.is_dir() else model


def differences(recorded: dict | None, current: dict | None) -> list[str]:
    """The identity keys on which `recorded` and `current` disagree, by the module's rule."""
    recorded, current = recorded or {}, current or {}
    shared = [k for k in HASHES if recorded.get(k) and current.get(k)]
    keys = shared or (["name"] if recorded.get("name") and current.get("name") else [])
    return [k for k in keys if recorded[k] != current[k]]


def check_target(recorded: dict | None, current: dict, *, what: str, fix: str) -> None:
    """Refuse (EyasError) when `what`, made for the target `recorded`, is used with the target `current`."""
    diffs = differences(recorded, current)
    if diffs:
        made_for = f"target {recorded['name']!r}" if recorded.get("name") else "another target"
        detail = ", ".join(f"{k} {recorded[k]} there, {current[k]} here" for k in diffs)
        raise EyasError(f"{what} was made for {made_for}, not {current.get('name')!r} ({detail}); {fix}")
