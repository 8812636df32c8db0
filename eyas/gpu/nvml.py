"""What NVML says about the GPUs: memory in use and the processes holding it.

`pynvml` (from the `nvidia-ml-py` package) is imported inside the functions, and every function
works on a machine without an NVIDIA driver: `available()` is then False and the queries return
nothing. Device indices are NVML's, which follow PCI bus order; stage processes get
`CUDA_DEVICE_ORDER=PCI_BUS_ID` so that CUDA numbers the devices the same way.

Waiting is done by polling with short intervals up to a deadline, never by fixed sleeps.
"""

from __future__ import annotations

import pwd
import time
from dataclasses import dataclass
from pathlib import Path

from eyas.gpu.procs import cmdline

MIB = 1024 * 1024
_state: dict = {}


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    used_mib: float
    total_mib: float
    uuid: str = ""  # "GPU-8c1f...", as CUDA_VISIBLE_DEVICES may name it


@dataclass(frozen=True)
class Holder:
    device: int
    pid: int
    user: str
    cmdline: str
    used_mib: float | None  # None: the driver does not say (e.g. without permission)


def _nvml():
    """The initialised pynvml module, or None (the reason is kept for `why_unavailable`)."""
    if "module" not in _state:
        try:
            import pynvml

            pynvml.nvmlInit()
            _state["module"] = pynvml
        except ImportError:
            _state["module"] = None
            _state["why"] = "the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
        except Exception as e:  # pynvml.NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            _state["module"], _state["why"] = None, f"no NVIDIA driver or GPU found (NVML: {e})"
    return _state["module"]


def available() -> bool:
    return _nvml() is not None


def why_unavailable() -> str:
    _nvml()
    return _state.get("why", "")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpus() -> list[Gpu]:
    nv = _nvml()
    if nv is None:
        return []
    found = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        try:
            uuid = _text(nv.nvmlDeviceGetUUID(h))
        except Exception:  # noqa: BLE001 -- only CUDA_VISIBLE_DEVICES by UUID needs it
            uuid = ""
        found.append(Gpu(i, _text(nv.nvmlDeviceGetName(h)), mem.used / MIB, mem.total / MIB, uuid))
    return found


def used_mib(devices: list[int]) -> dict[int, float]:
    nv = _nvml()
    if nv is None:
        return {}
    return {d: nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(d)).used / MIB for d in devices}


def _user(pid: int) -> str:
    try:
        return pwd.getpwuid(Path(f"/proc/{pid}").stat().st_uid).pw_name
    except (OSError, KeyError):
        return "?"  # gone, or a pid of another pid namespace (containers see host pids here)


def holders(devices: list[int] | None = None) -> list[Holder]:
    """Processes with memory on the given devices (all when None), one row per device and pid."""
    nv = _nvml()
    if nv is None:
        return []
    if devices is None:
        devices = list(range(nv.nvmlDeviceGetCount()))
    rows = []
    for d in devices:
        h = nv.nvmlDeviceGetHandleByIndex(d)
        procs = {}
        for query in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                for p in query(h):
                    procs.setdefault(p.pid, p)
            except Exception:  # not supported on this device/driver
                pass
        for pid, p in sorted(procs.items()):
            mem = getattr(p, "usedGpuMemory", None)
            rows.append(Holder(d, pid, _user(pid), cmdline(pid), mem / MIB if mem is not None else None))
    return rows


def format_holders(rows: list[Holder]) -> str:
    lines = [f"{'gpu':>3}  {'pid':>8}  {'user':<12} {'MiB':>8}  command line"]
    for r in rows:
        mib = f"{r.used_mib:.0f}" if r.used_mib is not None else "?"
        lines.append(f"{r.device:>3}  {r.pid:>8}  {r.user[:12]:<12} {mib:>8}  {r.cmdline[:100]}")
    return "\n".join(lines)


def wait_for_free(devices: list[int], ours: set[int], timeout_s: float, poll_s: float = 1.0) -> list[Holder]:
    """Poll until no process outside `ours` holds memory on `devices`; returns the holders left at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        foreign = [h for h in holders(devices) if h.pid not in ours]
        if not foreign or time.monotonic() >= deadline:
            return foreign
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def wait_released(devices: list[int], pids: set[int], baseline: dict[int, float] | None, tolerance_mib: float,
                  timeout_s: float, poll_s: float = 0.2) -> str | None:
    """Poll until no pid of `pids` holds memory on `devices` and each device's used memory is within
    `tolerance_mib` of `baseline` (not checked when None). Returns None when released, else a report."""
    if not devices or not available():
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        still = [h for h in holders(devices) if h.pid in pids]
        used = used_mib(devices)
        base = baseline if baseline is not None else used
        over = {d: used[d] - base.get(d, 0.0) for d in devices if used[d] - base.get(d, 0.0) > tolerance_mib}
        if not still and not over:
            return None
        if time.monotonic() >= deadline:
            lines = [f"GPU memory not released {timeout_s:.0f} s after teardown:"]
            lines += [f"  gpu {d}: {mib:.0f} MiB above the {base.get(d, 0.0):.0f} MiB used before the stage"
                      for d, mib in over.items()]
            if still:
                lines.append("  processes of the stage still holding memory:\n" + format_holders(still))
            others = [h for h in holders(devices) if h.pid not in pids]
            if others:
                lines.append("  other processes on these GPUs:\n" + format_holders(others))
            return "\n".join(lines)
        time.sleep(poll_s)
