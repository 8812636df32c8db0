"""The run report reads what the stages wrote (one schema each, never failing on it); `eyas gpus` says when
there is no GPU."""

import json
import subprocess
import sys

import pytest

from eyas.config import load_config
from eyas.gpu import nvml
from eyas.pipeline import write_report


def test_report_from_stage_outputs(tmp_path):
    run = tmp_path
    summaries = {"prepared": {"wall_s": 1.0, "samples_per_s": 48.0}, "train": {"wall_s": 4.0, "tokens_per_s": 1200.0},
                 "store": {"tokens_per_s": 2400.0, "store_samples": 48, "store_tokens": 4800, "num_shards": 1,
                           "store_bytes": 3 * 2**20, "dtype": "fp32"}}
    for output, summary in summaries.items():
        (run / output).mkdir()
        (run / output / "summary.json").write_text(json.dumps(summary))
    (run / "train" / "metrics.jsonl").write_text('{"step": 6, "loss": 2.5}\n{"step": 12, "loss": 1.25}\n')
    (run / "eval").mkdir()
    (run / "eval" / "summary.json").write_text(json.dumps({"stage": "eval", "tokens_per_s": 30.0, "results": {}}))
    (run / "eval" / "mt-bench-chain-3.json").write_text(json.dumps(
        {"summary": {"tau_pooled": 1.75, "tau_per_request": 1.7, "accept_at_position": [0.5, 0.25, 0.1],
                     "speedup_vs_plain": 1.2, "repeat_token_share": 0.4, "tau_elsewhere": 1.5,
                     "ngram_tau": 1.25, "num_requests": 80}, "settings": {"limit": 0}}))
    (run / "eval" / "mt-bench-chain-3.png").write_bytes(b"png")
    (run / "eval" / "humaneval-chain-3.json").write_text(json.dumps({"summary": {"tau_pooled": 2.0}}))
    (run / "eval" / "broken-chain-3.json").write_text("{not json")
    for fmt, line in (("vllm", "vllm serve /models/t --speculative-config '{}'"), ("speculators", None)):
        (run / "export" / fmt).mkdir(parents=True)
        if line:
            (run / "export" / fmt / "README.md").write_text(f"# draft\n\n## Launch\n\n```bash\n{line}\n```\n")
    state = {"prepare": {"status": "done", "wall_s": 1.0}, "capture": {"status": "done", "wall_s": 2.0, "devices": [0]},
             "train": {"status": "done", "wall_s": 4.0}, "eval": {"status": "done", "wall_s": 8.0},
             "export": {"status": "failed"}}
    summary = write_report(run, load_config("tiny"), state)
    md = (run / "report.md").read_text()
    assert "| prepare | done | 1.0 s | 48 samples/s | cpu |" in md
    assert "| capture | done | 2.0 s | 2400 tok/s | 0 |" in md
    assert "| train | done | 4.0 s | 1200 tok/s | cpu |" in md and "| eval | done | 8.0 s | 30 tok/s | cpu |" in md
    assert "| export | failed |  |  | cpu |" in md
    assert "48 samples, 4800 tokens, 1 shards, 3.0 MiB on disk (fp32)." in md
    assert "Last logged step: step 12, loss 1.25" in md
    assert "| mt-bench-chain-3 | 80 | 1.750 | 1.700 | 40 % | 1.500 | 1.250 | 1.200 |" in md
    assert "| humaneval-chain-3 | ? | 2.000 | ? | ? | ? | ? | ? |" in md and "| broken-chain-3 | ? | ? |" in md
    assert "eval.limit" not in md  # every result covers its whole benchmark
    assert "![per-position acceptance](eval/mt-bench-chain-3.png)" in md and "acceptance.png" not in md
    assert "Serve with vLLM:\n\n```bash\nvllm serve /models/t --speculative-config '{}'\n```" in md
    assert "sglang" not in md  # neither exported nor given a line the export did not write
    assert f"- `{run / 'export' / 'speculators'}`" in md
    assert "vLLM: vllm serve /models/t --speculative-config '{}'" in summary
    assert any("tau 1.750" in line for line in summary)
    assert "Fine-tuned from" not in md
    # a result on a benchmark's first prompts says so, in the table and the summary, with the command for all
    (run / "eval" / "humaneval-chain-3.json").write_text(json.dumps(
        {"summary": {"tau_pooled": 2.0, "num_requests": 12}, "settings": {"limit": 12}}))
    summary = write_report(run, load_config("tiny"), state)
    md = (run / "report.md").read_text()
    assert "| humaneval-chain-3 | 12 (eval.limit) | 2.000 |" in md and "| mt-bench-chain-3 | 80 | 1.750 |" in md
    assert f"Every prompt: `eyas eval --config {run / 'config.yaml'} --draft {run / 'train'} --limit 0`" in md
    assert any(line.endswith("tau 2.000, speedup ? (the first 12 prompts)") for line in summary), summary
    assert any(line.endswith("tau 1.750, speedup 1.200") for line in summary), summary
    (run / "train" / "latest").mkdir()
    (run / "train" / "latest" / "draft.json").write_text(json.dumps({"init_from": "/drafts/code"}))
    write_report(run, load_config("tiny"), state)
    assert "Fine-tuned from `/drafts/code` (train.init_from)" in (run / "report.md").read_text()


