"""`eyas` command line: a thin dispatcher to one module per subcommand (eyas/commands/*.py).

Each command module defines `HELP` (one line), `add_arguments(parser)` and `main(args) -> int`.
A module may also define `EPILOG`, shown after its options in `eyas NAME --help`. Modules are
imported only for the subcommand that runs, so `eyas --help` stays fast. A user error (EyasError
or ConfigError) prints one line and exits 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {name: f"eyas.commands.{name}" for name in
            ("run", "prepare", "capture", "train", "eval", "export", "verify", "gpus")}
SUMMARIES = {
    "run": "run the whole pipeline (prepare, regenerate, capture, train, eval, export) in a run directory",
    "prepare": "conversations -> token ids, assistant loss masks and the draft vocabulary",
    "capture": "capture the target's hidden states at the aux layers into a packed store",
    "train": "train the EAGLE-3 draft with training-time test",
    "eval": "speculative decoding with a draft: acceptance length and speedup",
    "export": "write the draft for SGLang, vLLM and speculators",
    "verify": "check a store's checksums and recompute samples with the target",
    "gpus": "list the processes holding memory on each GPU",
}


def _load(name: str):
    return importlib.import_module(COMMANDS[name])


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eyas",
        description="Train EAGLE-3 speculative-decoding drafts for a target LLM and export them for vLLM and SGLang.",
    )
    from eyas import __version__

    parser.add_argument("--version", action="version", version=f"eyas {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = _load(name) if name == only else None
        help_ = SUMMARIES[name]
        epilog = getattr(mod, "EPILOG", None)
        p = sub.add_parser(name, help=help_, description=help_, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if mod is not None:
            mod.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS:
        parser = build_parser()
        if command is None and not any(a in ("-h", "--help", "--version") for a in argv):
            parser.print_help()
            return 2
        parser.parse_args(argv)  # prints help/version or the "invalid choice" error and exits
        return 2
    mod = _load(command)
    args = build_parser(only=command).parse_args(argv)
    from eyas.common import EyasError
    from eyas.config import ConfigError

    try:
        return int(mod.main(args) or 0)
    except (EyasError, ConfigError) as e:
        print(f"eyas {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eyas {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
