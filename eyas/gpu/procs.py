"""Stage processes: start each in its own session, record it, end its process group and nothing else.

A stage is started with `start_new_session`, so its pid is also its process-group id, and every
process it forks stays in that group unless it leaves on purpose. Teardown signals that group only.
The runner does not reap the stage's leader until the group is empty: while the leader is an unreaped
zombie its pid (the group id) cannot be given to another process, so `killpg` never reaches a
stranger.

A runner that was itself killed leaves records in RUN/processes.json: pid, start time (clock ticks
since boot, field 22 of /proc/<pid>/stat), group and a random token that the stage and all its
descendants carry in their environment. The next runner ends a recorded process only if its pid
still has the recorded start time, and members of a group whose leader is gone only if they carry
the token. A process that reused a recorded pid has another start time and is left alone. Signals to
such orphans go through a pidfd opened before the check, so the check cannot go stale.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

TOKEN_ENV = "EYAS_STAGE_TOKEN"
POLL_S = 0.05


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str  # R, S, D, Z, ... (Z: exited, waiting to be reaped)
    start: int  # clock ticks after boot


def proc_info(pid: int) -> ProcInfo | None:
    """/proc/<pid>/stat parsed, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return ProcInfo(pid, int(rest[1]), int(rest[2]), int(rest[3]), rest[0], int(rest[19]))


def start_time(pid: int) -> int | None:
    info = proc_info(pid)
    return info.start if info else None


def all_procs() -> list[ProcInfo]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and (info := proc_info(int(name))) is not None:
            found.append(info)
    return found


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    return [p.pid for p in all_procs() if p.pgid == pgid and p.state != "Z"]


def has_token(pid: int, token: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False  # gone, or another user's process: not ours either way
    return f"{TOKEN_ENV}={token}".encode() in environ.split(b"\0")


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or "?"


# ---------------------------------------------------------------- our own stage processes

@dataclass
class StageProcess:
    name: str
    argv: list[str]
    popen: subprocess.Popen
    token: str
    start: int
    devices: list[int]
    log: Path
    started_at: float = field(default_factory=time.time)
    seen: set[int] = field(default_factory=set)  # every pid observed in the group (for NVML checks)
    returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def record(self) -> dict:
        return {"stage": self.name, "pid": self.pid, "start_ticks": self.start, "pgid": self.pid,
                "devices": self.devices, "token": self.token, "argv": self.argv, "log": str(self.log),
                "started_at": self.started_at}

    def exited(self) -> bool:
        """Has the leader exited? Checked without reaping it (WNOWAIT), so its pid stays reserved."""
        if self.returncode is not None:
            return True
        try:
            res = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return res is not None and res.si_pid == self.pid

    def refresh_seen(self) -> None:
        self.seen.update(group_members(self.pid))


def launch(name: str, argv: list[str], env: dict[str, str], log: Path, devices: list[int]) -> StageProcess:
    """Start `argv` in a new session with its output appended to `log`."""
    token = secrets.token_hex(8)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 env={**env, TOKEN_ENV: token}, start_new_session=True)
    start = start_time(popen.pid)
    assert start is not None, "an unreaped child always has a /proc entry"
    return StageProcess(name, list(argv), popen, token, start, list(devices), log, seen={popen.pid})


@dataclass
class Teardown:
    stage: str
    returncode: int | None
    killed: list[int]  # pids still alive after the grace period, sent SIGKILL
    left: list[int]  # pids alive even after SIGKILL and the final wait (report them)
    seconds: float

    def message(self) -> str:
        msg = f"{self.stage}: process group ended in {self.seconds:.1f} s"
        if self.killed:
            msg += f" (SIGKILL to {len(self.killed)} process(es) that ignored SIGTERM)"
        if self.left:
            msg += f"; STILL ALIVE after SIGKILL: pids {self.left}"
        return msg


