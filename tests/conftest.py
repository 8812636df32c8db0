"""Shared fixtures. The SmolLM2 target is loaded once per test session (from the eyas cache)."""

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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


@pytest.fixture(scope="session")
def smollm2():
    """The real default target, fp32 on CPU."""
    from eyas.target import load_target

    return load_target("smollm2", device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_target():
    from eyas.target import load_target

    return load_target("tiny", device="cpu", dtype="fp32")
