"""Out of memory, full disk, unwritable directory: clear errors, nothing lost, the committed store stays valid."""

import errno
import os

import pytest
import torch

import eyas.store.capture_loop as capture_mod
import eyas.store.writer as writer_mod
from eyas.common import EyasError
from eyas.store import StoreReader, capture
from eyas.store.verify import verify_store
from store_helpers import tiny_cfg


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
        real_write(path, tensors, metadata)

    monkeypatch.setattr(writer_mod, "write_shard_file", full_after_two)
    monkeypatch.setattr(capture_mod, "write_shard_file", full_after_two)
    store = tmp_path / "store"
    with pytest.raises(EyasError) as e:
        capture(cfg, prepared, store, target=tiny_target)
    msg = str(e.value)
    assert "no space left" in msg and "needs about" in msg and "rest of the capture" in msg and "resume" in msg
    partial = StoreReader(store)
    assert len(partial.shards) == 2 and not partial.complete
    assert not [p for p in store.iterdir() if p.name.startswith(".")]  # no temporary file left behind
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
