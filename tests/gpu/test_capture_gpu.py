"""Capture on CUDA: a real out-of-memory error split and retried, and bf16 parity (skipped without CUDA)."""

import sys
from pathlib import Path

import pytest
import torch

from eyas.config import load_config
from eyas.store import StoreReader, capture
from eyas.target import load_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))
from store_helpers import make_prepared  # noqa: E402

pytestmark = pytest.mark.gpu


def _cfg(spec, **capture_):
    return load_config("tiny", [f"target.spec={spec}", "target.device=cuda"]
                       + [f"capture.{k}={v}" for k, v in capture_.items()])


def test_real_oom_is_split_and_retried(tmp_path):
    target = load_target("tiny", device="cuda", dtype="bf16")
    prepared = make_prepared(tmp_path / "prepared", num_samples=256, min_len=900, max_len=1024, vocab=259)
    ref = capture(_cfg("tiny", dtype="bf16", token_budget=4096, shard_tokens=1 << 18), prepared, tmp_path / "ref",
                  target=target)
    assert ref["oom_splits"] == 0
    # cap this process's allocator a little above what it holds, then ask for every sample in one pass
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (96 << 20)) / total)
    try:
        got = capture(_cfg("tiny", dtype="bf16", token_budget=1 << 20, shard_tokens=1 << 18), prepared,
                      tmp_path / "big", target=target)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert got["oom_splits"] >= 1 and got["complete"] and got["num_tokens"] == ref["num_tokens"]
    a, b = StoreReader(tmp_path / "ref"), StoreReader(tmp_path / "big")
    for i in (0, 100, 255):
        assert a[i]["sample_id"] == b[i]["sample_id"]
        torch.testing.assert_close(a[i]["aux_hidden"], b[i]["aux_hidden"], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("spec", ["tiny-qwen2", "smollm2"])
def test_bf16_capture_matches_fp32_reference(tmp_path, spec):
    try:
        target = load_target(spec, device="cuda", dtype="bf16")
    except Exception as e:  # noqa: BLE001 -- smollm2 needs its wheel on the GPU machine
        pytest.skip(f"{spec} not loadable here: {e}")
    prepared = make_prepared(tmp_path / "prepared", num_samples=12, min_len=16, max_len=200,
                             vocab=min(target.vocab_size, 32000))
    summary = capture(_cfg(spec, dtype="auto", token_budget=1024), prepared, tmp_path / "s", target=target)
    assert summary["dtype"] == "bf16"  # auto is bf16 on CUDA
    reference = target.model.float()
    reader = StoreReader(tmp_path / "s")
    n, h, aux = target.num_layers, target.hidden_size, reader.aux_layers
    for i in range(len(reader)):
        s = reader[i]
        hs = reference(input_ids=s["input_ids"][None].cuda(), output_hidden_states=True).hidden_states
        for j, k in enumerate(aux):
            want = hs[k][0].cpu()
            err = (s["aux_hidden"][:, j * h:(j + 1) * h] - want).abs().max() / want.abs().max()
            assert err < 3e-2, (spec, k, float(err))
        want = hs[n][0].cpu()
        assert (s["final_hidden"] - want).abs().max() / want.abs().max() < 3e-2
