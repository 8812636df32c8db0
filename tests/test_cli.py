import subprocess
import sys

import pytest

from eyas.cli import COMMANDS, main


def run(*args):
    return subprocess.run([sys.executable, "-m", "eyas", *args], capture_output=True, text=True, timeout=120)


def test_top_level_help_lists_every_subcommand():
    out = run("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_subcommand_has_help(name):
    out = run(name, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: eyas {name}")


def test_unknown_subcommand_fails():
    out = run("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_missing_stage_says_not_implemented(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "gpus", ("eyas.commands._does_not_exist", "issue 99 (Later)"))
    assert main(["gpus"]) == 3
    assert "not implemented yet; it arrives with issue 99 (Later)" in capsys.readouterr().err
