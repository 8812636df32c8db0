"""The training stage: a draft trained with training-time test, from a store or online (eyas.train).

A store is the source of truth for what it holds: its target, its aux layers and the prepared data it was
captured from (whose draft vocabulary training uses unless `vocab` names another). A config that asks for
other aux layers or names another target is a conflict, refused with the fix. The online source runs the
target in this process (eyas.target.capture.FeatureCapture) on a prepared directory and writes nothing but
the run directory. Under torchrun the same call trains with DDP (or FSDP2 with train.fsdp=true).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from eyas.common import EyasError, print0, rank, world_size
from eyas.identity import check_target, target_name
from eyas.ownership import writing


@dataclass(frozen=True)
class Inputs:
    store: str | Path | None = None  # a store written by the capture stage; or
    prepared: str | Path | None = None  # a prepared directory, its features computed online by the target
    vocab: str | Path | None = None  # the draft vocabulary (default: the prepared data's)
    tail: bool = False  # the store is still being captured: train on its shards as they are committed
    poll_s: float = 2.0  # with tail: seconds between looks at the manifest
    tail_timeout_s: float = 3600.0  # with tail: give up when no shard is committed for this long

    def __post_init__(self):
        if (self.store is None) == (self.prepared is None):
            raise EyasError("training reads either a store (--store STORE) or a prepared directory with the target "
                            "online (--source online --data PREPARED_DIR), exactly one of them")


def run(cfg, inputs: Inputs, out: str | Path, *, resume: bool = False, device: str | None = None,
        target=None) -> dict:
    """Train into `out` (checkpoints, metrics, curves, summary.json); returns the summary. `device`: where the
    draft trains (default auto; online, the target's device, cfg.target.device). `target` (online only): an
    already loaded target, else cfg.target.model is loaded. Rank 0 holds `out`'s lock meanwhile
    (eyas.ownership): a second training into it stops at once."""
    from eyas.train import train

    _check_init_from(cfg, inputs, out)
    with writing(out, "train", lead=rank() == 0) as out:
        if inputs.store is not None:
            source, device = store_training_source(cfg, inputs), device or "auto"
        else:
            source, device = online_training_source(cfg, inputs, device or cfg.target.device, target)
        return train(cfg, out, source, resume=resume, device=device)


def _check_init_from(cfg, inputs: Inputs, out: str | Path) -> None:
    init = cfg.train.init_from
    if init and Path(init).expanduser().resolve().is_relative_to(Path(out).expanduser().resolve()):
        raise EyasError(f"--out {out} holds the draft to fine-tune ({init}): its checkpoints would replace it; "
                        f"write the fine-tuned draft to another --out")
    if init and inputs.vocab:
        raise EyasError(f"--vocab has no effect with train.init_from={init!r}: a fine-tuned draft keeps the "
                        f"vocabulary its head was trained on; drop --vocab")


def wait_for_manifest(store: Path, poll_s: float, timeout_s: float) -> None:
    """A capture about to start has not written its manifest yet; wait for it (the shards come later)."""
    start = time.time()
    if not (store / "manifest.json").is_file():
        print0(f"waiting for the capture into {store} to start ...")
    while not (store / "manifest.json").is_file():
        if time.time() - start > timeout_s:
            raise EyasError(f"{store} has no manifest.json after {timeout_s:.0f} s; start `eyas capture --out {store}`")
        time.sleep(poll_s)


def store_layers(cfg, manifest: dict, store: Path) -> list[int]:
    """The store's aux layers, which training adopts; a config asking for others is a conflict."""
    captured = list(manifest["aux_layers"])
    wanted = cfg.target.aux_layers
    if wanted is not None and list(wanted) != captured:
        raise EyasError(f"store {store} holds aux layers {captured} but the config asks for {list(wanted)} "
                        f"(target.aux_layers): drop that setting to train on the store's layers, or capture "
                        f"again with `eyas capture --layers {','.join(map(str, wanted))}`")
    return captured


def store_training_source(cfg, inputs: Inputs):
    from eyas.store.manifest import read_manifest
    from eyas.train import store_source

    store = Path(inputs.store)
    if inputs.tail:
        wait_for_manifest(store, inputs.poll_s, inputs.tail_timeout_s)
    if not (store / "manifest.json").is_file():
        raise EyasError(f"{store} is not a store (no manifest.json); create it with `eyas capture --data PREPARED "
                        f"--out {store}`")
    manifest = read_manifest(store)
    check_target(manifest.get("target"), {"name": target_name(cfg.target.model)}, what=f"store {store}",
                 fix="pass --target (or --config) naming the store's target")
    expect = {"aux_layers": store_layers(cfg, manifest, store)}
    if not manifest.get("complete") and not inputs.tail:
        raise EyasError(f"store {store} is not complete (capture still running or interrupted); rerun `eyas capture` "
                        f"to finish it, or pass --tail to train on its shards as they are committed")
    return store_source(store, expect=expect, vocab=inputs.vocab, tail=inputs.tail, poll_s=inputs.poll_s,
                        timeout_s=inputs.tail_timeout_s)


def online_training_source(cfg, inputs: Inputs, device: str, target=None):
    """(a TrainSource computing features with the target in this process, the device it runs on)."""
    import torch

    from eyas.data.prepared import PreparedSamples, load_prepared_arrays
    from eyas.target import load_target
    from eyas.target.capture import FeatureCapture
    from eyas.train.source import TrainSource, load_vocab_file

    prepared = load_prepared_arrays(inputs.prepared)
    if target is None:
        if world_size() > 1 and device in ("auto", "cuda"):
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
        target = load_target(cfg.target.model, device=device, dtype=cfg.target.dtype,
                             trust_remote_code=cfg.target.trust_remote_code)
    features = FeatureCapture(target, cfg.target.aux_layers)
    vocab_path = Path(inputs.vocab) if inputs.vocab else Path(inputs.prepared) / "vocab.safetensors"
    d2t = t2d = None
    if vocab_path.is_file():
        d2t, t2d = load_vocab_file(vocab_path)
    return TrainSource(
        samples=PreparedSamples(prepared), lengths=[int(n) for n in prepared.lengths],
        embed_weight=target.embed_tokens.weight.detach(), lm_head_weight=target.lm_head.weight.detach(),
        target_config=target.config.to_dict(), target=target.identity, aux_layers=list(features.aux_layers),
        d2t=d2t, t2d=t2d, feature_fn=features, store=None, target_model=cfg.target.model,
    ), str(target.device)
