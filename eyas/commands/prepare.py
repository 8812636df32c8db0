"""`eyas prepare`: conversations -> token ids, assistant loss masks and the draft vocabulary.

    eyas prepare --target TARGET --data PATH_OR_NAME [--data ...] --out DIR [--format auto|sharegpt|openai|prompt-response]
                 [--max-length N] [--on-long drop|truncate] [--strict] [--regenerate local|URL] [--draft-vocab N]

Without --data it builds the built-in prompt corpus (data.num_prompts prompts made from text that
ships with CPython). Inputs: JSONL, JSON or Parquet files, `save_to_disk` directories or hub dataset
names (`org/name[:split]`), in ShareGPT, OpenAI-messages or {prompt, response} form. Records that
cannot be used are skipped with a reason, counted in DIR/prepare.json; --strict makes any skip an error.
"""

from __future__ import annotations

from pathlib import Path

HELP = "conversations -> token ids, assistant loss masks and the draft vocabulary"


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="demo", help="preset name (tiny, demo, full) or YAML file (default: demo)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set data.num_prompts=500 (repeatable)")
    parser.add_argument("--target", help="target: HF dir, hub id, .gguf, smollm2, tiny (default: from config)")
    parser.add_argument("--data", action="append", metavar="PATH_OR_NAME",
                        help="input file (.jsonl/.json/.parquet), saved dataset dir or hub name (repeatable); "
                             "none = the built-in prompt corpus")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--format", choices=["auto", "sharegpt", "openai", "prompt-response"],
                        help="record format (default: auto, detected per record)")
    parser.add_argument("--max-length", type=int, metavar="N", help="longest sample in tokens")
    parser.add_argument("--on-long", choices=["drop", "truncate"], help="what to do with longer samples (default: drop)")
    parser.add_argument("--strict", action="store_true", default=None, help="any skipped record is an error")
    parser.add_argument("--regenerate", metavar="local|URL",
                        help="rewrite the assistant responses with the target: 'local' (in this process), "
                             "an OpenAI-compatible server URL, or 'none' (default with --data: none; "
                             "without --data: the config's, 'local' in the presets)")
    parser.add_argument("--draft-vocab", type=int, metavar="N", help="draft vocabulary size (capped at the target's)")
    parser.add_argument("--num-prompts", type=int, metavar="N", help="size of the built-in corpus (without --data)")


def config_from_args(args):
    from eyas.config import load_config

    sets = list(args.set)
    if args.target:
        sets.append(f"target.spec={args.target}")
    flags = {"format": "format", "max_length": "max_length", "on_long": "on_long", "strict": "strict",
             "regenerate": "regenerate", "draft_vocab": "draft_vocab", "num_prompts": "num_prompts"}
    for attr, key in flags.items():
        if getattr(args, attr) is not None:
            sets.append(f"data.{key}={getattr(args, attr)}")
    if args.data and args.regenerate is None and not any(x.startswith("data.regenerate=") for x in args.set):
        # the presets regenerate their built-in prompts; a user's own conversations keep their
        # responses unless --regenerate asks otherwise
        sets.append("data.regenerate=none")
    cfg = load_config(args.config, sets)
    if args.data:
        # paths may contain commas, so they bypass the comma-separated --set syntax
        cfg.data.data = list(args.data)
    return cfg


def run_prepare(cfg, out_dir, target=None) -> dict:
    """The pipeline's entry point: load the target named by cfg.target if none is given, then prepare."""
    from eyas.data import prepare

    if target is None:
        from eyas.target import load_target

        target = load_target(cfg.target.spec, device=cfg.target.device, dtype=cfg.target.dtype)
    return prepare(cfg, out_dir, target)


def main(args) -> int:
    from eyas.common import EyasError, print0, save_config

    cfg = config_from_args(args)
    out = Path(args.out)
    try:
        summary = run_prepare(cfg, out)
        save_config(cfg, out / "config.yaml")
    except OSError as e:  # a full disk or a read-only directory is the user's to fix, not a traceback
        raise EyasError(f"{e.filename or out}: {e.strerror or e}") from None
    dropped = ", ".join(f"{r} {n}" for r, n in summary["dropped"].items()) or "none"
    regen = summary["regeneration"]
    regen_line = (f" Regenerated {regen['num_responses']} responses ({regen['num_tokens']} tokens, {regen['mode']})."
                  if regen else "")
    print0(f"Prepared {summary['num_kept']} of {summary['num_read']} conversations into {out}/dataset "
           f"({summary['num_tokens']} tokens, {summary['num_loss_tokens']} under the loss mask); skipped: {dropped}."
           f"{regen_line} Draft vocabulary {summary['vocab']['draft_vocab_size']} of {summary['vocab']['vocab_size']} "
           f"ids covers {100 * summary['vocab']['coverage']:.1f}% of assistant tokens. "
           f"Details in {out}/prepare.json ({summary['seconds']:.1f} s).")
    return 0
