"""Bad inputs on the command line: each is one line `eyas CMD: error: ...` naming the input and the fix, exit
status 2, no traceback, and nothing it was given is changed.

One row of CASES per input. A row's argv and `absent` paths are templates over the shared files of the
`world` fixture ({bin}, {draft}, {prepared}, ...) and {out}, a fresh directory of the test. To add a case,
add a row (and, if it needs one, a file to `world`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from eyas.cli import describe, main


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]  # templates: "{bin}", "{out}/run", ...
    expect: tuple[str, ...]  # each a substring of the error line
    absent: tuple[str, ...] = ()  # paths (templates) that must not exist afterwards
    patch: Callable | None = None  # patch(monkeypatch): set up the machine the case needs (in this process)
    check: Callable | None = None  # check(output): what else must hold afterwards (output: stdout + stderr)
    # run as `python -m eyas` with standard input closed, for what only a real process shows (a prompt)
    process: bool = False


def _no_gpu(monkeypatch):
    from eyas.gpu import nvml

    monkeypatch.setattr(nvml, "available", lambda: False)
    monkeypatch.setattr(nvml, "why_unavailable", lambda: "no NVIDIA driver or GPU found")


def _never_prompted(output: str):
    assert "[y/N]" not in output and "Do you wish" not in output, output


TRAIN = ("train", "--config", "tiny", "--steps", "1")
EVAL = ("eval", "--config", "tiny", "--bench", "{prompts}", "--steps", "1", "--limit", "1", "--no-hf-baseline",
        "--out", "{out}/eval/r.json")
RUN = ("run", "--preset", "tiny", "--run-dir", "{out}/run")
STORE_RUN = ("--store", "{out}/store", "--out", "{out}/run")

CASES = [
    # configs
    Case("binary file as --config", ("train", "--config", "{bin}", *STORE_RUN),
         ("not a YAML text file", "give a YAML config or a preset name"), absent=("{out}/run",)),
    Case("train.lr=nan", (*TRAIN, "--set", "train.lr=nan", *STORE_RUN), ("train.lr='nan'", "finite number")),
    Case("train.lr=1e999 (infinity)", (*TRAIN, "--set", "train.lr=1e999", *STORE_RUN),
         ("train.lr='1e999'", "finite number")),
    Case("train.lr=5", (*TRAIN, "--lr", "5", *STORE_RUN), ("train.lr=5.0", "(0, 1]")),
    Case("train.lr=fast", (*TRAIN, "--set", "train.lr=fast", *STORE_RUN), ("train.lr", "expected a number")),
    Case("train.ttt=100000", (*TRAIN, "--ttt", "100000", *STORE_RUN), ("train.ttt=100000", "[1, 64]", "memory")),
    Case("train.ttt over data.max_length", (*TRAIN, "--ttt", "20", "--set", "data.max_length=16", *STORE_RUN),
         ("train.ttt=20", "data.max_length=16")),
    Case("train.max_bad_steps=0", (*TRAIN, "--set", "train.max_bad_steps=0", *STORE_RUN),
         ("train.max_bad_steps=0", ">= 1")),
    Case("train.save_every_minutes=-1", (*TRAIN, "--set", "train.save_every_minutes=-1", *STORE_RUN),
         ("train.save_every_minutes=-1.0", ">= 0")),
    Case("data.max_record_mb=0", (*TRAIN, "--set", "data.max_record_mb=0", *STORE_RUN),
         ("data.max_record_mb=0.0", "> 0")),
    Case("target.trust_remote_code=maybe", (*TRAIN, "--set", "target.trust_remote_code=maybe", *STORE_RUN),
         ("target.trust_remote_code", "true or false")),
    Case("target.engine not a mapping", (*TRAIN, "--set", "target.engine=[1, 2]", *STORE_RUN),
         ("target.engine", "mapping")),
    Case("target.engine holds NaN", (*TRAIN, "--set", "target.engine={{x: .nan}}", *STORE_RUN),
         ("target.engine", "JSON values")),
    Case("data.self_prompts without regeneration", ("prepare", "--config", "tiny", "--data", "{prompts}",
                                                     "--self-prompts", "4", "--out", "{out}/prep"),
         ("data.self_prompts=4", "data.regenerate"), absent=("{out}/prep",)),
    # options of the commands
    Case("run --stage-timeout -1", (*RUN, "--stage-timeout", "-1"), ("--stage-timeout", "-1", ">= 0"),
         absent=("{out}/run",)),
    Case("run --grace -1", (*RUN, "--grace", "-1"), ("--grace", "-1", ">= 0"), absent=("{out}/run",)),
    Case("run --wait-for-gpus nan", (*RUN, "--wait-for-gpus", "nan"), ("--wait-for-gpus", "finite"),
         absent=("{out}/run",)),
    Case("run --gpus 5 without a GPU", (*RUN, "--gpus", "5"), ("--gpus 5", "no GPU is visible", "drop --gpus"),
         absent=("{out}/run",), patch=_no_gpu),
    Case("verify --samples -1", ("verify", "{out}/store", "--samples", "-1"), ("--samples", "-1", ">= 0")),
    Case("eval --steps 0", (*EVAL, "--draft", "{draft}", "--steps", "0"), ("--steps", ">= 1"),
         absent=("{out}/eval",)),
    Case("train --source online with --store", (*TRAIN, "--source", "online", "--data", "{prepared}",
                                                 *STORE_RUN), ("--store has no effect with --source online",),
         absent=("{out}/run",)),
    Case("train --store with --data", (*TRAIN, "--data", "{prepared}", *STORE_RUN),
         ("--data has no effect with --source store",), absent=("{out}/run",)),
    Case("train --poll-s 0", (*TRAIN, "--tail", "--poll-s", "0", *STORE_RUN), ("--poll-s", "> 0")),
    # files
    Case("binary file as --bench", (*EVAL, "--draft", "{draft}", "--bench", "{bin}"),
         ("--bench", "not UTF-8 text", "JSONL"), absent=("{out}/eval",)),
    Case("empty file as --bench", (*EVAL, "--draft", "{draft}", "--bench", "{empty}"),
         ("--bench", "no prompts"), absent=("{out}/eval",)),
    Case("truncated draft weights (export)", ("export", "{truncated}", "--config", "tiny", "--to", "vllm",
                                              "--out", "{out}/export"),
         ("model.safetensors", "truncated or corrupt")),
    Case("truncated draft weights (eval)", (*EVAL, "--draft", "{truncated}"),
         ("model.safetensors", "truncated or corrupt")),
    Case("draft with an infinite weight (export)", ("export", "{nonfinite}", "--config", "tiny", "--to", "vllm",
                                                    "--out", "{out}/export"),
         ("model.safetensors", "tensor fc.weight", "NaN or infinite")),
    Case("draft with an infinite weight (eval)", (*EVAL, "--draft", "{nonfinite}"),
         ("model.safetensors", "tensor fc.weight", "NaN or infinite")),
    Case("draft of another target (eval --draft)", (*EVAL, "--draft", "{draft}", "--target", "{wide}"),
         ("trained for another target", "made for 'tiny'")),
    Case("draft of another target (train --init-from)", (*TRAIN, "--source", "online", "--target", "{wide}",
                                                          "--data", "{prepared}", "--init-from", "{draft}",
                                                          "--out", "{out}/run"),
         ("trained for another target", "made for 'tiny'")),
    Case("empty Parquet file as data", ("prepare", "--config", "tiny", "--data", "{empty_parquet}",
                                        "--out", "{out}/prep"), ("no usable conversation", "unreadable_file")),
    Case("empty Arrow file in prepared data", ("capture", "--config", "tiny", "--data", "{empty_arrow}",
                                               "--out", "{out}/store"), ("could not be read", "ArrowInvalid")),
    Case("a regular file as --out", ("export", "{draft}", "--config", "tiny", "--to", "vllm", "--out", "{afile}"),
         ("{afile}",)),
    Case("a regular file as --run-dir", ("run", "--preset", "tiny", "--run-dir", "{afile}"), ("{afile}",)),
    Case("a regular file in the way of eval --out", (*EVAL, "--draft", "{draft}", "--out", "{afile}/r.json"),
         ("{afile}",)),
    Case("an empty --run-dir", ("run", "--preset", "tiny", "--run-dir", ""), ("empty path", "current directory")),
    Case("an empty prepare --out", ("prepare", "--config", "tiny", "--data", "{prompts}", "--out", ""),
         ("empty path", "current directory")),
    Case("target that needs remote code", ("prepare", "--config", "tiny", "--target", "{remote}", "--data",
                                           "{prompts}", "--out", "{out}/prep"),
         ("ships Python code of its own", "--set target.trust_remote_code=true"), absent=("{remote}/RAN",),
         check=_never_prompted, process=True),
]


def _digest_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _log_to_this_stderr(monkeypatch):
    """The libraries' log handlers (transformers, huggingface_hub, torch) keep the stderr of the test that first
    imported them, closed by now: point them at this test's, so that a warning is captured here instead of being
    reported as a logging error with a traceback."""
    import logging
    import sys

    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler:  # pytest's own capturing handlers are subclasses
                monkeypatch.setattr(handler, "stream", sys.stderr)


def _run(case: Case, argv: list[str], tmp: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the command, in this process or as one."""
    if case.process:
        env = {**os.environ, "EYAS_DEBUG": "0", "TMPDIR": str(tmp)}
        done = subprocess.run([sys.executable, "-m", "eyas", *argv], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, env=env, timeout=300)
        return done.returncode, done.stdout, done.stderr
    monkeypatch.setenv("EYAS_DEBUG", "0")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where a traceback would be written
    if case.patch:
        case.patch(monkeypatch)
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_bad_input_is_a_one_line_error(case, world, tmp_path, monkeypatch, capsys):
    _log_to_this_stderr(monkeypatch)
    (tmp_path / "tmp").mkdir()
    paths = {**world, "out": str(tmp_path / "out")}
    before = _digest_tree(Path(world["root"]))
    rc, out, err = _run(case, [a.format(**paths) for a in case.argv], tmp_path / "tmp", monkeypatch, capsys)
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert last.startswith(f"eyas {case.argv[0]}: error: "), err
    for words in case.expect:
        assert words.format(**paths) in last, last
    assert _digest_tree(Path(world["root"])) == before, "an input was changed"
    for p in case.absent:
        assert not Path(p.format(**paths)).exists(), p
    if case.check:
        case.check(out + err)


