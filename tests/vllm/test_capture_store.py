"""`eyas capture` with target.backend=vllm writes the same store as transformers: same layout and checks,
`eyas verify` passes (it recomputes with transformers), a kill -9 mid-capture resumes (starting its own
engine) to a complete store, and a sample the engine would refuse stops the capture before anything is
written."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ENGINE, rel_err, require_vllm, reusing

from eyas.cli import main
from eyas.common import EyasError
from eyas.config import load_config
from eyas.stages import capture
from eyas.store import StoreReader

require_vllm()

SETS = ["target.device=cpu", "target.dtype=fp32", "capture.dtype=fp32", "capture.shard_tokens=400",
        "capture.token_budget=512", "target.aux_layers=[1,2]"]


def _sets(model, backend, engine=ENGINE):
    return [*SETS, f"target.model={model}", f"target.backend={backend}", f"target.engine={json.dumps(engine)}"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from vllm_models import prepared_dir

    return prepared_dir(tmp_path_factory.mktemp("prepared"), num_samples=300)


@pytest.fixture(scope="module")
def stores(tiny_llama_dir, prepared, tiny_llama_features, tmp_path_factory):
    """The same capture through transformers and through vLLM: the vLLM one in the session's tiny-Llama engine
    (the engine this config would start: checked by `reusing`); the resume below starts its own."""
    root = tmp_path_factory.mktemp("stores")
    capture.run(load_config("tiny", _sets(tiny_llama_dir, "hf")), capture.Inputs(prepared), root / "hf")
    with reusing(tiny_llama_features) as calls:
        capture.run(load_config("tiny", _sets(tiny_llama_dir, "vllm")), capture.Inputs(prepared), root / "vllm")
    assert calls == [root / "vllm" / ".vllm-states"]
    return root


def test_same_store_as_transformers_and_verify_passes(stores, tiny_llama_features, capsys):
    hf, vllm = StoreReader(stores / "hf"), StoreReader(stores / "vllm")
    assert len(hf) == len(vllm) == 300
    for i in range(0, 300, 37):
        a, b = hf[i], vllm[i]
        assert a["sample_id"] == b["sample_id"] and torch.equal(a["input_ids"], b["input_ids"])
        assert rel_err(b["aux_hidden"], a["aux_hidden"]) < 1e-5 and rel_err(b["final_hidden"], a["final_hidden"]) < 1e-5
    summary = json.loads((stores / "vllm" / "summary.json").read_text())
    assert summary["complete"] and summary["tokens_per_s"] > 0 and summary["nonfinite_samples"] == 0
    assert not any(tiny_llama_features.engine.states_dir.iterdir())  # every file the engine wrote read and deleted
    assert main(["verify", str(stores / "vllm"), "--samples", "4"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")


def test_kill_9_mid_capture_then_resume_completes(stores, tiny_llama_dir, prepared, tmp_path):
    store = tmp_path / "killed"
    argv = [sys.executable, "-m", "eyas", "capture", "--config", "tiny", "--data", str(prepared), "--out", str(store)]
    for s in _sets(tiny_llama_dir, "vllm"):
        argv += ["--set", s]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while not list(store.glob("shard-*.safetensors")) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the capture, its engine and the engine's workers: one group
        proc.wait()
    assert list(store.glob("shard-*.safetensors")), "the capture committed no shard before the deadline"
    assert not json.loads((store / "manifest.json").read_text())["complete"]
    killed = {p.name for p in (store / ".vllm-states").iterdir()}  # what the killed engine left unread
    capture.run(load_config("tiny", _sets(tiny_llama_dir, "vllm")), capture.Inputs(prepared), store)  # its own engine
    assert {p.name for p in (store / ".vllm-states").iterdir()} <= killed  # the resume's files all read and deleted
    resumed, whole = StoreReader(store), StoreReader(stores / "vllm")
    assert len(resumed) == len(whole)
    for i in range(0, len(whole), 29):
        torch.testing.assert_close(resumed[i]["aux_hidden"], whole[i]["aux_hidden"], rtol=1e-5, atol=1e-5)


def test_a_sample_the_engine_refuses_stops_before_writing(tiny_llama_dir, tiny_llama_features, tmp_path):
    """Samples as long as the engine's max_model_len (ENGINE's, 512) or longer, among shorter ones: the capture, in
    the session's tiny-Llama engine (the engine this config would start: checked by `reusing`), stops naming them."""
    import datasets
    from vllm_models import prepared_dir

    long = prepared_dir(tmp_path / "long", num_samples=40, max_len=700)
    lengths = [len(ids) for ids in datasets.load_from_disk(str(long / "dataset"))["input_ids"]]
    assert 0 < sum(n >= ENGINE["max_model_len"] for n in lengths) < len(lengths)
    cfg = load_config("tiny", _sets(tiny_llama_dir, "vllm"))
    with reusing(tiny_llama_features) as calls:
        with pytest.raises(EyasError, match=r"too long for the vLLM engine \(max_model_len 512.*s00\d\d"):
            capture.run(cfg, capture.Inputs(long), tmp_path / "refused")
    assert calls == [tmp_path / "refused" / ".vllm-states"]
    assert not list((tmp_path / "refused").glob("shard-*"))
