"""`eyas engine` (one vLLM engine serving a run) on the real SmolLM2 target: regeneration through it equals
transformers' greedy regeneration, capture through it equals transformers' states, a capture asking for other
layers is refused, and an engine killed mid-capture stops the capture with a clear message, the committed
shards intact, and the same command without the engine resumes to a complete, verified store."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import rel_err, require_vllm, reusing

from eyas.cli import main
from eyas.common import EyasError
from eyas.config import load_config
from eyas.stages import capture, prepare
from eyas.store import StoreReader

require_vllm()

ENGINE = {"max_model_len": 512, "enforce_eager": True}
SETS = ["target.model=smollm2", "target.dtype=fp32", "capture.dtype=fp32", "data.num_prompts=8",
        "data.regen_max_new_tokens=24", "data.max_length=384", f"target.engine={json.dumps(ENGINE)}"]


def _cfg(backend, *more):
    return load_config("tiny", [*SETS, f"target.backend={backend}", *more])


def _stop(proc):
    """End the engine this module started (its own session: the engine and its vLLM workers)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    sock = root / "e.sock"
    argv = [sys.executable, "-m", "eyas", "engine", "--config", "tiny", "--socket", str(sock)]
    for s in [*SETS, "target.backend=vllm"]:
        argv += ["--set", s]
    log = open(root / "engine.log", "wb")
    proc = subprocess.Popen(argv, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not sock.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert sock.exists(), f"the engine did not serve: {(root / 'engine.log').read_text()[-2000:]}"
    yield sock, proc, root
    _stop(proc)
    log.close()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from vllm_models import prepared_dir

    return prepared_dir(tmp_path_factory.mktemp("prepared"), num_samples=300)


def test_regeneration_through_the_engine_equals_transformers(served, tmp_path):
    sock, _, _ = served
    hf = prepare.run(_cfg("hf"), prepare.Inputs(), tmp_path / "hf")
    vllm = prepare.run(_cfg("vllm"), prepare.Inputs(), tmp_path / "vllm", engine_socket=str(sock))
    answers = {}
    for name in ("hf", "vllm"):
        (results,) = (tmp_path / name).glob("regen-*.jsonl")
        answers[name] = {r["id"]: (r["response"], r["num_tokens"], r["finish"])
                         for r in map(json.loads, results.read_text().splitlines())}
    assert len(answers["hf"]) == 8 and answers["vllm"] == answers["hf"]  # greedy fp32: token for token
    assert vllm["regeneration"]["settings"]["backend"] == "vllm" and vllm["num_kept"] == hf["num_kept"]
    assert vllm["regeneration"]["finish"] == hf["regeneration"]["finish"]
    # the same command again resumes: nothing left to generate
    again = prepare.run(_cfg("vllm"), prepare.Inputs(), tmp_path / "vllm", engine_socket=str(sock))
    assert again["regeneration"]["num_responses_this_run"] == 0


def test_capture_asking_for_other_layers_is_refused(served, synthetic, tmp_path):
    sock, _, _ = served
    with pytest.raises(EyasError, match=r"extracts layers \[2, 15, 27, 30\], this capture needs \[1, 2, 30\]"):
        capture.run(_cfg("vllm", "target.aux_layers=[1,2]"), capture.Inputs(synthetic), tmp_path / "s",
                    engine_socket=str(sock))


def test_engine_killed_mid_capture_then_resume(served, synthetic, smollm2, smollm2_features, tmp_path):
    """Last in the module: it ends the served engine."""
    sock, engine, root = served
    store = tmp_path / "store"
    more = ["capture.shard_tokens=400", "capture.token_budget=512"]
    argv = [sys.executable, "-m", "eyas", "capture", "--config", "tiny", "--data", str(synthetic), "--out", str(store),
            "--engine-socket", str(sock)]
    for s in [*SETS, "target.backend=vllm", *more]:
        argv += ["--set", s]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    while not list(store.glob("shard-*.safetensors")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(engine.pid, signal.SIGKILL)  # the engine this module started, and its workers
    engine.wait()
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 2, out
    assert "engine" in out and "ended during a extract request" in out and "rerun the command to resume" in out
    manifest = json.loads((store / "manifest.json").read_text())
    assert not manifest["complete"]
    committed = sorted(p.name for p in store.glob("shard-*.safetensors"))
    assert committed, "no shard was committed before the engine was killed"

    # the same capture without the served engine takes an engine of its own (the session's SmolLM2 engine, the
    # one this config would start: checked by `reusing`) and completes the store
    with reusing(smollm2_features) as calls:
        summary = capture.run(_cfg("vllm", *more), capture.Inputs(synthetic), store)
    assert calls == [store / ".vllm-states"]
    assert summary["complete"]
    reader = StoreReader(store)
    assert len(reader) == 300
    from eyas.target.capture import FeatureCapture

    features = FeatureCapture(smollm2, None)
    for i in (0, 150, 299):
        sample = reader[i]
        ids = sample["input_ids"][None]
        aux, final = features(ids, torch.ones_like(ids))
        assert rel_err(sample["aux_hidden"], aux[0]) < 3e-6 and rel_err(sample["final_hidden"], final[0]) < 3e-6
    assert main(["verify", str(store), "--samples", "3"]) == 0
