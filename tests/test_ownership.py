"""eyas writes only into directories it made (their marker) or empty ones, refuses links, files and an empty
path as output directories, lets one writer at a time hold an output, and leaves no temporary file behind
when the disk fills while it writes the store's target head."""

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from eyas.common import EyasError
from eyas.ownership import MARKER, check_output_path, claim, exclusive, lock_file, owned, read_marker, writing


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_claim_creates_marks_and_accepts_its_own_kind(tmp_path):
    out = tmp_path / "a" / "store"
    marker = claim(out, "capture", run_id="r1")
    assert json.loads((out / MARKER).read_text()) == marker
    assert marker["made_by"] == "eyas" and marker["kind"] == "capture" and marker["run_id"] == "r1"
    assert isinstance(marker["format_version"], int) and marker["created"]
    assert owned(out) and owned(out, "capture") and not owned(out, "train")
    assert claim(out, "capture", run_id="r2") == marker  # taken as it is
    with pytest.raises(EyasError, match=r"store holds eyas's capture output, not train output: choose another"):
        claim(out, "train")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert claim(empty, "train")["kind"] == "train" and owned(empty, "train")


def test_a_user_directory_is_refused_and_left_as_it_is(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / ".x.tmp").write_text("mine too")
    (mine / MARKER).write_text('{"made_by": "me"}')  # a marker that is not eyas's is no marker
    before = tree(mine)
    with pytest.raises(EyasError, match=rf"{mine} was not made by eyas .*choose another --out / --run-dir, or "
                                        rf"remove it yourself"):
        claim(mine, "prepare")
    assert tree(mine) == before and not owned(mine) and read_marker(mine) is None


@pytest.mark.parametrize("case", ["empty", "symlink", "file"])
def test_impossible_output_paths_are_one_line_errors(tmp_path, case):
    real = tmp_path / "real"
    real.mkdir()
    (real / "data.txt").write_text("x")
    path = {"empty": "", "symlink": tmp_path / "link", "file": real / "data.txt"}[case]
    if case == "symlink":
        path.symlink_to(real)
    expected = {"empty": "empty path, which would mean the current directory",
                "symlink": "is a symbolic link", "file": "is an existing file, not a directory"}[case]
    for call in (lambda: check_output_path(path, "run directory"), lambda: claim(path, "run")):
        with pytest.raises(EyasError, match=expected) as e:
            call()
        assert "\n" not in str(e.value)
    assert tree(real) == {"data.txt": b"x"} and not (real / MARKER).exists()


HOLDER = textwrap.dedent("""
    import sys, time
    from eyas.ownership import exclusive
    with exclusive(sys.argv[1], "held"):
        print("held", flush=True)
        time.sleep(60)
""")


@pytest.fixture
def holder(tmp_path):
    """hold(lock) -> the pid of another process holding `lock` (ended after the test)."""
    started = []

    def hold(lock: Path) -> int:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parents[1])
        started.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc.pid

    yield hold
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_second_writer_is_refused_at_once_with_the_holder_pid(tmp_path, holder):
    lock = tmp_path / ".out.eyas.lock"
    pid = holder(lock)
    with pytest.raises(EyasError, match=rf"^out is in use by another process \(pid {pid}\); wait$"):
        with exclusive(lock, "out", fix="wait"):
            pass


def test_a_lock_file_is_gone_when_its_writer_ends_and_a_refused_writer_leaves_it(tmp_path, holder):
    lock = tmp_path / ".out.eyas.lock"
    with exclusive(lock, "out"):
        assert lock.read_text() == f"{os.getpid()}\n"
    assert not lock.exists()
    with pytest.raises(RuntimeError):
        with exclusive(lock, "out"):
            raise RuntimeError("the block failed")
    assert not lock.exists()
    pid = holder(lock)
    with pytest.raises(EyasError, match=rf"pid {pid}"):
        with exclusive(lock, "out"):
            pass
    assert lock.read_text() == f"{pid}\n"  # the holder's lock, untouched


def test_a_lock_taken_from_a_removed_file_is_taken_again_on_the_new_one(tmp_path, monkeypatch):
    """A writer that opened the lock file just before its holder removed it must not lock the removed file
    (a third process would then lock a new one beside it): it finds the file gone and opens the path again."""
    lock = tmp_path / ".out.eyas.lock"
    lock.write_text("1\n")
    stale = os.open(lock, os.O_RDWR)  # what a second writer had opened before the holder removed the file
    lock.unlink()
    lock.write_text("")
    real_open, opened = os.open, []

    def stale_first(path, *args):  # the first open finds the stale file, as the race would
        opened.append(path)
        return os.dup(stale) if len(opened) == 1 else real_open(path, *args)

    monkeypatch.setattr(os, "open", stale_first)
    try:
        with exclusive(lock, "out"):
            assert lock.read_text() == f"{os.getpid()}\n"  # it holds the file at the path, not the stale one
    finally:
        os.close(stale)
    assert len(opened) == 2 and not lock.exists()


