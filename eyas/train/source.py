"""Where training batches come from: a hidden-state store, or any sample set plus a feature function.

`TrainSource` is everything the trainer needs besides the config: the batcher (samples -> batches),
the target's frozen embedding and lm_head, the target's HF config (for the draft's shape), its
identity, the aux layer ids (HF convention) and the draft vocabulary. Building one for the online
source (which runs the target) happens in eyas/commands/train.py, because eyas.train never imports
eyas.target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from eyas.common import EyasError, warn
from eyas.train.data import Batcher


@dataclass
class TrainSource:
    samples: object  # map-style: len() and [i] -> sample dict
    lengths: list[int]
    embed_weight: torch.Tensor  # [V, H]
    lm_head_weight: torch.Tensor  # [V, H]
    target_config: dict  # the target's HF config as a dict
    target: dict | None  # identity: name, config_hash, tokenizer_hash
    aux_layers: list[int]  # HF convention
    d2t: torch.Tensor | None = None  # [Vd] offsets; None = full vocabulary
    t2d: torch.Tensor | None = None  # [V]
    feature_fn: Callable | None = None
    store: str | None = None
    target_spec: str | None = None
    extra: dict = field(default_factory=dict)

    def batcher(self, batch_tokens: int, seed: int, rank: int = 0, world_size: int = 1) -> Batcher:
        return Batcher(self.lengths, self.samples.__getitem__, batch_tokens, seed, rank, world_size, self.feature_fn)


def load_vocab_file(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    if "d2t" not in tensors or "t2d" not in tensors:
        raise EyasError(f"{path} holds no d2t/t2d tensors; point --vocab at a prepared vocab.safetensors")
    return tensors["d2t"].long(), tensors["t2d"].bool()


def find_vocab(manifest: dict, store: Path) -> Path | None:
    """The prepared data's vocab.safetensors recorded by the store, or one next to the store."""
    prepared = manifest.get("prepared") or {}
    candidates = []
    if isinstance(prepared, dict) and prepared.get("path"):
        candidates.append(Path(prepared["path"]) / "vocab.safetensors")
    candidates += [store / "vocab.safetensors", store.parent / "prepared" / "vocab.safetensors"]
    return next((c for c in candidates if c.is_file()), None)


def store_lengths(reader) -> list[int]:
    """Tokens per sample from the shards' offsets (no feature is read)."""
    if getattr(reader, "lengths", None) is not None:
        return [int(n) for n in reader.lengths]
    lengths: list[int] = []
    for pos in range(len(reader.shards)):
        offsets = reader._shard(pos).offsets  # [n+1]
        lengths += (offsets[1:] - offsets[:-1]).tolist()
    return lengths


def store_source(store: str | Path, expect: dict | None = None, vocab: str | Path | None = None) -> TrainSource:
    """A TrainSource over a store; `expect` (manifest keys) makes a mismatching store an error."""
    from safetensors.torch import load_file

    from eyas.store import StoreReader

    store = Path(store)
    reader = StoreReader(store, expect=expect)
    manifest = reader.manifest
    head_path = store / "target_head.safetensors"
    if not head_path.is_file():
        raise EyasError(f"{head_path} is missing; the store was not written by `eyas capture` (it needs the target's head)")
    head = load_file(str(head_path))
    embed, lm_head = head["embed_tokens.weight"], head["lm_head.weight"]
    if embed.shape != (manifest["vocab_size"], manifest["hidden_size"]) or lm_head.shape != embed.shape:
        raise EyasError(f"{head_path}: embed {tuple(embed.shape)} / lm_head {tuple(lm_head.shape)} do not match the "
                        f"manifest's vocab_size={manifest['vocab_size']}, hidden_size={manifest['hidden_size']}")
    vocab_path = Path(vocab) if vocab else find_vocab(manifest, store)
    d2t = t2d = None
    if vocab_path is not None:
        d2t, t2d = load_vocab_file(vocab_path)
        if len(t2d) != manifest["vocab_size"]:
            raise EyasError(f"{vocab_path}: t2d covers {len(t2d)} target ids but the store's target has "
                            f"vocab_size={manifest['vocab_size']}; use the vocabulary prepared for this target")
    else:
        warn(f"no draft vocabulary found for {store} (pass --vocab PREPARED/vocab.safetensors); "
             f"using the full target vocabulary ({manifest['vocab_size']})")
    lengths = store_lengths(reader)
    return TrainSource(
        samples=reader, lengths=lengths, embed_weight=embed, lm_head_weight=lm_head,
        target_config=manifest.get("target_config") or {}, target=manifest.get("target"),
        aux_layers=list(manifest["aux_layers"]), d2t=d2t, t2d=t2d, store=str(store),
        target_spec=(manifest.get("target") or {}).get("name"),
    )
