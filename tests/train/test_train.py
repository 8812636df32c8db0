"""The training loop: learning, checkpoint layout, resume after kill -9 (bit-exact), DDP with 2 processes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.train import train
from eyas.train.data import Batcher
from synthetic_train import small_config, synthetic_source

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def run_script(out, *extra, env=None, wait=True):
    cmd = [sys.executable, str(HERE / "synthetic_train.py"), str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    if wait:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def final_weights(run_dir) -> dict:
    return load_file(str(Path(run_dir) / "latest" / "model.safetensors"))


def test_train_learns_and_writes_a_self_describing_run(tmp_path):
    cfg = small_config(["train.steps=20", "train.save_every=10", "train.log_every=5"])
    summary = train(cfg, tmp_path, synthetic_source(), device="cpu")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    assert records[-1]["loss"] < records[0]["loss"]
    assert {"loss_0", "acc_2", "tau_sim", "tokens_per_s", "peak_mem_GiB", "lr"} <= set(records[-1])
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000010", "step-0000020"]  # keep_last 2
    assert os.readlink(tmp_path / "latest") == "step-0000020"
    step = tmp_path / "latest"
    assert {p.name for p in step.iterdir()} == {"model.safetensors", "draft.json", "optimizer.safetensors",
                                                "optimizer.json", "rng.safetensors", "rng.json",
                                                "trainer_state.json", "config.yaml"}
    weights = load_file(str(step / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and weights["d2t"].dtype == torch.long
    meta = json.loads((step / "draft.json").read_text())
    assert meta["aux_layers"] == [1, 2, 3] and meta["features"] == "fused" and meta["ttt"] == 3
    assert meta["target_num_layers"] == 4  # the exporters derive SGLang's layer ids and configs from it
    assert (tmp_path / "curves.png").stat().st_size > 1000 and any((tmp_path / "tb").iterdir())
    assert summary["steps"] == 20 and 1.0 <= summary["tau_sim"] <= 4.0
    batcher, passes, left = synthetic_source().batcher(128, 0, sort=False), 0.0, 20  # shuffled: plans differ in length
    for epoch in range(20):
        n = len(batcher.plan(epoch))
        passes, left = passes + min(left, n) / n, left - min(left, n)
    assert summary["epochs"] == pytest.approx(passes, abs=1e-3)  # passes made, not the last epoch's index
    # RUN/summary.json: what the pipeline reads for the stage's throughput, whole-run figures
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    stream = synthetic_source().batcher(128, 0, sort=False).stream(0, 0)  # train.batching=shuffled
    assert on_disk["tokens"] == sum(int(next(stream)[2]["attention_mask"].sum()) for _ in range(20))
    # wall_s is written rounded to 1 ms, so the rate it implies is only that close
    assert on_disk["wall_s"] > 0
    assert abs(on_disk["tokens_per_s"] / (on_disk["tokens"] / on_disk["wall_s"]) - 1) < 1e-3 + 0.0006 / on_disk["wall_s"]
    assert on_disk["loss"] == records[-1]["loss"] and on_disk["acc_2"] == records[-1]["acc_2"]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_eagle2_baseline_by_flags(tmp_path):
    cfg = small_config(["train.features=last", "train.ttt=1", "train.steps=4"])
    train(cfg, tmp_path, synthetic_source(), device="cpu")
    weights = final_weights(tmp_path)
    assert weights["fc.weight"].shape == (32, 32)  # fc over 1*H: only the highest aux layer
    assert json.loads((tmp_path / "latest" / "draft.json").read_text())["aux_layers"] == [3]


def test_batches_respect_the_token_budget_and_are_deterministic():
    lengths = [5, 40, 17, 33, 8, 12, 29, 3, 40, 21] * 3
    b = Batcher(lengths, lambda i: None, batch_tokens=64, seed=3)
    plan = b.plan(0)
    assert sorted(i for batch in plan for i in batch) == list(range(30))
    assert all(len(batch) * max(lengths[i] for i in batch) <= 64 for batch in plan)
    assert plan == Batcher(lengths, lambda i: None, 64, seed=3).plan(0) != b.plan(1)
    ranks = [Batcher(lengths, lambda i: None, 64, 3, rank=r, world_size=2).plan(0) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) and not {i for x in ranks[0] for i in x} & {i for x in ranks[1] for i in x}


def test_shuffled_batches_mix_lengths_within_the_same_budget():
    """train.batching=shuffled: every sample once an epoch, the same token budget, but batches that mix short and
    long samples where sorted batching keeps each batch to one length."""
    lengths = [4, 60] * 40
    shuffled = Batcher(lengths, lambda i: None, batch_tokens=128, seed=3, sort=False).plan(0)
    by_length = Batcher(lengths, lambda i: None, batch_tokens=128, seed=3).plan(0)
    for plan in (shuffled, by_length):
        assert sorted(i for batch in plan for i in batch) == list(range(80))
        assert all(len(batch) * max(lengths[i] for i in batch) <= 128 for batch in plan)
    mixed = [b for b in shuffled if len({lengths[i] for i in b}) > 1]
    assert len(mixed) >= len(shuffled) // 3
    assert sum(len({lengths[i] for i in b}) > 1 for b in by_length) <= 2  # at most the window edges mix
    assert shuffled == Batcher(lengths, lambda i: None, 128, seed=3, sort=False).plan(0)  # deterministic


def test_resume_after_kill_9_is_bit_exact(tmp_path):
    args = ["--set", "train.steps=12", "--set", "train.save_every=4"]
    full = run_script(tmp_path / "full", *args, wait=False)  # runs alongside the one that gets killed
    run = tmp_path / "killed"
    proc = run_script(run, *args, env={"EYAS_TEST_SAMPLE_SLEEP": "0.05"}, wait=False)
    deadline = time.time() + 90
    while not (run / "latest").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)  # the process this test started
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "training finished before it could be killed"
    killed_at = os.readlink(run / "latest")
    assert killed_at != "step-0000012"

    resumed = run_script(run, *args, "--resume")
    assert full.wait(timeout=120) == 0, full.stderr.read()[-2000:]
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = final_weights(tmp_path / "full"), final_weights(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 12


def test_ddp_and_fsdp2_two_processes_gloo_agree(tmp_path):
    """torchrun with 2 CPU processes: DDP and FSDP2 (fully_shard) train the same weights."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = {}
    for fsdp in ("false", "true"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "synthetic_train.py"), str(tmp_path / fsdp), "--set", "train.steps=4",
               "--set", "train.batch_tokens=96", "--set", f"train.fsdp={fsdp}"]
        procs[fsdp] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for fsdp, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr[-3000:]
        assert "2 rank(s)" in stdout
        assert stdout.count("training 4 steps") == 1  # rank 0 prints, rank 1 stays quiet
        assert json.loads((tmp_path / fsdp / "latest" / "trainer_state.json").read_text())["step"] == 4
    ddp, fsdp = final_weights(tmp_path / "false"), final_weights(tmp_path / "true")
    assert ddp.keys() == fsdp.keys()
    for k in ddp:
        torch.testing.assert_close(ddp[k], fsdp[k], rtol=1e-5, atol=1e-6)