@pytest.mark.parametrize("before", ["absent", "empty", "eyas's", "written"])
def test_a_stage_that_fails_before_writing_leaves_its_output_as_it_was(tmp_path, before):
    out = tmp_path / "out"
    if before == "empty":
        out.mkdir()
    elif before == "eyas's":
        claim(out, "prepare")
    was = tree(out) if out.exists() else None
    with pytest.raises(EyasError, match="bad input"):
        with writing(out, "prepare") as p:
            if before == "written":
                (p / "part.txt").write_text("kept")
            raise EyasError("bad input")
    if before == "written":  # something was written: the marked directory stays, with it
        assert owned(out, "prepare") and (out / "part.txt").read_text() == "kept"
    else:
        assert (tree(out) if out.exists() else None) == was
        assert out.exists() == (before != "absent")
    assert not lock_file(out).exists()


def test_a_capture_into_a_store_in_use_stops_naming_the_holder(tmp_path, holder):
    from eyas.config import load_config
    from eyas.stages import capture

    store = tmp_path / "store"
    claim(store, "capture")
    pid = holder(lock_file(store))
    with pytest.raises(EyasError, match=rf"{store} is in use by another process \(pid {pid}\)"):
        capture.run(load_config("tiny"), capture.Inputs(prepared=tmp_path / "none"), store)


@pytest.mark.parametrize("stage", ["capture", "prepare", "train", "export"])
def test_a_stage_refuses_a_user_directory_before_touching_it(tmp_path, stage):
    """`eyas capture --out D` used to delete D's .*.tmp entries before refusing D; no stage touches it now."""
    import importlib

    from eyas.config import load_config

    out = tmp_path / "mine"
    out.mkdir()
    (out / ".x.tmp").write_text("the user's")
    (out / "notes.txt").write_text("the user's")
    module = importlib.import_module(f"eyas.stages.{stage}")
    inputs = {"capture": lambda: module.Inputs(prepared=tmp_path / "none"), "prepare": lambda: module.Inputs(),
              "train": lambda: module.Inputs(store=tmp_path / "none"),
              "export": lambda: module.Inputs(draft=tmp_path / "none")}[stage]()
    with pytest.raises(EyasError, match=f"{out} was not made by eyas"):
        module.run(load_config("tiny"), inputs, out)
    assert tree(out) == {".x.tmp": b"the user's", "notes.txt": b"the user's"}


def test_open_store_refuses_before_cleaning_temporaries(tmp_path):
    from eyas.store.create import open_store

    out = tmp_path / "mine"
    out.mkdir()
    (out / ".x.tmp").write_text("the user's")
    with pytest.raises(EyasError, match="was not made by eyas"):
        open_store(out, {}, target=None)
    assert (out / ".x.tmp").read_text() == "the user's"


def _fake_target():
    import torch

    emb = torch.nn.Embedding(16, 4)
    return SimpleNamespace(embed_tokens=emb, lm_head=torch.nn.Linear(4, 16, bias=False), identity={"name": "t"})


@pytest.mark.parametrize("committed", [False, True])
def test_a_full_disk_while_writing_the_target_head(tmp_path, monkeypatch, committed):
    """The head is written under a temporary name: a full disk removes it, names the file and says so, and a
    head already there (left by a start that was killed) stays as it was."""
    import eyas.store.create as create
    from eyas.store.manifest import HEAD_FILE

    store = tmp_path / "store"
    claim(store, "capture")
    if committed:
        (store / HEAD_FILE).write_bytes(b"committed")
    real = create.write_shard_file

    def full(path, tensors, metadata):
        real(path, {k: v[:1] for k, v in tensors.items()}, metadata)  # part of it reached the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(create, "write_shard_file", full)
    with pytest.raises(EyasError, match=rf"^disk full while writing {store / HEAD_FILE} .*choose another --out"):
        create.open_store(store, {}, _fake_target())
    assert sorted(os.listdir(store)) == sorted([MARKER] + [HEAD_FILE] * committed)
    if committed:
        assert (store / HEAD_FILE).read_bytes() == b"committed"
