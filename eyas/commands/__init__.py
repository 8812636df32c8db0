"""eyas.commands: one module per subcommand (HELP, add_arguments, main), and the option types they share."""

from __future__ import annotations

import argparse
import math


def flag_overrides(args, section: str, *names: str) -> list[str]:
    """`--set`-style overrides `section.name=value` for each command-line flag `name` that was given
    (a flag's dest and its config key share the name)."""
    return [f"{section}.{name}={getattr(args, name)}" for name in names if getattr(args, name) is not None]


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds")
    return value


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 seconds")
    return value


def non_negative_seconds(text: str) -> float:
    value = _seconds(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0 seconds")
    return value
