"""`eyas run` adopts, replaces and removes only what it made: a run directory and stage outputs carry eyas's
marker; a directory without it stops the run, named, with nothing in it touched, whatever the config says.

The runner is the real one, in process; the stages are fake_stage.py (pipeline_fakes.py).
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pipeline_fakes import fake_stage

from eyas.common import EyasError
from eyas.config import load_config
from eyas.ownership import MARKER, lock_file, read_marker
from eyas.pipeline import RunOptions, run_pipeline

QUIET = RunOptions(gpus=[], echo=False, grace_s=0.5)


def chain(tmp_path: Path):
    rec = ["--record", str(tmp_path / "record.jsonl")]
    return (fake_stage("a", "a", rec, config=["data"]),
            fake_stage("b", "b", rec, reads=["a"], config=["train"]))


def runs(tmp_path: Path) -> int:
    record = tmp_path / "record.jsonl"
    return sum(json.loads(line)["result"] == "started" for line in record.read_text().splitlines()) \
        if record.exists() else 0


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_the_run_and_its_outputs_carry_the_runs_marker_and_a_rerun_skips(tmp_path):
    run = tmp_path / "run"
    run_pipeline(load_config("tiny"), run, QUIET, chain(tmp_path))
    marker = read_marker(run)
    assert marker["kind"] == "run" and marker["made_by"] == "eyas"
    for stage in ("a", "b"):
        assert read_marker(run / stage) | {"created": None} == marker | {"kind": stage, "created": None}
    run_pipeline(load_config("tiny"), run, QUIET, chain(tmp_path))
    assert runs(tmp_path) == 2  # the markers are not outputs: nothing ran again


@pytest.mark.parametrize("change", [[], ["train.lr=0.5"], ["data.num_prompts=7"]])
def test_a_user_directory_in_a_stage_output_place_stops_the_run(tmp_path, change):
    """RUN/b replaced by the user's own directory: with the same config (its record says done), with b's config
    changed (its output would be removed) or a's (b's input changes): the run stops naming it, untouched."""
    run = tmp_path / "run"
    run_pipeline(load_config("tiny"), run, QUIET, chain(tmp_path))
    for p in sorted((run / "b").iterdir()):
        p.unlink()
    (run / "b" / "mine.txt").write_text("the user's")
    with pytest.raises(EyasError, match=rf"{run / 'b'} was not made by the b stage of eyas run .*move it out of "
                                        rf"{run}, or use another --run-dir"):
        run_pipeline(load_config("tiny", change), run, QUIET, chain(tmp_path))
    assert files(run / "b") == {"mine.txt": b"the user's"}
    assert runs(tmp_path) == 2 + ("data.num_prompts=7" in change)  # a reran; b never started


def test_a_user_directory_present_without_a_record_is_not_adopted(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    run_pipeline(load_config("tiny"), run, QUIET, chain(tmp_path)[:1])  # an eyas run of stage a only
    (run / "b").mkdir()
    (run / "b" / "mine.txt").write_text("the user's")
    with pytest.raises(EyasError, match="was not made by the b stage"):
        run_pipeline(load_config("tiny"), run, QUIET, chain(tmp_path))
    assert files(run / "b") == {"mine.txt": b"the user's"}


def test_a_user_directory_as_run_dir_is_refused_untouched(tmp_path):
    run = tmp_path / "mine"
    (run / "prepared").mkdir(parents=True)
    (run / "prepared" / "data.jsonl").write_text("the user's")
    with pytest.raises(EyasError, match=rf"{run} was not made by eyas .*use another --run-dir, or remove it"):
        run_pipeline(load_config("tiny"), run, QUIET, chain(tmp_path))
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == ["prepared", "prepared/data.jsonl"]
    assert runs(tmp_path) == 0


@pytest.mark.parametrize("case", ["empty", "symlink", "file"])
def test_impossible_run_dirs_are_clear_errors(tmp_path, monkeypatch, case):
    real = tmp_path / "real"
    run_pipeline(load_config("tiny"), real, QUIET, chain(tmp_path))  # even an eyas run, reached by a link
    before = files(tmp_path)
    monkeypatch.chdir(real)  # '' would be the current directory
    run = {"empty": "", "symlink": tmp_path / "link", "file": real / "a" / "item-0"}[case]
    if case == "symlink":
        run.symlink_to(real)
    expected = {"empty": "run directory .* is an empty path", "symlink": "is a symbolic link",
                "file": "is an existing file, not a directory"}[case]
    with pytest.raises(EyasError, match=expected) as e:
        run_pipeline(load_config("tiny", ["train.lr=0.5"]), run, QUIET, chain(tmp_path))
    assert "\n" not in str(e.value)
    assert files(tmp_path) == before and runs(tmp_path) == 2


HOLDER = textwrap.dedent("""
    import sys, time
    from eyas.ownership import exclusive
    with exclusive(sys.argv[1], "held"):
        print("held", flush=True)
        time.sleep(60)
""")


def test_an_output_another_process_writes_is_not_removed(tmp_path):
    """`eyas capture --out RUN/store` by hand while the run would replace RUN/store: the run stops, naming the
    writer's pid, and the output stays."""
    run = tmp_path / "run"
    run_pipeline(load_config("tiny"), run, QUIET, chain(tmp_path))
    before = files(run / "b")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_file(run / "b"))], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(EyasError, match=rf"{run / 'b'} is in use by another process \(pid {proc.pid}\)"):
            run_pipeline(load_config("tiny", ["train.lr=0.5"]), run, QUIET, chain(tmp_path))
    finally:
        proc.kill()
        proc.wait()
    assert files(run / "b") == before
    assert (run / "b" / MARKER).is_file()
