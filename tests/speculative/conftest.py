"""One intra-op thread for the spec tests: the models here are small and per-op overhead dominates;
with several threads on a busy shared machine every tiny matmul pays for thread spinning (20x slower)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