def _wait_group_empty(proc: StageProcess, deadline: float) -> list[int]:
    while True:
        members = group_members(proc.pid)
        proc.seen.update(members)
        if not members or time.monotonic() >= deadline:
            return members
        time.sleep(POLL_S)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def teardown(proc: StageProcess, grace_s: float = 10.0, kill_wait_s: float = 30.0) -> Teardown:
    """SIGTERM to the stage's group, wait up to `grace_s`, SIGKILL the rest, wait; then reap the leader.

    Also the path of a stage that succeeded: whatever it left running in its group is ended.
    """
    t0 = time.monotonic()
    killed: list[int] = []
    left: list[int] = []
    if group_members(proc.pid):
        _killpg(proc.pid, signal.SIGTERM)
        killed = _wait_group_empty(proc, time.monotonic() + grace_s)
        if killed:
            _killpg(proc.pid, signal.SIGKILL)
            left = _wait_group_empty(proc, time.monotonic() + kill_wait_s)
    if proc.returncode is None:
        proc.returncode = proc.popen.wait()  # reaps the leader: only now may its pid be reused
    return Teardown(proc.name, proc.returncode, killed, left, time.monotonic() - t0)


# ---------------------------------------------------------------- orphans of a killed runner

def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (ProcessLookupError, AttributeError, OSError):
        return None


def _signal_if(pid: int, ok, sig: int) -> bool:
    """Send `sig` to `pid` if `ok(pid)` holds, with the check made after taking a pidfd."""
    fd = _pidfd(pid)
    try:
        if not ok(pid):
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _belongs(rec: dict, p: ProcInfo) -> bool:
    if p.pgid != rec["pgid"] or p.state == "Z":
        return False
    return (p.pid == rec["pid"] and p.start == rec["start_ticks"]) or has_token(p.pid, rec["token"])


def orphan_pids(rec: dict) -> tuple[list[int], str | None]:
    """Live processes that belong to a recorded stage, and a note when its pid now belongs to another."""
    leader = proc_info(rec["pid"])
    if leader is not None and leader.start != rec["start_ticks"]:
        # the pid was reused; the recorded group cannot have members left (its id would be reserved)
        return [], f"pid {rec['pid']} now belongs to another process ({cmdline(rec['pid'])[:60]!r}); left alone"
    return [p.pid for p in all_procs() if _belongs(rec, p)], None


def end_orphans(rec: dict, grace_s: float = 10.0, kill_wait_s: float = 30.0) -> tuple[list[str], set[int]]:
    """End what is left of a recorded stage process group; returns lines for the user and the pids ended."""
    notes = []
    pids, note = orphan_pids(rec)
    if note:
        notes.append(f"{rec['stage']}: {note}")
    if not pids:
        return notes, set()
    ended = set(pids)

    def still_ours(pid: int) -> bool:
        info = proc_info(pid)
        return info is not None and _belongs(rec, info)

    notes.append(f"{rec['stage']}: ending {len(pids)} orphaned process(es) of an earlier runner: pids {pids}")
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            for p in pids:
                _signal_if(p, still_ours, sig)
            time.sleep(POLL_S)
            pids = orphan_pids(rec)[0]
            ended.update(pids)
        if not pids:
            return notes, ended
    notes.append(f"{rec['stage']}: STILL ALIVE after SIGKILL: pids {pids}")
    return notes, ended


# ---------------------------------------------------------------- the runner's own signals and lock

class Terminated(BaseException):
    """SIGTERM or SIGHUP reached the runner (handled like Ctrl-C)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


RUNNER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_deferral = {"depth": 0, "pending": None}


def _on_signal(signum, frame):
    if _deferral["depth"]:
        _deferral["pending"] = signum
        return
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


@contextlib.contextmanager
def signals_raise():
    """Ctrl-C raises KeyboardInterrupt and SIGTERM/SIGHUP raise Terminated, inside the block."""
    saved = {s: signal.signal(s, _on_signal) for s in RUNNER_SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_deferred():
    """Hold those signals back for a few lines, e.g. between starting a process and recording it.
    (Not the signal mask: a stage started meanwhile would inherit it and could not be ended.)"""
    _deferral["depth"] += 1
    try:
        yield
    finally:
        _deferral["depth"] -= 1
        if not _deferral["depth"] and _deferral["pending"]:
            signum, _deferral["pending"] = _deferral["pending"], None
            _on_signal(signum, None)


@contextlib.contextmanager
def signals_ignored():
    """Ignore those signals while stages are being ended: a second Ctrl-C must not stop a teardown."""
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in RUNNER_SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def exclusive(path: Path, what: str):
    """An advisory lock that is released with the process, even on kill -9; raises if already held."""
    import fcntl

    from eyas.common import EyasError

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EyasError(f"{what} is in use by another process") from None
        yield
