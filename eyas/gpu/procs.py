"""Stage processes: start each in its own session, record it, end it with all its descendants and
nothing else.

A stage is started with `start_new_session`, so its pid is also its process-group id, and every process
it forks stays in that group unless it leaves on purpose. The stage and everything it starts also
carry a random token in their environment (EYAS_STAGE_TOKEN), which finds the descendants that did
leave the group: torchrun, for one, starts each worker in a session of its own.

Teardown signals the group and the token carriers, never anything else. The runner does not reap the
stage's leader until all of them are gone: while the leader is an unreaped zombie its pid (the group
id) cannot be given to another process, so `killpg` never reaches a stranger.

A runner that was itself killed leaves records in RUN/processes.json: pid, start time (clock ticks
since boot, field 22 of /proc/<pid>/stat), group and token. The next runner treats the recorded pid as
its own only if it still has the recorded start time (then its group is too); other processes only if
they carry the token. A process that reused a recorded pid has another start time and is left alone.
Signals to those orphans go through a pidfd opened before the check, so the check cannot go stale.
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


def _belongs(p: ProcInfo, pid: int, start: int, token: str, leader_ours: bool) -> bool:
    """Is `p` the recorded stage process `pid` or one of its descendants?"""
    if p.state == "Z":
        return False
    if p.pid == pid:
        return p.start == start
    return (leader_ours and p.pgid == pid) or has_token(p.pid, token)


def members(pid: int, start: int, token: str) -> list[int]:
    """Live processes of a stage: its leader, its group while the leader is ours, its token carriers."""
    leader = proc_info(pid)
    leader_ours = leader is not None and leader.start == start
    return [p.pid for p in all_procs() if _belongs(p, pid, start, token, leader_ours)]


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (ProcessLookupError, AttributeError, OSError):
        return None


def _signal_checked(pids: list[int], pid: int, start: int, token: str, sig: int) -> None:
    """Send `sig` to each of `pids` that still belongs to the stage, checked after taking a pidfd."""
    for target in pids:
        fd = _pidfd(target)
        try:
            info = proc_info(target)
            leader = proc_info(pid)
            if info is None or not _belongs(info, pid, start, token, leader is not None and leader.start == start):
                continue
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(target, sig)
        except (ProcessLookupError, PermissionError):  # gone, or became another user's (setuid)
            pass
        finally:
            if fd is not None:
                os.close(fd)


def end_stage(pid: int, start: int, token: str, grace_s: float, kill_wait_s: float,
              seen: set[int] | None = None) -> tuple[list[int], list[int]]:
    """SIGTERM to every process of the stage, wait up to `grace_s` for them to go, SIGKILL to the rest,
    wait up to `kill_wait_s`. Returns (pids that needed SIGKILL, pids alive even after it)."""
    seen = set() if seen is None else seen
    killed: list[int] = []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        deadline = time.monotonic() + wait_s
        signalled: set[int] = set()
        while True:
            live = members(pid, start, token)
            seen.update(live)
            if not live:
                return killed, []
            if time.monotonic() >= deadline:
                break
            new = [p for p in live if p not in signalled]  # descendants started meanwhile get it too
            _signal_checked(new, pid, start, token, sig)
            signalled.update(new)
            time.sleep(POLL_S)
        if sig == signal.SIGTERM:
            killed = live
    return killed, live


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
    seen: set[int] = field(default_factory=set)  # every pid observed in the stage (for NVML checks)
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
        msg = f"{self.stage}: its processes ended in {self.seconds:.1f} s"
        if self.killed:
            msg += f" (SIGKILL to {len(self.killed)} that ignored SIGTERM)"
        if self.left:
            msg += f"; STILL ALIVE after SIGKILL: pids {self.left}"
        return msg


def teardown(proc: StageProcess, grace_s: float = 10.0, kill_wait_s: float = 30.0) -> Teardown:
    """End the stage's leader (if still running), its group and its token carriers; then reap the leader.

    Also the path of a stage that succeeded: whatever it left running is ended.
    """
    t0 = time.monotonic()
    # the leader is our unreaped child, so its start time still matches and its group is ours
    killed, left = end_stage(proc.pid, proc.start, proc.token, grace_s, kill_wait_s, proc.seen)
    # reaping the leader lets its pid be reused, so only a dead one is reaped: one alive after SIGKILL and the
    # wait (in the kernel, e.g. stuck in a GPU driver) would block the runner forever; it is reported instead,
    # and its record stays open for the next runner to end
    if proc.returncode is None and proc.pid not in left:
        proc.returncode = proc.popen.wait()
    return Teardown(proc.name, proc.returncode, killed, left, time.monotonic() - t0)


# ---------------------------------------------------------------- orphans of a killed runner

def end_orphans(rec: dict, grace_s: float = 10.0, kill_wait_s: float = 30.0) -> tuple[list[str], set[int]]:
    """End what is left of a recorded stage; returns lines for the user and the pids ended."""
    pid, start, token = rec["pid"], rec["start_ticks"], rec["token"]
    notes = []
    leader = proc_info(pid)
    if leader is not None and leader.start != start:
        notes.append(f"{rec['stage']}: pid {pid} now belongs to another process ({cmdline(pid)[:60]!r}); left alone")
    found = members(pid, start, token)
    if not found:
        return notes, set()
    notes.append(f"{rec['stage']}: ending {len(found)} orphaned process(es) of an earlier runner: pids {found}")
    seen: set[int] = set()
    _, left = end_stage(pid, start, token, grace_s, kill_wait_s, seen)
    if left:
        notes.append(f"{rec['stage']}: STILL ALIVE after SIGKILL: pids {left}")
    return notes, seen


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
    """Ctrl-C raises KeyboardInterrupt and SIGTERM/SIGHUP raise Terminated, inside the block. A hangup ignored
    already stays ignored: `nohup eyas run ... &` must outlive the terminal. (Not SIGINT: a shell without job
    control starts every background command with SIGINT ignored, and `kill -INT` must still end a run.)"""
    saved = {s: signal.signal(s, _on_signal) for s in RUNNER_SIGNALS
             if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)}
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
