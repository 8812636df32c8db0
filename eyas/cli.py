"""`eyas` command line: a thin dispatcher to one module per subcommand (eyas/commands/*.py).

Each command module defines `add_arguments(parser)` and `main(args) -> int`, and may define `EPILOG`, shown
after its options in `eyas NAME --help`; its one-line help is in SUMMARIES below, so that `eyas --help` lists
every command while importing none (modules are imported only for the subcommand that runs).

Every failure is one line on stderr, `eyas NAME: error: ...`, and exit status 2: a user error (EyasError,
ConfigError) as raised; a full disk, a path that cannot be written or read, and exhausted memory named with
their file and the fix. An exception eyas does not expect is a bug: one line names it and the file that holds
its traceback. `--debug` (or EYAS_DEBUG=1, which the stage commands of `eyas run` inherit) shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import tempfile
import time
import traceback

COMMANDS = {name: f"eyas.commands.{name}" for name in
            ("run", "prepare", "capture", "train", "eval", "export", "verify", "gpus", "engine")}
SUMMARIES = {
    "run": "run the whole pipeline (prepare, regenerate, capture, train, eval, export) in a run directory",
    "prepare": "conversations -> token ids, assistant loss masks and the draft vocabulary",
    "capture": "capture the target's hidden states at the aux layers into a packed store",
    "train": "train the draft: EAGLE-3 with training-time test, or DFlash (train.method=dflash)",
    "eval": "speculative decoding with a draft: acceptance length and speedup",
    "export": "write the draft for SGLang, vLLM and speculators",
    "verify": "check a store's checksums and recompute samples with the target",
    "gpus": "list the processes holding memory on each GPU",
    "engine": "serve the target in one vLLM engine that regeneration and capture share (eyas run starts it)",
}


DEBUG_HELP = "show the traceback of a failure instead of one line (also: EYAS_DEBUG=1)"


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: a bad option is one line that names it, the value and where the options are
    described (argparse would print the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def _load(name: str):
    return importlib.import_module(COMMANDS[name])


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eyas",
        description="Train EAGLE-3 (or DFlash) speculative-decoding drafts for a target LLM and export them for vLLM and "
                    "SGLang.",
    )
    from eyas import __version__

    parser.add_argument("--version", action="version", version=f"eyas {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    for name in COMMANDS:
        mod = _load(name) if name == only else None
        help_ = SUMMARIES[name]
        epilog = getattr(mod, "EPILOG", None)
        p = sub.add_parser(name, help=help_, description=help_, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if mod is not None:
            mod.add_arguments(p)
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
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
    try:
        args = build_parser(only=command).parse_args(argv)
    except SystemExit as e:  # --help, or a bad option (printed): a caller in this process gets the status
        return e.code if isinstance(e.code, int) else 2
    if getattr(args, "debug", False):
        os.environ["EYAS_DEBUG"] = "1"  # the stage commands `eyas run` starts inherit it
    try:
        return int(mod.main(args) or 0)
    except KeyboardInterrupt:
        print(f"eyas {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- every failure ends as one line, unless --debug asks otherwise
        if os.environ.get("EYAS_DEBUG", "") not in ("", "0"):
            raise
        print(f"eyas {command}: error: {describe(e, command).strip()}", file=sys.stderr)
        return 2


def describe(e: Exception, command: str) -> str:
    """What the user reads for an exception: its message for a user error, the file and the fix for a full
    disk, a path that cannot be used or exhausted memory; for anything else (a bug) its type, its first
    line and where its traceback was written."""
    from eyas.common import EyasError
    from eyas.config import ConfigError

    if isinstance(e, (EyasError, ConfigError)):
        return str(e)
    if isinstance(e, OSError):
        return _os_error(e)
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch's is a RuntimeError
        where = "GPU" if type(e).__name__ == "OutOfMemoryError" else "host"
        return (f"out of {where} memory ({_first_line(e)}); give the process more memory or make the work "
                f"smaller (train.batch_tokens, data.max_length, capture.token_budget, data.regen_batch_size)")
    if _damaged_file(e):
        return (f"a data file could not be read ({_first_line(e)}): it is empty, truncated or not in the format its "
                f"name says; make it again or copy it again (which file: {_traceback_note(e, command)})")
    return (f"unexpected {_first_line(e)}; this is a bug in eyas: please report it with its traceback "
            f"({_traceback_note(e, command)})")


def _damaged_file(e: Exception) -> bool:
    """An error of the Arrow or safetensors readers: a damaged file, far more often than a bug."""
    module = type(e).__module__ or ""
    return module.startswith(("pyarrow", "safetensors"))


def _os_error(e: OSError) -> str:
    """A failure of the file system (or another part of the machine) is the user's to fix: name it."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f"while writing {e.filename}" if e.filename is not None else f"({e.strerror})"
        return f"disk full {where}: free space or choose another --out"
    if e.filename is None:
        return f"{_first_line(e)} (an error of the operating system: check the disk, permissions or network)"
    name = e.filename
    if isinstance(e, PermissionError):
        return f"{name}: permission denied; choose a path this user may write and read"
    if isinstance(e, NotADirectoryError):
        return f"{name}: a path in it is a file where a directory is expected; choose another path"
    if isinstance(e, FileExistsError):
        return f"{name}: exists already and is in the way (a file where a directory is made?); choose another path"
    if isinstance(e, IsADirectoryError):
        return f"{name}: is a directory where a file is expected; choose another path"
    return f"{name}: {e.strerror or type(e).__name__}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _traceback_note(e: BaseException, command: str) -> str:
    """Where the traceback was written (the last lines of a long stage's log would otherwise be all that is
    left of it), or how to see it."""
    text = "".join(traceback.format_exception(e))
    try:
        fd, path = tempfile.mkstemp(prefix=f"eyas-{command}-{time.strftime('%Y%m%d-%H%M%S')}-",
                                    suffix=".traceback.txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError:
        return "rerun with --debug for the traceback"
    return f"traceback in {path}, or rerun with --debug"
