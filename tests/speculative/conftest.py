"""One intra-op thread for the spec tests: the models here are small and per-op overhead dominates;
with several threads on a busy shared machine every tiny matmul pays for thread spinning (20x slower).
A module on SmolLM2 sets INTRA_OP_THREADS = 2: its matmuls (hidden 576, vocabulary 49152) are large
enough to share, and two threads decode about twice as fast on two cores."""

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread(request):
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(getattr(request.module, "INTRA_OP_THREADS", 1), os.cpu_count() or 1)))
    yield
    torch.set_num_threads(before)