def test_prefetched_stream_gives_the_same_batches_and_positions_as_reading_in_place():
    """stream() reads batches in a background thread; every batch and data position (across an epoch
    boundary and from a mid-epoch start) must be what collating in this thread gives."""
    from eyas.train.data import collate

    batcher = synthetic_source().batcher(128, 5)
    per_epoch = batcher.batches_per_epoch()
    start = per_epoch - 2  # two batches of epoch 0, then epoch 1 from its start
    stream = batcher.stream(0, start)
    expected = [(0, i + 1, batcher.plan(0)[i]) for i in range(start, per_epoch)]
    expected += [(1, i + 1, batcher.plan(1)[i]) for i in range(3)]
    for epoch, index, indices in expected:
        got_epoch, got_index, got = next(stream)
        want = collate(batcher.fetch, indices, 128)
        assert (got_epoch, got_index) == (epoch, index)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    stream.close()


def test_prefetched_raises_the_producers_error_and_stops_on_close():
    import threading
    import time

    from eyas.train.data import prefetched

    def bad():
        yield 1
        yield 2
        raise ValueError("shard 3 of the store is corrupt")

    items = prefetched(bad())
    assert next(items) == 1 and next(items) == 2
    with pytest.raises(ValueError, match="shard 3"):
        next(items)

    produced = []

    def endless():
        while True:
            produced.append(len(produced))
            yield produced[-1]

    items = prefetched(endless(), depth=2)
    assert [next(items) for _ in range(5)] == [0, 1, 2, 3, 4]
    items.close()
    deadline = time.monotonic() + 5
    while any(t.name == "eyas-batch-prefetch" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "eyas-batch-prefetch" for t in threading.enumerate())
    assert len(produced) <= 5 + 2 + 2  # it ran at most `depth` (+ the item in hand) ahead


