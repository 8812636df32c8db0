"""Shared fixtures. The SmolLM2 target is loaded once per test session (from the eyas cache)."""

import os

# OpenMP threads that wait for work sleep instead of spinning. The suite runs two workers on two cores, and most
# tests start processes of their own (eyas stages, vLLM engines): spinning threads then take the cores from the
# threads doing work. Two heavy tests side by side on two cores (tests/pipeline/test_pipeline_tiny.py's two-family
# run beside tests/vllm/test_run_engine.py's run, twice each way): 127-160 s and 136-157 s spinning, 72-74 s and
# 92-107 s sleeping; alone, each setting ran the pipeline test in 60-67 s. Set before torch loads its OpenMP
# runtime, which reads it once; the processes tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# two threads per test process; under pytest-xdist the cores are shared out between the workers
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # the teardown tests start runners in other processes, to which this one is a foreign GPU holder
        # (they refuse to start a stage) once a CUDA test has run here: run them before any other test
        items.sort(key=lambda item: "test_teardown_gpu" not in str(item.fspath))  # stable: keeps the rest's order
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/") or item.get_closest_marker("gpu"):
            item.add_marker(skip)
    # `make test` hands whole files to two workers in this order, the longest first (measured no faster than xdist's
    # own order by test count, 921 s against 924 s, but it keeps the long tests from all starting last)
    items.sort(key=lambda item: _rank(str(item.fspath)))  # stable


# the files that take longest on two cores, longest first (about 40 to 200 s each); the rest follow in their order
LONGEST = ["speculative/test_lossless_trained.py", "vllm/test_run_engine.py", "pipeline/test_pipeline_tiny.py",
           "vllm/test_capture_store.py", "vllm/test_engine_service.py", "vllm/test_exports_vllm.py",
           "vllm/test_eval_vllm.py", "target/test_load.py", "vllm/test_capture_deepseek_v3.py"]


# files that share a session's vLLM engine (tests/vllm/conftest.py): `make test` hands each set to one worker, where
# the engine starts once (a start costs 20-60 s of the two cores); apart, each worker would start its own
SHARE_A_WORKER = [("vllm/test_capture_smollm2.py", "vllm/test_engine_service.py"),  # smollm2_features
                  ("vllm/test_eval_vllm.py", "vllm/test_exports_vllm.py"),  # tiny_llama_plain, tiny_llama_eagle3
                  ("vllm/test_capture_store.py", "vllm/test_capture_tiny_llama.py")]  # tiny_llama_features


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the files of each SHARE_A_WORKER set as one unit of work."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    unit = {f"tests/{name}": f"tests/{names[0]}" for names in SHARE_A_WORKER for name in names}

    class SharedEngines(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return unit.get(scope, scope)

    return SharedEngines(config, log)


def _rank(path: str) -> int:
    path = path.replace(os.sep, "/")
    return next((i for i, name in enumerate(LONGEST) if path.endswith("tests/" + name)), len(LONGEST))


@pytest.fixture(scope="session")
def smollm2():
    """The real default target, fp32 on CPU."""
    from eyas.target import load_target

    return load_target("smollm2", device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_target():
    from eyas.target import load_target

    return load_target("tiny", device="cpu", dtype="fp32")
