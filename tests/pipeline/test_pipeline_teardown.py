"""Stage processes are ended as a whole group on every path, and nothing else is ever touched.

Real processes throughout: the runner is eyas's own (run as a subprocess, so it can be interrupted and
killed), the stages are fake_stage.py, which leaves a child shell, a sleeping child, a child in a session of its
own (as torchrun's workers are) and two grandchildren behind, one of them (and the shell) ignoring SIGTERM.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eyas.gpu.procs import proc_info, start_time
from eyas.ownership import claim

HERE = Path(__file__).resolve().parent
RUNNER = str(HERE / "pipeline_fakes.py")


def alive(pid: int) -> bool:
    info = proc_info(pid)
    return info is not None and info.state != "Z"


def wait_until(cond, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def listed_pids(path: Path) -> dict[str, int]:
    return {role: int(pid) for role, pid in (ln.split() for ln in path.read_text().splitlines())}


@pytest.fixture
def decoy():
    """A process of the test, outside every stage, named like the stage's own children."""
    p = subprocess.Popen(["sleep", "1000"])
    yield p
    p.kill()
    p.wait()


def start_runner(tmp_path: Path, stage_args: list[str], timeout_s=0.0, name="spec.json") -> subprocess.Popen:
    spec = {"run": str(tmp_path / "run"), "opts": {"gpus": [], "grace_s": 0.5, "echo": False},
            "stages": [{"name": "work", "writes": "work", "args": stage_args, "timeout_s": timeout_s}]}
    (tmp_path / name).write_text(json.dumps(spec))
    out = open(tmp_path / f"{name}.out", "w")
    return subprocess.Popen([sys.executable, RUNNER, str(tmp_path / name)], stdout=out, stderr=subprocess.STDOUT)


EXPECTED = {"success": (0, "done"), "failure": (2, "failed"), "timeout": (2, "timeout"),
            "ctrl-c": (130, "interrupted"), "sigterm": (128 + signal.SIGTERM, "interrupted")}


@pytest.mark.parametrize("path", list(EXPECTED))
def test_stage_group_is_gone_and_decoy_survives(tmp_path, decoy, path):
    pids_file = tmp_path / "pids"
    mode = {"success": "ok", "failure": "fail"}.get(path, "hang")
    runner = start_runner(tmp_path, ["--spawn", "--pids", str(pids_file), "--mode", mode],
                          timeout_s=1.0 if path == "timeout" else 0.0)
    wait_until(lambda: pids_file.exists() and len(pids_file.read_text().splitlines()) == 6, what="stage pids")
    pids = listed_pids(pids_file)
    if path in ("ctrl-c", "sigterm"):
        assert all(alive(p) for p in pids.values())
        runner.send_signal(signal.SIGINT if path == "ctrl-c" else signal.SIGTERM)
    rc = runner.wait(timeout=30)
    log = (tmp_path / "spec.json.out").read_text()
    want_rc, want_status = EXPECTED[path]
    assert rc == want_rc, log
    assert [role for role, p in pids.items() if alive(p)] == [], log
    assert alive(decoy.pid)
    run = tmp_path / "run"
    assert json.loads((run / "stages.json").read_text())["stages"]["work"]["status"] == want_status
    (rec,) = json.loads((run / "processes.json").read_text())["stages"]
    assert rec["ended"] and rec["pid"] == pids["leader"] == rec["pgid"] and rec["devices"] == []
    assert rec["start_ticks"] > 0


@pytest.mark.parametrize("leader_dies", [False, True])
def test_orphans_of_a_killed_runner_are_ended_and_the_stage_resumes(tmp_path, decoy, leader_dies):
    pids_file, record = tmp_path / "pids", tmp_path / "record.jsonl"
    runner = start_runner(tmp_path, ["--spawn", "--pids", str(pids_file), "--mode", "hang"])
    wait_until(lambda: pids_file.exists() and len(pids_file.read_text().splitlines()) == 6, what="stage pids")
    pids = listed_pids(pids_file)
    runner.kill()
    runner.wait()
    assert all(alive(p) for p in pids.values())  # kill -9 of the runner leaves the stage behind
    if leader_dies:  # then its children are found by the token in their environment
        os.kill(pids["leader"], signal.SIGKILL)
        wait_until(lambda: not alive(pids["leader"]), what="the leader to go")

    again = start_runner(tmp_path, ["--record", str(record)], name="spec2.json")
    rc = again.wait(timeout=30)
    log = (tmp_path / "spec2.json.out").read_text()
    assert rc == 0, log
    assert "orphaned" in log
    assert [role for role, p in pids.items() if alive(p)] == [], log
    assert alive(decoy.pid)
    runs = [json.loads(ln) for ln in record.read_text().splitlines()]
    assert runs[0]["resume"] is True  # partial output and unchanged inputs: the stage resumed
    assert json.loads((tmp_path / "run" / "stages.json").read_text())["stages"]["work"]["status"] == "done"


