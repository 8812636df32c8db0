"""`eyas run --backend vllm` on the real SmolLM2 target: one engine load serves regeneration and capture, the
engine is ended before training, the report names the load and its time, no process of the run is left, and a
rerun skips every stage without starting the engine."""

import json
import subprocess
import sys

from conftest import require_vllm

from eyas.gpu import procs

require_vllm()

ENGINE = {"max_model_len": 512, "enforce_eager": True}
SETS = ["target.model=smollm2", "target.dtype=fp32", "data.num_prompts=6", "data.regen_max_new_tokens=16",
        "data.max_length=384", f"target.engine={json.dumps(ENGINE)}", "eval.tree=null", "eval.limit=1",
        "eval.max_new_tokens=8"]


def test_run_loads_the_target_once_for_prepare_and_capture(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "eyas", "run", "--preset", "tiny", "--backend", "vllm", "--run-dir", str(run)]
    for s in SETS:
        cmd += ["--set", s]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-3000:]
    doc = json.loads((run / "stages.json").read_text())
    assert {k: v["status"] for k, v in doc["stages"].items()} == {s: "done" for s in
                                                                  ("prepare", "capture", "train", "eval", "export")}
    (load,) = doc["engine_loads"]
    assert load["served"] == ["prepare", "capture"] and load["ready_s"] > 0 and load["engine_start_s"] > 0
    assert load["stopped_at"] < doc["stages"]["train"]["started_at"]  # its memory is free before training
    logs = run / "logs"
    assert "regenerating through the engine on" in (logs / "prepare.log").read_text()
    assert "capture: using the engine on" in (logs / "capture.log").read_text()
    assert "engine ready on" in (logs / "engine.log").read_text()
    assert json.loads((run / "store" / "manifest.json").read_text())["complete"]
    report = (run / "report.md").read_text()
    assert "## Target loads" in report and "| the run's vLLM engine | prepare, capture |" in report
    assert "target   loaded 1x into vLLM for capture, prepare" in first.stdout
    assert not (run / ".engine.sock").exists()
    for rec in json.loads((run / "processes.json").read_text())["stages"]:  # every process the run started is gone
        assert rec.get("ended"), rec
        assert not procs.members(rec["pid"], rec["start_ticks"], rec["token"]), rec

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("skipped") == 5 and "engine: loading" not in again.stdout
    assert len(json.loads((run / "stages.json").read_text())["engine_loads"]) == 1
