"""Fixtures for store tests."""

import pytest
import torch
from store_helpers import make_prepared


@pytest.fixture(autouse=True)
def one_thread():
    """Store tests run many tiny forward passes; on a loaded 2-core machine two OpenMP threads spin against
    each other and make each small matmul ~40x slower, so these tests use one (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def prepared(tmp_path):
    return make_prepared(tmp_path / "prepared")