def test_the_launch_line_is_the_one_the_export_wrote(tmp_path):
    """The report copies the launch line from the README that eyas export writes for each engine."""
    from eyas.formats import configs
    from eyas.pipeline.report import launch_line

    meta = {"target_model": "smollm2", "aux_layers": [1, 2, 3],
            "draft_config": {"draft_vocab_size": 8, "vocab_size": 16}}
    for fmt in ("sglang", "vllm"):
        (tmp_path / "README.md").write_text(configs.readme(fmt, "/exports/d", meta, [1, 2, 3], "bf16"))
        assert launch_line(tmp_path / "README.md") == configs.launch_command(fmt, configs.serving_target(meta),
                                                                             "/exports/d")


@pytest.mark.skipif(nvml.available(), reason="a GPU is present")
def test_gpus_says_when_there_is_no_driver():
    res = subprocess.run([sys.executable, "-m", "eyas", "gpus"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    assert "nothing to list" in res.stdout and ("NVIDIA driver" in res.stdout or "nvidia-ml-py" in res.stdout)


def test_multi_gpu_example_config_loads():
    from pathlib import Path

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "examples" / "llama3-8b-multi-gpu.yaml"))
    assert cfg.name == "llama3-8b" and cfg.capture.mode == "store" and cfg.target.dtype == "bf16"


def test_the_train_stage_fingerprints_the_draft_it_fine_tunes(tmp_path):
    """train.init_from is read from outside the run: new weights there make the train stage stale."""
    from eyas.pipeline import STAGES, fingerprint_parts

    train = next(s for s in STAGES if s.name == "train")
    assert list(fingerprint_parts(train, load_config("tiny"), tmp_path)) == ["config", "prepared", "store"]
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"a")
    cfg = load_config("tiny", [f"train.init_from={draft}"])
    before = fingerprint_parts(train, cfg, tmp_path)
    assert list(before) == ["config", "prepared", "store", str(draft)]
    (draft / "model.safetensors").write_bytes(b"bb")
    assert fingerprint_parts(train, cfg, tmp_path)[str(draft)] != before[str(draft)]


def test_an_online_train_does_not_fingerprint_the_store(tmp_path):
    """capture.mode=online trains from the prepared data: a store in the run dir is not its input, and the
    fingerprint is the one it had when no store was there (records of existing online runs still match)."""
    from eyas.pipeline import STAGES, fingerprint_parts

    train = next(s for s in STAGES if s.name == "train")
    online, stored = load_config("tiny", ["capture.mode=online"]), load_config("tiny")
    before = fingerprint_parts(train, online, tmp_path)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "manifest.json").write_text("{}")
    assert fingerprint_parts(train, online, tmp_path) == before
    assert fingerprint_parts(train, stored, tmp_path)["store"] != before["store"]


def test_bad_gpu_lists_are_clear_errors():
    from eyas.common import EyasError
    from eyas.gpu.devices import parse_gpus

    assert parse_gpus("0, 2,3") == [0, 2, 3] and parse_gpus("") == []
    with pytest.raises(EyasError, match=r"'x' is not a device index.*e\.g\. 0,1"):
        parse_gpus("0,x")
    with pytest.raises(EyasError, match="named twice"):
        parse_gpus("1,1")
    for argv in (["run", "--preset", "tiny", "--run-dir", "r", "--gpus", "0;1"], ["gpus", "--gpus", "a"]):
        res = subprocess.run([sys.executable, "-m", "eyas", *argv], capture_output=True, text=True, timeout=120)
        assert res.returncode != 0 and "Traceback" not in res.stderr and "is not a device index" in res.stderr


def test_cuda_visible_devices_by_uuid_map_to_nvml_indices(monkeypatch):
    """CUDA reads UUIDs (or unique prefixes of them) and stops at the first entry naming no device."""
    from eyas.common import EyasError
    from eyas.gpu import devices
    from eyas.gpu.nvml import Gpu

    gpus = [Gpu(0, "H200", 0, 1, "GPU-aaaa-1111"), Gpu(1, "H200", 0, 1, "GPU-bbbb-2222"),
            Gpu(2, "H200", 0, 1, "GPU-bbbb-3333")]
    monkeypatch.setattr(devices.nvml, "gpus", lambda: gpus)
    for visible, pool in (("GPU-bbbb-3333,GPU-aaaa", [2, 0]), ("2,0", [2, 0]), ("", []), ("1,GPU-bbbb,0", [1]),
                          ("GPU-cccc,0", []), ("-1", [])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert devices.default_pool() == pool, visible
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert devices.default_pool() == [0, 1, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0c3e")
    with pytest.raises(EyasError, match="MIG"):
        devices.default_pool()
