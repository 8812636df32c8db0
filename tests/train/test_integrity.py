"""Training integrity: nothing unpickled, checkpoints atomic on a failed write, store checksums enforced,
non-finite steps skipped and bounded, stop signals save, resume keeps the training's shape, memory
estimated before the first step."""

import ast
import errno
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.common import EyasError
from eyas.train import checkpoint as ckpt
from eyas.train import train
from synthetic_train import small_config, synthetic_source

ROOT = Path(__file__).resolve().parents[2]
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle"}
ERRORS_ONLY = {"UnpicklingError", "PickleError"}  # catching torch.load(weights_only=True)'s errors unpickles nothing


# ---- no pickles

def _keyword(call: ast.Call, name: str):
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def pickle_uses(text: str, name: str) -> list[str]:
    """Lines of a source file that import a pickler (for more than its exception classes), call torch.load
    without weights_only=True or np.load with allow_pickle."""
    tree = ast.parse(text, name)
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id in PICKLERS}
    found = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in PICKLERS for a in node.names):
            if not used <= ERRORS_ONLY:
                found.append(f"{where} imports a pickler")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLERS:
            if not {a.name for a in node.names} <= ERRORS_ONLY:
                found.append(f"{where} imports from a pickler")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            if owner == "torch":
                flag = _keyword(node, "weights_only")
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    found.append(f"{where} calls torch.load without weights_only=True")
            if owner in ("np", "numpy"):
                flag = _keyword(node, "allow_pickle")
                if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
                    found.append(f"{where} calls np.load with allow_pickle")
    return found


