"""On a real GPU: a stage's memory is released after teardown (as NVML sees it), and a foreign
process holding memory makes the runner refuse and survives. Skipped without CUDA (tests/conftest.py).

These tests run first in any session (tests/conftest.py orders them): a runner started in another process
refuses GPUs on which the pytest process itself holds memory, as it would any foreign holder, and every
other GPU test leaves a CUDA context here."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.common import EyasError
from eyas.config import load_config
from eyas.gpu import nvml
from eyas.pipeline import Cmd, RunOptions, Stage, StageFailed, run_pipeline

# Holds 2 GiB on the GPU, forks a child that holds 1 GiB and ignores SIGTERM, then exits or hangs.
HOG = r"""
import os, signal, subprocess, sys, time
import torch
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time, torch; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    "y = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize();"
    "open(%r, 'w').write('ready'); time.sleep(1000)" % (sys.argv[2],)])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
os.makedirs(sys.argv[3], exist_ok=True)
if sys.argv[1] == "hang":
    time.sleep(1000)
"""

# A runner of one hog stage, to be killed with kill -9 while the stage holds GPU memory.
RUNNER = r"""
import sys
from pathlib import Path
from eyas.config import load_config
from eyas.pipeline import Cmd, RunOptions, Stage, run_pipeline
hog, mode, ready, run = sys.argv[1:5]
stage = Stage("hog", (), "hog", (), "one", lambda ctx: [Cmd([sys.executable, hog, mode, ready, run + "/hog"])])
run_pipeline(load_config("tiny"), Path(run), RunOptions(gpus=[0], echo=False), (stage,))
"""

pytestmark = pytest.mark.skipif(not nvml.available(), reason="needs NVML (an NVIDIA driver)")


def hog_stage(tmp_path: Path, mode: str, timeout_s: float = 0.0) -> Stage:
    script = tmp_path / "hog.py"
    script.write_text(HOG)
    ready = tmp_path / f"ready-{mode}"
    return Stage("hog", (), "hog", (), "one",
                 lambda ctx: [Cmd([sys.executable, str(script), mode, str(ready), str(ctx.run / "hog")])],
                 timeout_s=timeout_s)


@pytest.mark.parametrize("mode", ["ok", "hang"])
def test_stage_memory_is_released_after_teardown(tmp_path, mode):
    before = nvml.used_mib([0])[0]
    opts = RunOptions(gpus=[0], grace_s=2.0, release_timeout_s=60.0, echo=False)
    stage = hog_stage(tmp_path, mode, timeout_s=20.0 if mode == "hang" else 0.0)
    if mode == "hang":
        with pytest.raises(StageFailed, match="timed out") as err:
            run_pipeline(load_config("tiny"), tmp_path / "run", opts, (stage,))
        assert "not released" not in str(err.value)
    else:
        run_pipeline(load_config("tiny"), tmp_path / "run", opts, (stage,))
    # the runner already waited for release; check NVML ourselves as well
    assert nvml.used_mib([0])[0] - before < opts.tolerance_mib


def test_foreign_holder_makes_the_runner_refuse_and_survives(tmp_path):
    ready = tmp_path / "foreign-ready"
    foreign = subprocess.Popen([sys.executable, "-c", "import sys, time, torch; x = torch.empty(1 << 30, "
                                "dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); "
                                "open(sys.argv[1], 'w').write('ready'); time.sleep(1000)", str(ready)])
    try:
        # this pytest process may hold a CUDA context of its own (earlier GPU tests): wait for another holder
        def others():
            return [h for h in nvml.holders([0]) if h.pid != os.getpid()]

        deadline = time.monotonic() + 60
        while not (ready.exists() and others()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists() and others(), "NVML never listed the foreign process"
        opts = RunOptions(gpus=[0], echo=False)
        with pytest.raises(EyasError, match="did not start"):
            run_pipeline(load_config("tiny"), tmp_path / "run", opts, (hog_stage(tmp_path, "ok"),))
        assert foreign.poll() is None
        assert not (tmp_path / "run" / "hog").exists()
    finally:
        foreign.kill()
        foreign.wait()


def test_gpu_orphans_of_a_killed_runner_are_ended_before_the_next_stage(tmp_path):
    before = nvml.used_mib([0])[0]
    (tmp_path / "runner.py").write_text(RUNNER)
    hog_stage(tmp_path, "hang")  # writes hog.py
    ready = tmp_path / "ready-orphan"
    runner = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "hog.py"), "hang",
                               str(ready), str(tmp_path / "run")])
    deadline = time.monotonic() + 120
    while not (ready.exists() and nvml.used_mib([0])[0] - before > 2500) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready.exists(), "the stage never allocated its memory"
    runner.kill()
    runner.wait()
    assert nvml.used_mib([0])[0] - before > 2500  # the orphaned stage still holds its memory

    opts = RunOptions(gpus=[0], grace_s=2.0, release_timeout_s=60.0)
    run_pipeline(load_config("tiny"), tmp_path / "run", opts, (hog_stage(tmp_path, "ok"),))
    assert nvml.used_mib([0])[0] - before < opts.tolerance_mib
