"""Out of memory, full disk, unwritable directory: clear errors, nothing lost, the committed store stays valid."""

import errno
import json
import os

import pytest
import torch

import eyas.store.create as capture_mod
import eyas.store.writer as writer_mod
from eyas.common import EyasError
from eyas.ownership import MARKER, claim
from eyas.store import StoreReader
from eyas.stages.verify import run as verify_store
from store_helpers import capture, tiny_cfg


def _same_samples(a, b, exact):
    ra, rb = StoreReader(a), StoreReader(b)
    assert len(ra) == len(rb)
    for i in range(len(ra)):
        x, y = ra[i], rb[i]
        assert x["sample_id"] == y["sample_id"] and torch.equal(x["input_ids"], y["input_ids"])
        for key in ("aux_hidden", "final_hidden"):
            if exact:
                assert torch.equal(x[key], y[key])
            else:
                torch.testing.assert_close(x[key], y[key], rtol=1e-5, atol=1e-5)


def test_oom_splits_and_retries_losing_nothing(tmp_path, prepared, tiny_target, capsys):
    ref = capture(tiny_cfg(shard_tokens=400, token_budget=400), prepared, tmp_path / "ref", target=tiny_target)
    assert ref["oom_splits"] == 0
    # every pass over 90 padded tokens raises torch.OutOfMemoryError, as a real allocator failure does
    got = capture(tiny_cfg(shard_tokens=400, token_budget=400, inject_oom_tokens=90), prepared, tmp_path / "oom",
                  target=tiny_target)
    assert got["oom_splits"] >= 2 and got["complete"] and got["num_samples"] == ref["num_samples"]
    assert "out of memory on a forward pass" in capsys.readouterr().err
    _same_samples(tmp_path / "ref", tmp_path / "oom", exact=False)
    # a single sample that does not fit cannot be split: a clear error instead of a loop
    with pytest.raises(EyasError, match="one sample of .* tokens does not fit"):
        capture(tiny_cfg(shard_tokens=400, token_budget=400, inject_oom_tokens=4), prepared, tmp_path / "tiny",
                target=tiny_target)


def test_full_disk_keeps_committed_store_and_resumes(tmp_path, prepared, tiny_target, monkeypatch):
    cfg = tiny_cfg(shard_tokens=120, token_budget=256)
    capture(cfg, prepared, tmp_path / "ref", target=tiny_target)
    real_write, calls = writer_mod.write_shard_file, []

    def full_after_two(path, tensors, metadata):
        calls.append(path)
        if len(calls) > 3:  # the target head and two shards fit, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(writer_mod, "write_shard_file", full_after_two)
    monkeypatch.setattr(capture_mod, "write_shard_file", full_after_two)
    store = tmp_path / "store"
    with pytest.raises(EyasError) as e:
        capture(cfg, prepared, store, target=tiny_target)
    msg = str(e.value)
    assert "no space left" in msg and "needs about" in msg and "rest of the capture" in msg and "resume" in msg
    partial = StoreReader(store)
    assert len(partial.shards) == 2 and not partial.complete
    assert not [p for p in store.iterdir() if p.name.startswith(".") and p.name != MARKER]  # no temporary file left
    assert verify_store(store, num_samples=0)["problems"] == []
    monkeypatch.undo()
    assert capture(cfg, prepared, store, target=tiny_target)["complete"]
    _same_samples(tmp_path / "ref", store, exact=True)


def test_unwritable_directory(tmp_path, prepared, tiny_target, monkeypatch):
    cfg = tiny_cfg(shard_tokens=120, token_budget=256)
    store = tmp_path / "store"
    capture(cfg, prepared, store, target=tiny_target)
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    if os.geteuid() == 0:  # root writes anywhere: make the creation of any file in the store fail as EACCES would
        real = capture_mod.tempfile.mkstemp

        def denied(*args, dir=None, **kw):
            if dir is not None and os.path.samefile(dir, store):
                raise PermissionError(errno.EACCES, "Permission denied", str(dir))
            return real(*args, dir=dir, **kw)

        monkeypatch.setattr(capture_mod.tempfile, "mkstemp", denied)
    else:
        store.chmod(0o555)
    try:
        with pytest.raises(EyasError, match="cannot write into .*store.*Permission denied.*stays valid"):
            capture(cfg, prepared, store, target=tiny_target)
    finally:
        store.chmod(0o755)
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before
    assert verify_store(store, num_samples=0)["problems"] == []


def _shard_hashes(store):
    manifest = json.loads((store / "manifest.json").read_text())
    return [(s["file"], s["sha256"]) for s in manifest["shards"]]


