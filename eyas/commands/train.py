"""`eyas train`: train the EAGLE-3 draft with training-time test (or a DFlash draft, train.method=dflash), from a
store or online.

    eyas train --store STORE --out RUN_DIR [--steps N | --epochs N] [--ttt K] [--lr X] [--resume]
    eyas train --source online --target TARGET --data PREPARED_DIR --out RUN_DIR ...

Training from a store trains on the layers it holds; a config naming another target or other aux layers is
refused. The online source runs the target in this process and writes nothing but the run directory. Under
torchrun the same command trains with DDP (or FSDP2 with --set train.fsdp=true). The work is
eyas.stages.train.
"""

from __future__ import annotations

from eyas.commands import flag_overrides, positive_seconds


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
    parser.add_argument("--poll-s", type=positive_seconds, default=2.0, help="with --tail: seconds between looks at the manifest")
    parser.add_argument("--tail-timeout-s", type=positive_seconds, default=3600.0,
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


def main(args) -> int:
    from eyas.common import EyasError
    from eyas.stages import train

    cfg = config_from_args(args)
    if args.source == "online":
        if not args.data:
            raise EyasError("--source online needs --data PREPARED_DIR (written by `eyas prepare`)")
        if args.store or args.tail:
            option = "--store" if args.store else "--tail"
            raise EyasError(f"{option} has no effect with --source online (the target computes the features from "
                            f"--data); drop one of them")
        inputs = train.Inputs(prepared=args.data, vocab=args.vocab)
    else:
        if not args.store:
            raise EyasError("--source store needs --store STORE (or use --source online --data PREPARED_DIR)")
        if args.data:
            raise EyasError("--data has no effect with --source store (the store's manifest names its prepared "
                            "data); drop --data, or train from it with --source online")
        inputs = train.Inputs(store=args.store, vocab=args.vocab, tail=args.tail, poll_s=args.poll_s,
                              tail_timeout_s=args.tail_timeout_s)
    train.run(cfg, inputs, args.out, resume=args.resume, device=args.device)
    return 0
