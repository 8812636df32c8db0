"""`eyas train`: train the EAGLE-3 draft with training-time test, from a store or online.

    eyas train --store STORE --out RUN_DIR [--steps N | --epochs N] [--ttt K] [--lr X] [--resume]
    eyas train --source online --target TARGET --data PREPARED_DIR --out RUN_DIR ...

The store source refuses a store whose manifest does not match the config (target, aux layer ids);
the online source runs the target in this process (eyas.target.capture.FeatureCapture) and writes
nothing but the run directory. Under torchrun the same command trains with DDP (or FSDP2 with
--set train.fsdp=true).
"""

from __future__ import annotations

import time
from pathlib import Path

from eyas.commands import flag_overrides

HELP = "train the EAGLE-3 draft with training-time test"


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="demo", help="preset name (tiny, demo, full) or YAML file (default: demo)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set train.features=last (repeatable)")
    parser.add_argument("--source", choices=["store", "online"], default="store",
                        help="read features from a store (default) or compute them with the target in this process")
    parser.add_argument("--store", metavar="STORE", help="store directory written by `eyas capture` (--source store)")
    parser.add_argument("--data", metavar="PREPARED_DIR", help="directory written by `eyas prepare` (--source online)")
    parser.add_argument("--target", help="target model for --source online: HF dir, hub id, .gguf, smollm2, tiny "
                                         "(default: from config); with --store it is checked against the manifest")
    parser.add_argument("--vocab", metavar="VOCAB", help="draft vocabulary (vocab.safetensors; default: the prepared "
                                                         "data's, found through the store's manifest)")
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory (checkpoints, metrics, curves)")
    parser.add_argument("--steps", type=int, help="optimizer steps (overrides --epochs)")
    parser.add_argument("--epochs", type=float, help="passes over the data (used when steps is 0)")
    parser.add_argument("--ttt", type=int, help="training-time-test length K (1 = no TTT)")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--init-from", metavar="DRAFT", help="fine-tune this draft (run dir, checkpoint or export) "
                        "on this data instead of training a new one; it keeps its vocabulary (train.init_from)")
    parser.add_argument("--resume", action="store_true", help="continue from RUN_DIR/latest if it exists")
    parser.add_argument("--tail", action="store_true", help="the store is still being captured: train on its shards "
                                                             "as they are committed (waits for the manifest and each shard)")
    parser.add_argument("--poll-s", type=float, default=2.0, help="with --tail: seconds between looks at the manifest")
    parser.add_argument("--tail-timeout-s", type=float, default=3600.0,
                        help="with --tail: give up when no new shard is committed for this long")
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N (default: auto; under torchrun the local rank)")


def config_from_args(args):
    from eyas.config import load_config

    sets = list(args.set)
    if args.target:
        sets.append(f"target.model={args.target}")
    sets += flag_overrides(args, "train", "steps", "epochs", "ttt", "lr", "init_from")
    if args.steps is None and args.epochs is not None:
        sets.append("train.steps=0")
    return load_config(args.config, sets)


def expected_target_name(spec: str) -> str:
    """The identity name `load_target(spec)` gives, without loading the model."""
    from eyas.target.load import SMOLLM2_NAME
    from eyas.target.tiny import TINY_KINDS

    if spec in TINY_KINDS:
        return spec
    if spec == "smollm2":
        return SMOLLM2_NAME
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        return path.stem
    return path.name if path.is_dir() else spec


def wait_for_manifest(store: Path, poll_s: float, timeout_s: float) -> None:
    """A capture about to start has not written its manifest yet; wait for it (the shards come later)."""
    from eyas.common import EyasError, print0

    start = time.time()
    if not (store / "manifest.json").is_file():
        print0(f"waiting for the capture into {store} to start ...")
    while not (store / "manifest.json").is_file():
        if time.time() - start > timeout_s:
            raise EyasError(f"{store} has no manifest.json after {timeout_s:.0f} s; start `eyas capture --out {store}`")
        time.sleep(poll_s)