def test_no_source_file_unpickles():
    files = sorted(p for d in ("eyas", "bench") for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 20
    assert [line for p in files for line in pickle_uses(p.read_text(), str(p.relative_to(ROOT)))] == []


def test_the_source_walk_catches_each_kind():
    assert pickle_uses("import pickle\ntry:\n    pass\nexcept pickle.UnpicklingError:\n    pass\n", "ok.py") == []
    text = ("import pickle\nfrom dill import loads\nimport torch, numpy as np\ntorch.load('a')\npickle.loads(b'')\n"
            "torch.load('a', weights_only=False)\nnp.load('a', allow_pickle=True)\ntorch.load('a', weights_only=True)\n"
            "np.load('a')\n")
    assert [line.split(" ", 1)[1] for line in pickle_uses(text, "probe.py")] == [
        "imports a pickler", "imports from a pickler", "calls torch.load without weights_only=True",
        "calls torch.load without weights_only=True", "calls np.load with allow_pickle"]


class _Payload:
    """Unpickling this creates `marker`: what a crafted checkpoint file would do with any code it likes."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", ["optimizer.pt", "rng.pt"])
def test_a_crafted_pickle_in_a_checkpoint_is_refused_and_never_runs(tmp_path, name):
    cfg = small_config(["train.steps=4"])
    train(cfg, tmp_path / "run", synthetic_source(), device="cpu")
    marker = tmp_path / "payload-ran"
    step = tmp_path / "run" / "latest"
    (step / name).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(EyasError, match=rf"{name}: a pickled checkpoint file .* never unpickles .* new --out"):
        train(small_config(["train.steps=8"]), tmp_path / "run", synthetic_source(), device="cpu", resume=True)
    assert not marker.exists()
    assert os.readlink(tmp_path / "run" / "latest") == "step-0000004"


# ---- atomic checkpoints

def test_a_full_disk_while_checkpointing_removes_the_partial_step_and_keeps_the_last(tmp_path, monkeypatch):
    import safetensors.torch

    save_file = safetensors.torch.save_file

    def full_at_step_8(tensors, filename, *args, **kwargs):
        if ".step-0000008.tmp" in str(filename) and filename.endswith("optimizer.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full_at_step_8)
    run = tmp_path / "run"
    with pytest.raises(EyasError, match=r"could not write checkpoint .*step-0000008 \(disk full; [\d.]+ GiB free on "
                                        r".*step-0000004 is intact"):
        train(small_config(["train.steps=8"]), run, synthetic_source(), device="cpu")
    assert not list(run.glob(".*.tmp")) and os.readlink(run / "latest") == "step-0000004"
    assert ckpt.load_checkpoint(run / "latest")["trainer_state"]["step"] == 4


def test_optimizer_and_rng_state_round_trip_exactly(tmp_path):
    train(small_config(["train.steps=4"]), tmp_path, synthetic_source(), device="cpu")
    loaded = ckpt.load_checkpoint(tmp_path / "latest")
    optim = loaded["optim"]["optimizer"]
    assert sorted(optim["state"]) == list(range(len(optim["state"])))  # integer keys come back as integers
    assert optim["param_groups"][0]["betas"] == (0.9, 0.95)
    assert loaded["optim"]["scheduler"]["last_epoch"] == 4
    ckpt.set_rng_state(loaded["rng"])
    first = (torch.rand(3), __import__("random").random())
    ckpt.set_rng_state(ckpt.load_checkpoint(tmp_path / "latest")["rng"])
    assert torch.equal(first[0], torch.rand(3)) and first[1] == __import__("random").random()


# ---- non-finite steps

def nan_loss_at(monkeypatch, steps: set[int]):
    """Make the loss NaN at these optimizer steps (1-based; one micro-batch a step)."""
    from eyas.train import loop

    forward, calls = loop.TTTModule.forward, [0]

    def patched(self, batch, lm_head_weight):
        calls[0] += 1
        res = forward(self, batch, lm_head_weight)
        if calls[0] in steps:
            res.loss = res.loss * float("nan")
        return res

    monkeypatch.setattr(loop.TTTModule, "forward", patched)


def test_a_nonfinite_step_is_skipped_and_counted(tmp_path, monkeypatch, capsys):
    nan_loss_at(monkeypatch, {3})
    summary = train(small_config(["train.steps=4", "train.save_every=1", "train.keep_last=4"]), tmp_path,
                    synthetic_source(), device="cpu")
    assert summary["nonfinite_steps"] == 1 and all(torch.isfinite(torch.tensor(summary["loss"])).reshape(1))
    assert "step 3: the loss or a gradient is NaN or inf; the step is skipped" in capsys.readouterr().err
    before, after = (load_file(str(tmp_path / f"step-000000{i}" / "model.safetensors")) for i in (2, 3))
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update at the skipped step
    moments = [load_file(str(tmp_path / f"step-000000{i}" / "optimizer.safetensors")) for i in (2, 3)]
    assert all(torch.equal(moments[0][k], moments[1][k]) for k in moments[0])
    states = [json.loads((tmp_path / f"step-000000{i}" / "trainer_state.json").read_text()) for i in (3, 4)]
    assert [s["nonfinite_steps"] for s in states] == [1, 1] and states[1]["bad_in_a_row"] == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["nonfinite_steps"] == 1


def test_a_run_of_nonfinite_steps_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    nan_loss_at(monkeypatch, {6, 7, 8})
    with pytest.raises(EyasError, match=r"stopped at step 8: 3 steps in a row had a NaN or inf loss or gradient "
                                        r"\(train.max_bad_steps=3\); the last good checkpoint is .*step-0000004; "
                                        r"likely causes: a learning rate too high .*eyas verify"):
        train(small_config(["train.steps=12"]), tmp_path, synthetic_source(), device="cpu")
    assert os.readlink(tmp_path / "latest") == "step-0000004"
    assert all(torch.isfinite(w).all() for w in load_file(str(tmp_path / "latest" / "model.safetensors")).values())


def test_an_exploding_learning_rate_stops_without_saving_a_nonfinite_draft(tmp_path):
    cfg = small_config(["train.save_every=1"])
    cfg.train.lr = 1e30  # finite, and past what a config accepts (train.lr <= 1): the loop must hold on its own
    with pytest.raises(EyasError, match=r"steps in a row had a NaN or inf .*train.lr=1e\+30"):
        train(cfg, tmp_path, synthetic_source(), device="cpu")
    for step in ckpt.list_steps(tmp_path):
        assert all(torch.isfinite(w).all() for w in load_file(str(step / "model.safetensors")).values())


def test_nonfinite_weights_are_never_saved(tmp_path):
    weights = {"fc.weight": torch.tensor([[1.0, float("inf")]])}
    with pytest.raises(EyasError, match=r"weights hold NaN or inf \(fc.weight\), so they are not saved"):
        ckpt.save_checkpoint(tmp_path, 1, weights, {}, {"step": 1}, {}, small_config(), 2)
    assert not list(tmp_path.iterdir())


# ---- resume keeps the shape of training

@pytest.mark.parametrize("change, said", [
    ("train.ttt=2", "train.ttt is 3 there and 2 now"),
    ("train.batch_tokens=96", "train.batch_tokens is 128 there and 96 now"),
    ("train.grad_accum=2", "train.grad_accum is 1 there and 2 now"),
])
def test_resume_with_another_shape_of_training_is_refused(tmp_path, change, said):
    train(small_config(["train.steps=4"]), tmp_path, synthetic_source(), device="cpu")
    with pytest.raises(EyasError, match=rf"cannot resume from .*step-0000004: {said}; resume with the checkpoint's "
                                        rf"values \(--set {change.split('=')[0]}=.*\) or train into a new --out"):
        train(small_config(["train.steps=8", change]), tmp_path, synthetic_source(), device="cpu", resume=True)
    assert os.readlink(tmp_path / "latest") == "step-0000004"


# ---- memory

@pytest.mark.parametrize("sets", [["train.ttt=64", "train.batch_tokens=10000000"], ["train.batch_tokens=10000000000"]])
def test_training_that_cannot_fit_is_refused_before_the_first_step(tmp_path, sets, monkeypatch):
    from eyas.train import loop

    monkeypatch.setattr(loop, "_session", lambda *a, **k: pytest.fail("reached the optimizer setup"))
    t0 = time.monotonic()
    with pytest.raises(EyasError, match=r"needs at least [\d,.]+ GiB .* but [\d,.]+ GiB is MemAvailable .*lower "
                                        r"train.batch_tokens \(and raise train.grad_accum.*\) or train.ttt"):
        train(small_config(sets), tmp_path, synthetic_source(), device="cpu")
    assert time.monotonic() - t0 < 10 and not (tmp_path / "latest").exists()


def test_an_lk_loss_keeps_no_more_for_the_backward_than_kl():
    """train.loss=lk_* is chunked like the KL loss (eyas.train.kernels.linear_lk): the tensors a training
    forward keeps for the backward add up to the same bytes as with KL, where the plain LK computation keeps
    each step's [N_k, Vd] logits and more (at the full preset's 32,768 tokens, TTT 7 and Vd 32,000 that ran out
    of an 80 GB H100). The memory estimate is the same for both."""
    from types import SimpleNamespace

    from test_ttt import V, H, make_batch, make_draft

    from eyas.config import load_config
    from eyas.train.guards import estimate_bytes
    from eyas.train.ttt import LossSpec, ttt_forward

    def saved_bytes(kind, impl):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        draft, batch = make_draft(), make_batch([12, 10])
        lm = torch.randn(V, H, generator=torch.Generator().manual_seed(5))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = ttt_forward(draft, batch, lm, ttt=3, impl=impl, loss=LossSpec(kind=kind))
        res.loss.backward()
        return sum(total)

    kl = saved_bytes("kl", "fast")
    for kind in ("lk_alpha", "lk_hybrid"):
        assert saved_bytes(kind, "fast") == kl < saved_bytes(kind, "reference"), kind
    draft = SimpleNamespace(cfg=SimpleNamespace(hidden_size=576, draft_vocab_size=32000),
                            num_trainable_params=lambda: 23_520_000, embed_tokens=SimpleNamespace(weight=torch.empty(0)))
    head = torch.empty(0)
    assert (estimate_bytes(draft, load_config("full").train, head, 3)
            == estimate_bytes(draft, load_config("full", ["train.loss=lk_hybrid"]).train, head, 3))


# ---- wall-clock checkpoints

def test_checkpoints_are_also_written_by_wall_time(tmp_path):
    cfg = small_config(["train.steps=5", "train.save_every=1000", "train.save_every_minutes=1e-9",
                        "train.keep_last=10"])
    train(cfg, tmp_path, synthetic_source(), device="cpu")
    assert [p.name for p in ckpt.list_steps(tmp_path)] == [f"step-000000{i}" for i in range(1, 6)]
    train(small_config(["train.steps=5", "train.save_every=1000", "train.save_every_minutes=0"]), tmp_path / "off",
          synthetic_source(), device="cpu")
    assert [p.name for p in ckpt.list_steps(tmp_path / "off")] == ["step-0000005"]


# ---- with a captured store: corrupt shards, stop signals

@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    import datasets
    import numpy as np

    from eyas.config import load_config
    from eyas.data.vocab import build_vocab, save_vocab
    from eyas.stages import capture

    root = tmp_path_factory.mktemp("integrity")
    rng = np.random.default_rng(0)
    rows = {"sample_id": [], "input_ids": [], "loss_mask": []}
    for i in range(12):
        n = int(rng.integers(16, 40))
        rows["sample_id"].append(f"s{i}")
        rows["input_ids"].append(rng.integers(0, 256, n).tolist())
        rows["loss_mask"].append([0] * (n // 3) + [1] * (n - n // 3))
    datasets.Dataset.from_dict(rows).save_to_disk(str(root / "prepared" / "dataset"))
    (root / "prepared" / "prepare.json").write_text(json.dumps({"source": "test", "kept": 12}))
    counts = torch.zeros(320, dtype=torch.long)
    for ids in rows["input_ids"]:
        counts += torch.bincount(torch.tensor(ids), minlength=320)
    save_vocab(build_vocab(counts, 200), root / "prepared" / "vocab.safetensors")
    capture.run(load_config("tiny", ["capture.shard_tokens=120"]), capture.Inputs(root / "prepared"), root / "store")
    return root


def eyas_argv(store, out, *extra):
    return ["train", "--config", "tiny", "--store", str(store), "--out", str(out), "--set", "train.log_every=1",
            "--set", "train.batch_tokens=64", *extra]


def test_a_corrupt_shard_stops_training_with_the_shard_named(tiny_store, tmp_path, capsys):
    from eyas.cli import main as eyas_main

    store = tmp_path / "store"
    shutil.copytree(tiny_store / "store", store)
    manifest = json.loads((store / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 2
    shard = store / manifest["shards"][-1]["file"]
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n + json.loads(raw[8:8 + n])["final_hidden"]["data_offsets"][0]
    raw[start:start + 4] = struct.pack("<f", float("inf"))  # one stored value made inf
    shard.write_bytes(bytes(raw))
    rc = eyas_main(eyas_argv(store, tmp_path / "run", "--steps", "3"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and f"{shard}: its sha256 differs" in err[-1] and f"eyas verify {store}" in err[-1], err
    assert not ckpt.list_steps(tmp_path / "run")


SLOW_READS = ("import sys, time; import eyas.store.reader as r; read = r.StoreReader.read; "
              "r.StoreReader.read = lambda self, pos, j: (time.sleep(0.04), read(self, pos, j))[1]; "
              "from eyas.cli import main; sys.exit(main(sys.argv[1:]))")


def test_sigterm_saves_a_checkpoint_and_resume_ends_where_an_uninterrupted_run_does(tiny_store, tmp_path):
    store = tiny_store / "store"
    args = ["--steps", "24", "--set", "train.save_every=1000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    full = subprocess.Popen([sys.executable, "-m", "eyas", *eyas_argv(store, tmp_path / "full", *args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_READS, *eyas_argv(store, run, *args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, deadline = run / "metrics.jsonl", time.time() + 120
    while proc.poll() is None and time.time() < deadline and not (
            metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)  # the process this test started
    err = proc.communicate(timeout=120)[1].strip().splitlines()
    assert proc.returncode == 2, err[-5:]
    assert "stopped by SIGTERM after step" in err[-1] and "rerun the same command with --resume" in err[-1], err[-3:]
    stopped_at = json.loads((run / "latest" / "trainer_state.json").read_text())["step"]
    assert 3 <= stopped_at < 24 and f"step-{stopped_at:07d}" in err[-1]

    resumed = subprocess.run([sys.executable, "-m", "eyas", *eyas_argv(store, run, *args), "--resume"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert full.wait(timeout=120) == 0, full.stderr.read()[-2000:]
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {run / f'step-{stopped_at:07d}'}" in resumed.stdout
    a = load_file(str(tmp_path / "full" / "latest" / "model.safetensors"))
    b = load_file(str(run / "latest" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
