"""`eyas run --preset tiny` end to end with the real stage commands for both draft families, a rerun that skips
everything, and a rerun after a DFlash-only change.

One run covers both families: the EAGLE-3 stages are the same commands a single-family run calls (`eyas run`
with the default `train.method` runs in tests/vllm/test_run_engine.py), and each tiny run costs about a minute."""

import json
import re
import subprocess
import sys
import time

import pytest

STAGE_COMMANDS = ["prepare", "capture", "train", "eval", "export"]


@pytest.mark.slow
def test_both_draft_families_from_one_store_side_by_side(tmp_path):
    """train.method=[eagle3, dflash]: one store, each family trained, evaluated and exported; the same command again
    skips every stage at once; a change of the dflash section reruns the DFlash stages only."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "eyas", "run", "--preset", "tiny", "--run-dir", str(run), "--quiet",
           "--set", "train.method=[eagle3, dflash]", "--set", "dflash.block_size=4"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    stages = json.loads((run / "stages.json").read_text())["stages"]
    families = STAGE_COMMANDS + ["train-dflash", "eval-dflash", "export-dflash"]
    assert {k: v["status"] for k, v in stages.items()} == {s: "done" for s in families}
    assert json.loads((run / "train-dflash" / "latest" / "draft.json").read_text())["method"] == "dflash"
    assert (run / "eval-dflash" / "mt-bench-chain-3.json").exists()  # eval.steps [3] and the block's 3 guesses
    assert not list((run / "eval-dflash").glob("*tree*"))
    assert {p.name for p in (run / "export-dflash").iterdir() if not p.name.startswith(".")} == {"sglang", "vllm"}
    assert json.loads((run / "export-dflash" / "vllm" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    report = (run / "report.md").read_text()
    assert "| EAGLE-3 | mt-bench-chain-3 |" in report and "| DFlash | mt-bench-chain-3 |" in report
    # the preset's eval.limit (2 questions): each row says so, and the report gives each draft's whole-benchmark eval
    assert "| EAGLE-3 | mt-bench-chain-3 | 2 (eval.limit) |" in report
    assert (f"--draft {run / 'train'} --limit 0`; `eyas eval --config {run / 'config.yaml'} "
            f"--draft {run / 'train-dflash'} --limit 0`") in report
    assert "## Training (DFlash)" in report and "## Export (EAGLE-3)" in report
    assert (run / "store" / "manifest.json").exists()
    # the tiny preset's eval settings for EAGLE-3 (chain 3, tree 2,3,6), both from the one eval process of mt-bench
    assert {p.name for p in (run / "eval").glob("*.json")} >= {"mt-bench-chain-3.json", "mt-bench-tree-2x3x6.json",
                                                              "summary.json"}
    assert "vllm serve" in report and "sglang.launch_server" in report
    assert "vLLM:" in first.stdout and "SGLang:" in first.stdout

    t0 = time.monotonic()
    same = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert same.returncode == 0, same.stdout[-3000:] + same.stderr[-3000:]
    assert time.monotonic() - t0 < 15
    assert same.stdout.count("skipped") == len(families)

    again = subprocess.run(cmd + ["--set", "dflash.layers=2"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    skipped = set(re.findall(r"(\S+): skipped", again.stdout))
    assert skipped >= set(STAGE_COMMANDS)
    assert json.loads((run / "train-dflash" / "latest" / "draft.json").read_text())["draft_config"]["num_layers"] == 2
