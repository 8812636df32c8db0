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


def test_bad_aux_layers_on_a_command_line_are_one_line_errors(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "prompt": "hi", "response": "hello"}\n')
    assert main(["prepare", "--config", "tiny", "--data", str(data), "--out", str(tmp_path / "prep")]) == 0
    capsys.readouterr()
    # the tiny target has 4 layers: residual-stream ids are 1..3
    rc = main(["capture", "--config", "tiny", "--layers", "1,2,9", "--data", str(tmp_path / "prep"),
               "--out", str(tmp_path / "store")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("eyas capture: error: target.aux_layers=[1, 2, 9]") and "1..3" in err
    assert len(err.strip().splitlines()) == 1


def test_subcommand_help_describes_outputs():
    out = run("prepare", "--help")
    assert out.returncode == 0
    for name in ("dataset/", "vocab.safetensors", "prepare.json", "summary.json", "exit status"):
        assert name in out.stdout, name


def test_run_checks_the_benchmarks_before_the_first_stage(tmp_path):
    """A benchmark the eval stage could not read ends `eyas run` at once, before any stage has run (the
    H200 run once regenerated, captured and trained for 16 minutes, then failed at eval on a missing wheel)."""
    run_dir = tmp_path / "run"
    out = run("run", "--preset", "tiny", "--run-dir", str(run_dir), "--set", f"eval.benches={tmp_path / 'nope.jsonl'}")
    assert out.returncode != 0
    assert "nope.jsonl" in out.stderr + out.stdout and "is not mt-bench, mt-bench-1, humaneval or an existing JSONL file" in out.stderr + out.stdout
    assert not (run_dir / "prepared").exists() and not (run_dir / "stages.json").exists()


def test_run_checks_the_draft_of_a_local_target_before_the_first_stage(tmp_path):
    """A local target whose rope scaling the draft does not implement (YaRN: Kimi K2, DeepSeek V3) ends `eyas run`
    before regeneration and capture, naming train.rope=plain; with it, the check passes."""
    import json

    from eyas.commands.run import _check_draft_shape
    from eyas.common import EyasError
    from eyas.config import load_config

    target = tmp_path / "yarn-target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 320, "num_hidden_layers": 4,
        "max_position_embeddings": 131072, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}}))
    run_dir = tmp_path / "run"
    out = run("run", "--preset", "tiny", "--run-dir", str(run_dir), "--set", f"target.model={target}")
    assert out.returncode != 0
    assert "'yarn' is not one the draft implements" in out.stderr and "set train.rope=plain" in out.stderr
    assert not (run_dir / "prepared").exists() and not (run_dir / "stages.json").exists()
    _check_draft_shape(load_config("tiny", [f"target.model={target}", "train.rope=plain"]))
    with pytest.raises(EyasError, match="train.rope=plain"):
        _check_draft_shape(load_config("tiny", [f"target.model={target}"]))