def test_a_reused_pid_is_left_alone(tmp_path):
    decoy = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs; the decoy's group id with a token it does not carry
    try:
        run = tmp_path / "run"
        claim(run, "run")  # a run directory whose runner was killed
        fake = {"stage": "work", "pgid": decoy.pid, "token": "0123456789abcdef", "devices": [], "ended": False}
        records = [dict(fake, pid=decoy.pid, start_ticks=start_time(decoy.pid) + 7),
                   dict(fake, pid=gone.pid, start_ticks=1)]
        (run / "processes.json").write_text(json.dumps({"stages": records}))
        runner = start_runner(tmp_path, [])
        rc = runner.wait(timeout=30)
        log = (tmp_path / "spec.json.out").read_text()
        assert rc == 0, log
        assert "left alone" in log
        assert alive(decoy.pid)
    finally:
        decoy.kill()
        decoy.wait()


class DeadTerminal:
    """stdout of a runner whose terminal was closed: once `dead`, every write fails with EIO."""

    dead = False

    def write(self, text):
        if self.dead:
            raise OSError(errno.EIO, "Input/output error")
        return len(text)

    def flush(self):
        if self.dead:
            raise OSError(errno.EIO, "Input/output error")


def test_a_closed_terminal_does_not_stop_the_teardown(tmp_path, decoy, monkeypatch):
    """SIGHUP after the terminal closed: the runner's log lines fail, its stage processes are ended anyway."""
    from pipeline_fakes import fake_stage

    from eyas.config import load_config
    from eyas.gpu.procs import Terminated
    from eyas.pipeline import RunOptions, run_pipeline

    pids_file, sink = tmp_path / "pids", DeadTerminal()
    stage = fake_stage("work", "work", ["--spawn", "--pids", str(pids_file), "--mode", "hang"])
    monkeypatch.setattr(sys, "stdout", sink)

    def close_terminal_then_signal():
        wait_until(lambda: pids_file.exists() and len(pids_file.read_text().splitlines()) == 6, what="stage pids")
        sink.dead = True
        os.kill(os.getpid(), signal.SIGTERM)  # SIGHUP is handled alike; SIGTERM stays caught under nohup too

    thread = threading.Thread(target=close_terminal_then_signal)
    thread.start()
    try:
        with pytest.raises(Terminated):
            opts = RunOptions(gpus=[], grace_s=0.5, echo=False)
            run_pipeline(load_config("tiny"), tmp_path / "run", opts, (stage,))
    finally:
        thread.join()
        pids = listed_pids(pids_file)
        left = [role for role, p in pids.items() if alive(p)]
        for p in pids.values():  # the test's own cleanup, pid by pid, should the runner have failed
            if alive(p):
                os.kill(p, signal.SIGKILL)
    assert left == [] and alive(decoy.pid)
    run = tmp_path / "run"
    assert json.loads((run / "stages.json").read_text())["stages"]["work"]["status"] == "interrupted"
    assert all(r["ended"] for r in json.loads((run / "processes.json").read_text())["stages"])


def test_an_ignored_hangup_stays_ignored():
    """`nohup eyas run ... &`: a signal ignored when the runner starts stays ignored (logout does not end
    the run); the others still raise."""
    from eyas.gpu.procs import Terminated, signals_raise

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # a shell without job control starts background commands with SIGINT ignored: kill -INT must still work
    before_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals_raise():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)  # a handler would have raised Terminated by now
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            with pytest.raises(Terminated):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1.0)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1.0)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
        signal.signal(signal.SIGINT, before_int)


def test_a_leader_that_outlives_sigkill_is_reported_not_waited_for(monkeypatch, tmp_path):
    """A leader still alive after SIGKILL and the wait (stuck in the kernel) must not block the runner in a
    wait that never returns: it is reported, left unreaped, and ended here by the test that started it."""
    from eyas.gpu import procs

    proc = procs.launch("stuck", ["sleep", "1000"], dict(os.environ), tmp_path / "stuck.log", [])
    monkeypatch.setattr(procs, "end_stage", lambda pid, *a, **k: ([pid], [pid]))  # as if SIGKILL had no effect
    t0 = time.monotonic()
    result = procs.teardown(proc, grace_s=0.1, kill_wait_s=0.1)
    assert time.monotonic() - t0 < 5 and result.left == [proc.pid] and proc.returncode is None
    assert "STILL ALIVE after SIGKILL" in result.message() and alive(proc.pid)
    proc.popen.kill()  # our own child, by its pid
    proc.popen.wait()