EXIT_WHILE_PRODUCING = """
import torch
from eyas.train.data import prefetched
torch.set_num_threads(1)
def items():
    a = torch.randn(700, 700)
    while True:
        for _ in range(8):
            a = torch.tanh(a @ a)  # the producer spends its time inside torch, with the GIL released
        yield float(a.sum())
stream = prefetched(items())
next(stream)
stream.close()
print("closed", flush=True)
"""


def test_closing_the_prefetched_stream_lets_the_process_exit_cleanly():
    """A producer thread still inside torch when the interpreter exits aborts the process ("terminate
    called without an active exception", exit -6: seen once in CI after DDP training); closing the stream
    must wait for it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", EXIT_WHILE_PRODUCING], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == "closed\n", (proc.returncode, proc.stderr[-1000:])


def test_closing_the_prefetched_stream_does_not_wait_for_a_producer_waiting_for_data():
    """A producer blocked outside torch (waiting for a shard that capture has not written) must not hold up
    the consumer's exit path: closing waits at most join_s."""
    import threading
    import time

    from eyas.train.data import prefetched

    shard = threading.Event()

    def waits():
        yield 0
        shard.wait(30)  # like GrowingStore.wait_shard polling for a shard that does not come
        yield 1

    stream = prefetched(waits(), join_s=0.5)
    assert next(stream) == 0
    t0 = time.monotonic()
    stream.close()
    assert time.monotonic() - t0 < 5
    shard.set()  # the producer ends now instead of outliving the test
    deadline = time.monotonic() + 5
    while any(t.name == "eyas-batch-prefetch" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_held_out_samples_are_never_trained_on_and_are_scored_with_the_final_weights(tmp_path):
    from eyas.common import EyasError
    from eyas.train.loop import build_draft
    from eyas.train.ttt import ttt_forward

    source = synthetic_source()
    train_b, val_b = source.batchers(128, 0, val_samples=4)
    ids = lambda b, plan: {b.fetch(j)["sample_id"] for batch in plan for j in batch}  # noqa: E731
    trained, held = ids(train_b, train_b.plan(0)), ids(val_b, val_b.plan(0))
    assert len(held) == 4 and not trained & held and len(trained | held) == 24
    assert ids(train_b, train_b.plan(1)) == trained  # every epoch, the same split

    cfg = small_config(["train.val_samples=4", "train.val_every=5"])
    summary = train(cfg, tmp_path, source, device="cpu")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_acc_0" in r] == [5, 10, 12]
    assert [r["step"] for r in records] == [2, 4, 5, 6, 8, 10, 12]
    # the last scoring used the final weights: score the held-out batches again from the checkpoint
    draft = build_draft(source, "fused")
    draft.load_state_dict(final_weights(tmp_path), strict=False)
    correct, count = [0] * 3, [0] * 3
    with torch.no_grad():
        for batch in val_b.plan(0):
            res = ttt_forward(draft, val_b.collate(batch), source.lm_head_weight, 3)
            correct = [a + b for a, b in zip(correct, res.correct_k)]
            count = [a + b for a, b in zip(count, res.count_k)]
    assert [summary[f"val_acc_{k}"] for k in range(3)] == pytest.approx([c / n for c, n in zip(correct, count)])
    # and outside repeats: the same batches with the loss mask cut to the tokens repeat_mask leaves
    from eyas.train.loop import repeat_mask
    from eyas.train.ttt import simulated_tau

    correct, count, tokens = [0] * 3, [0] * 3, [0, 0]
    with torch.no_grad():
        for batch in val_b.plan(0):
            b = val_b.collate(batch)
            tokens[0] += int((b["loss_mask"] > 0).sum())
            b["loss_mask"] = b["loss_mask"] * ~repeat_mask(b["input_ids"], b["loss_mask"])
            tokens[1] += int((b["loss_mask"] > 0).sum())
            res = ttt_forward(draft, b, source.lm_head_weight, 3)
            correct = [a + b for a, b in zip(correct, res.correct_k)]
            count = [a + b for a, b in zip(count, res.count_k)]
    assert summary["val_tau_fresh"] == pytest.approx(simulated_tau([c / n for c, n in zip(correct, count)]))
    assert summary["val_fresh_share"] == pytest.approx(tokens[1] / tokens[0])

    with pytest.raises(EyasError, match="more than half of the 24"):
        source.batchers(128, 0, val_samples=13)


def _other_vocab(source):
    """The same source with a different draft vocabulary (the first quarter of the ids, then the top)."""
    from synthetic_train import V, VD

    d2t = torch.zeros(VD, dtype=torch.long)
    d2t[VD // 4:] = V - VD
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(VD) + d2t] = True
    source.d2t, source.t2d = d2t, t2d
    return source


def fine_tune(cfg, out, source, **kw):
    """train() with train.init_from set: it loads that draft itself."""
    return train(cfg, out, source, device="cpu", **kw)


def test_init_from_fine_tunes_an_earlier_draft_which_keeps_its_vocabulary(tmp_path, capsys):
    first = tmp_path / "first"
    train(small_config(["train.steps=20"]), first, synthetic_source(), device="cpu")
    start = final_weights(first)
    # a learning rate too small to move a weight by 1e-9: the fine-tuned draft must come out as it went in
    tuned = tmp_path / "tuned"
    cfg = small_config(["train.steps=2", "train.lr=1e-12", f"train.init_from={first}"])
    fine_tune(cfg, tuned, _other_vocab(synthetic_source(seed=1)))
    out = capsys.readouterr().out
    assert "fine-tuning the draft of" in out and "keeps its vocabulary of 64 tokens; it holds 48 of the 64" in out
    got = final_weights(tuned)
    assert set(got) == set(start)
    for name in start:
        assert torch.allclose(got[name].float(), start[name].float(), atol=1e-6), name
    assert torch.equal(got["d2t"], start["d2t"])  # the draft's own vocabulary, not the new data's
    assert json.loads((tuned / "latest" / "draft.json").read_text())["init_from"] == str(first)
    # a fresh draft on the same data starts elsewhere, and fine-tuning from the trained one starts lower
    fresh = tmp_path / "fresh"
    train(small_config(["train.steps=2", "train.lr=1e-12"]), fresh, _other_vocab(synthetic_source(seed=1)),
          device="cpu")
    assert not torch.allclose(final_weights(fresh)["fc.weight"], start["fc.weight"])
    assert first_loss(tuned) < first_loss(fresh)


def first_loss(run_dir):
    return json.loads((Path(run_dir) / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def test_init_from_refuses_a_draft_that_does_not_fit_and_names_why(tmp_path):
    from eyas.common import EyasError

    last = tmp_path / "last"
    train(small_config(["train.features=last", "train.ttt=1", "train.steps=2"]), last, synthetic_source(),
          device="cpu")
    with pytest.raises(EyasError, match=r"num_aux_layers 1 \(this run: 3\)"):
        fine_tune(small_config([f"train.init_from={last}"]), tmp_path / "a", synthetic_source())
    fused = tmp_path / "fused"
    train(small_config(["train.steps=2"]), fused, synthetic_source(), device="cpu")
    other = synthetic_source()
    other.target = {**other.target, "name": "other", "config_hash": "1"}
    with pytest.raises(EyasError, match=r"was made for target 'synthetic', not 'other' \(config_hash 0 there, 1 here\)"):
        fine_tune(small_config([f"train.init_from={fused}"]), tmp_path / "b", other)
    shifted = synthetic_source()
    shifted.aux_layers = [0, 1, 2]
    with pytest.raises(EyasError, match=r"reads aux layers \[1, 2, 3\] .* come from \[0, 1, 2\]"):
        fine_tune(small_config([f"train.init_from={fused}"]), tmp_path / "c", shifted)
    with pytest.raises(EyasError, match="no such file or directory"):
        fine_tune(small_config([f"train.init_from={tmp_path / 'missing'}"]), tmp_path / "d", synthetic_source())
    assert not (tmp_path / "a" / "latest").exists() and not (tmp_path / "c" / "latest").exists()


def test_repeat_mask_marks_tokens_after_a_repeated_answer_context():
    """A token is in a repeat when the 8 answer tokens before it already ended earlier in the row's answer:
    eval's rule for tau inside and outside repeats. Prompt tokens never make a context."""
    from eyas.train.loop import repeat_mask

    loop = list(range(10, 20))  # a 10-token phrase the answer says three times
    prompt = [1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17]  # its first 8 tokens in the prompt too
    ids = torch.tensor([prompt + loop * 3 + [5]])
    lmask = torch.tensor([[0] * len(prompt) + [1] * 31])
    got = repeat_mask(ids, lmask)[0].tolist()
    start = len(prompt) + 10  # the second saying: its first 8 tokens are the context of the next ones
    assert not any(got[:start + 8])
    assert all(got[start + 8:])  # every later token follows an 8-gram the answer already had
    # a row of fresh tokens has none; rows are independent; a prompt-only context counts for nothing
    fresh = torch.tensor([list(range(100, 140)), prompt + list(range(200, 229))])
    assert not repeat_mask(fresh, torch.ones_like(fresh)).any()
    assert repeat_mask(ids, torch.zeros_like(lmask)).sum() == 0