def test_budget_forced_4x_too_large_gives_identical_store(tmp_path, prepared, tiny_target, capsys):
    """Issue 9 section 2 on CPU: every pass over the working budget runs out of memory; the budget halves
    twice, lands on the working one, and the shards are byte-identical to a run with that budget."""
    budget = 100
    ref = capture(tiny_cfg(shard_tokens=400, token_budget=budget), prepared, tmp_path / "ref", target=tiny_target)
    assert ref["oom_splits"] == 0
    got = capture(tiny_cfg(shard_tokens=400, token_budget=4 * budget, inject_oom_tokens=budget), prepared,
                  tmp_path / "oom", target=tiny_target)
    assert got["complete"] and got["oom_splits"] == 2 and got["final_token_budget"] == budget
    assert "token budget now 200" in capsys.readouterr().err
    assert _shard_hashes(tmp_path / "oom") == _shard_hashes(tmp_path / "ref")


def test_several_writer_threads_bounded_buffers_same_bytes(tmp_path, prepared, tiny_target, monkeypatch):
    """Slow writes: several threads write at once, the loop waits for a free buffer instead of taking
    more memory, and the store is byte-identical to one written with a single thread."""
    import threading
    import time

    one = tiny_cfg(shard_tokens=60, token_budget=64)
    one.capture.writer_threads = 1
    capture(one, prepared, tmp_path / "one", target=tiny_target)
    real_write, lock, active, peak = writer_mod.write_shard_file, threading.Lock(), [0], [0]

    def slow(path, tensors, metadata):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        try:
            return real_write(path, tensors, metadata)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(writer_mod, "write_shard_file", slow)
    made = []
    real_buffer = writer_mod.ShardBuffer
    monkeypatch.setattr(writer_mod, "ShardBuffer", lambda *a, **kw: made.append(1) or real_buffer(*a, **kw))
    three = tiny_cfg(shard_tokens=60, token_budget=64)
    three.capture.writer_threads = 3
    s = capture(three, prepared, tmp_path / "three", target=tiny_target)
    assert s["writer_threads"] == 3 and s["staging_buffers"] == 5 and s["num_shards"] >= 8
    assert peak[0] >= 2  # shards were written concurrently
    assert len(made) <= 5 and s["writer_wait_s"] > 0  # memory stayed bounded: the loop waited for the writers
    assert _shard_hashes(tmp_path / "three") == _shard_hashes(tmp_path / "one")
    ra, rb = StoreReader(tmp_path / "one"), StoreReader(tmp_path / "three")
    assert [ra[i]["sample_id"] for i in range(len(ra))] == [rb[i]["sample_id"] for i in range(len(rb))]


def test_summary_json(tmp_path, prepared, tiny_target):
    store = tmp_path / "store"
    summary = capture(tiny_cfg(shard_tokens=200, token_budget=128, dtype="bf16"), prepared, store, target=tiny_target)
    on_disk = json.loads((store / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("wall_s", "samples", "tokens", "tokens_per_s", "bytes", "bytes_per_token", "dtype"):
        assert key in on_disk, key
    manifest = json.loads((store / "manifest.json").read_text())
    assert on_disk["tokens"] == manifest["num_tokens"] and on_disk["bytes"] == manifest["num_bytes"]
    assert on_disk["dtype"] == "bf16" and on_disk["tokens_per_s"] > 0 and 512 < on_disk["bytes_per_token"] < 560
    again = capture(tiny_cfg(shard_tokens=200, token_budget=128, dtype="bf16"), prepared, store, target=tiny_target)
    assert again["tokens"] == 0 and json.loads((store / "summary.json").read_text()) == on_disk  # kept


def test_a_cut_or_garbled_shard_is_named_by_the_reader(tmp_path, prepared, tiny_target):
    """Training reads shards without hashing them: a file cut short, or one of the right size that is not a
    shard, must still be a clear error naming the file, not safetensors' own message."""
    store = tmp_path / "store"
    capture(tiny_cfg(shard_tokens=200, token_budget=256), prepared, store, target=tiny_target)
    first = store / StoreReader(store).shards[0]["file"]
    data = first.read_bytes()
    first.write_bytes(data[:len(data) // 2])
    with pytest.raises(EyasError, match=f"{first.name} holds .* bytes, the manifest says"):
        StoreReader(store)[0]
    first.write_bytes(b"\xff" * len(data))  # the right size, no header a safetensors reader can parse
    with pytest.raises(EyasError, match=f"{first.name}: not a readable shard"):
        StoreReader(store)[0]


def test_a_head_file_left_alone_by_a_killed_start_is_written_again(tmp_path, prepared, tiny_target):
    """A capture killed between writing the target's head and its first manifest left only that file: the
    next capture starts the store afresh instead of refusing a directory that "holds no store"."""
    from eyas.store.manifest import HEAD_FILE

    store = tmp_path / "store"
    claim(store, "capture")  # a killed start had claimed the store before it wrote the head
    (store / HEAD_FILE).write_bytes(b"half written")
    capture(tiny_cfg(shard_tokens=200, token_budget=256), prepared, store, target=tiny_target)
    assert verify_store(store, num_samples=0)["problems"] == []