def store_training_source(cfg, args):
    from eyas.common import EyasError
    from eyas.store.manifest import read_manifest
    from eyas.target.layers import resolve_aux_layers
    from eyas.train import store_source

    store = Path(args.store)
    if args.tail:
        wait_for_manifest(store, args.poll_s, args.tail_timeout_s)
    if not (store / "manifest.json").is_file():
        raise EyasError(f"{store} is not a store (no manifest.json); create it with `eyas capture --data PREPARED --out {store}`")
    manifest = read_manifest(store)
    found = (manifest.get("target") or {}).get("name")
    wanted = expected_target_name(cfg.target.model)
    if found != wanted:
        raise EyasError(f"refusing to train on store {store}: it holds features of target {found!r} but the config's "
                        f"target is {wanted!r}; pass --target (or --config) matching the store")
    expect = {"aux_layers": resolve_aux_layers(cfg.target.aux_layers, manifest["num_layers"])}
    if not manifest.get("complete") and not args.tail:
        raise EyasError(f"store {store} is not complete (capture still running or interrupted); rerun `eyas capture` "
                        f"to finish it, or pass --tail to train on its shards as they are committed")
    return store_source(store, expect=expect, vocab=args.vocab, tail=args.tail, poll_s=args.poll_s,
                        timeout_s=args.tail_timeout_s)


class PreparedSamples:
    """Map-style samples (input_ids, loss_mask) over a prepared directory; features come online."""

    def __init__(self, prepared):
        self.prepared = prepared

    def __len__(self) -> int:
        return len(self.prepared)

    def __getitem__(self, i: int) -> dict:
        import torch

        return {"input_ids": torch.from_numpy(self.prepared.input_ids(i).copy()),
                "loss_mask": torch.from_numpy(self.prepared.loss_mask(i).astype("int64"))}


def online_training_source(cfg, args):
    from eyas.common import EyasError, world_size
    from eyas.data.prepared import load_prepared_arrays
    from eyas.target import load_target
    from eyas.target.capture import FeatureCapture
    from eyas.train.source import TrainSource, load_vocab_file

    if not args.data:
        raise EyasError("--source online needs --data PREPARED_DIR (written by `eyas prepare`)")
    prepared = load_prepared_arrays(args.data)
    device = args.device or cfg.target.device
    if world_size() > 1 and device in ("auto", "cuda"):
        import os

        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if _cuda() else "cpu"
    target = load_target(cfg.target.model, device=device, dtype=cfg.target.dtype)
    features = FeatureCapture(target, cfg.target.aux_layers)
    vocab_path = Path(args.vocab) if args.vocab else Path(args.data) / "vocab.safetensors"
    d2t = t2d = None
    if vocab_path.is_file():
        d2t, t2d = load_vocab_file(vocab_path)
    return TrainSource(
        samples=PreparedSamples(prepared), lengths=[int(n) for n in prepared.lengths],
        embed_weight=target.embed_tokens.weight.detach(), lm_head_weight=target.lm_head.weight.detach(),
        target_config=target.config.to_dict(), target=target.identity, aux_layers=list(features.aux_layers),
        d2t=d2t, t2d=t2d, feature_fn=features, store=None, target_model=cfg.target.model,
    ), str(target.device)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(args) -> int:
    from eyas.common import EyasError
    from eyas.train import train

    cfg = config_from_args(args)
    if cfg.train.init_from and Path(cfg.train.init_from).expanduser().resolve().is_relative_to(
            Path(args.out).expanduser().resolve()):
        raise EyasError(f"--out {args.out} holds the draft to fine-tune ({cfg.train.init_from}): its checkpoints "
                        f"would replace it; write the fine-tuned draft to another --out")
    if cfg.train.init_from and args.vocab:
        raise EyasError(f"--vocab has no effect with train.init_from={cfg.train.init_from!r}: a fine-tuned draft keeps "
                        f"the vocabulary its head was trained on; drop --vocab")
    device = args.device or "auto"
    if args.source == "online":
        source, device = online_training_source(cfg, args)
    else:
        if not args.store:
            raise EyasError("--source store needs --store STORE (or use --source online --data PREPARED_DIR)")
        source = store_training_source(cfg, args)
    init = None
    if cfg.train.init_from:
        from eyas.export import load_draft

        init = load_draft(cfg.train.init_from, embed_tokens=source.embed_weight)
    train(cfg, args.out, source, resume=args.resume, device=device, init=init)
    return 0