# ---------------------------------------------------------------- the shared files


def _random_draft(root: Path, name: str) -> Path:
    """A checkpoint of a random draft for the tiny target, as training writes it (RUN/step-N + latest)."""
    import torch
    from safetensors.torch import save_file

    from eyas.draft import DraftConfig, Eagle3Draft
    from eyas.target import load_target

    target = load_target("tiny", device="cpu", dtype="fp32")
    cfg = DraftConfig.from_target_config(target.config.to_dict(), draft_vocab_size=target.vocab_size)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    step = root / name / "step-0000001"
    step.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"},
              str(step / "model.safetensors"))
    doc = {"draft_config": cfg.to_dict(), "aux_layers": [1, 2, 3], "features": "fused",
           "target": dict(target.identity), "target_model": "tiny", "store": None, "ttt": 1}
    (step / "draft.json").write_text(json.dumps(doc))
    os.symlink(step.name, root / name / "latest")
    return root / name


def _wide_target(root: Path) -> Path:
    """A model directory like the tiny target's but with hidden size 32: a target the tiny drafts do not fit."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.target.tiny import make_tiny_tokenizer

    d = root / "wide"
    cfg = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      eos_token_id=258, pad_token_id=256)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    make_tiny_tokenizer().save_pretrained(d)
    return d


def remote_code_target(root: Path, source: Path) -> Path:
    """A copy of the model directory `source` whose config.json sends transformers to a module shipped beside
    it (auto_map); importing the module writes DIR/RAN."""
    d = root / "remote"
    shutil.copytree(source, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="eyas-test-remote",
               auto_map={"AutoConfig": "remote_model.RemoteConfig", "AutoModelForCausalLM": "remote_model.RemoteLM"})
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "remote_model.py").write_text(
        "from pathlib import Path\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        f"Path({str(d / 'RAN')!r}).write_text('remote code ran')\n\n\n"
        "class RemoteConfig(LlamaConfig):\n    model_type = 'eyas-test-remote'\n\n\n"
        "class RemoteLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n")
    return d


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every file the cases read: none of them may change."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad_inputs")
    (root / "bin").write_bytes(bytes(range(255, -1, -1)) * 8)  # not UTF-8 from its first byte
    (root / "empty.jsonl").write_bytes(b"")
    (root / "empty.parquet").write_bytes(b"")
    (root / "afile").write_text("a user's file\n")
    (root / "prompts.jsonl").write_text('{"id": "a", "prompt": "hello there", "response": "hi, how are you?"}\n'
                                        '{"id": "b", "prompt": "what is 2+2?", "response": "4"}\n')
    draft = _random_draft(root, "draft")
    truncated = root / "truncated"
    shutil.copytree(draft, truncated, symlinks=True)
    weights = truncated / "latest" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    nonfinite = root / "nonfinite"
    shutil.copytree(draft, nonfinite, symlinks=True)
    state = load_file(nonfinite / "latest" / "model.safetensors")
    state["fc.weight"][0, 0] = float("inf")
    save_file(state, str(nonfinite / "latest" / "model.safetensors"))
    wide = _wide_target(root)
    remote = remote_code_target(root, wide)
    assert main(["prepare", "--config", "tiny", "--data", str(root / "prompts.jsonl"),
                 "--out", str(root / "prepared")]) == 0
    empty_arrow = root / "empty-arrow"
    shutil.copytree(root / "prepared", empty_arrow)
    for arrow in (empty_arrow / "dataset").glob("*.arrow"):
        arrow.write_bytes(b"")
    names = {"bin": "bin", "empty": "empty.jsonl", "empty_parquet": "empty.parquet", "afile": "afile",
             "prompts": "prompts.jsonl", "prepared": "prepared"}
    return {"root": str(root), **{k: str(root / v) for k, v in names.items()}, "draft": str(draft),
            "truncated": str(truncated), "nonfinite": str(nonfinite), "wide": str(wide), "remote": str(remote),
            "empty_arrow": str(empty_arrow)}


# ---------------------------------------------------------------- what the CLI makes of an exception


def test_debug_shows_the_traceback(world, monkeypatch):
    from eyas.config import ConfigError

    monkeypatch.setenv("EYAS_DEBUG", "0")
    with pytest.raises(ConfigError, match="not a YAML text file"):
        main(["--debug", "train", "--config", world["bin"], "--store", "s", "--out", "o"])
    monkeypatch.setenv("EYAS_DEBUG", "1")
    with pytest.raises(ConfigError, match="not a YAML text file"):
        main(["train", "--config", world["bin"], "--store", "s", "--out", "o"])


@pytest.mark.parametrize("error, words", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/run/step-1/model.safetensors"),
     ["disk full while writing /data/run/step-1/model.safetensors", "free space or choose another --out"]),
    (OSError(errno.ENOSPC, "No space left on device"), ["disk full", "free space"]),
    (PermissionError(errno.EACCES, "Permission denied", "/data/run"), ["/data/run: permission denied"]),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/y"), ["/x/y: No such file or directory"]),
    (MemoryError(), ["out of host memory", "train.batch_tokens"]),
])
def test_failures_of_the_machine_name_the_file_and_the_fix(error, words):
    text = describe(error, "train")
    assert all(w in text for w in words), text
    assert "bug" not in text


def test_an_unexpected_exception_is_one_line_with_its_traceback_kept(tmp_path, monkeypatch, capsys):
    import eyas.commands.gpus as gpus

    def broken(args):
        return 1 // 0

    monkeypatch.setenv("EYAS_DEBUG", "0")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(gpus, "main", broken)
    assert main(["gpus"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "unexpected ZeroDivisionError" in err and "bug in eyas" in err and "--debug" in err
    saved = list(tmp_path.glob("eyas-gpus-*.traceback.txt"))
    assert len(saved) == 1 and str(saved[0]) in err
    assert "Traceback" in saved[0].read_text() and "1 // 0" in saved[0].read_text()
