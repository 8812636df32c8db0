"""Capture on CUDA (skipped without it): a real out-of-memory error from a budget forced 4x too large,
split and retried to a byte-identical store; pinned buffers reused across shards through the copy
stream; bf16 parity with an fp32 recomputation."""

import json
import sys
from pathlib import Path

import pytest
import torch

from eyas.config import load_config
from eyas.store import StoreReader
from eyas.target import load_target
from eyas.target.capture import FeatureCapture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))
from store_helpers import capture, make_prepared  # noqa: E402

pytestmark = pytest.mark.gpu


def _cfg(spec, writer_threads=0, **capture_):
    cfg = load_config("tiny", [f"target.model={spec}", "target.device=cuda"]
                      + [f"capture.{k}={v}" for k, v in capture_.items()])
    if writer_threads:
        cfg.capture.writer_threads = writer_threads
    return cfg


def _shard_hashes(store):
    return [(s["file"], s["sha256"]) for s in json.loads((store / "manifest.json").read_text())["shards"]]


def _extra_peak(run) -> int:
    """Peak device memory a call allocates beyond what is allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_budget_forced_4x_too_large_real_oom_identical_store(tmp_path):
    """Issue 9 section 2: the allocator is capped so that passes at the working budget B fit and passes at
    2B do not; a capture asked for 4B runs out of memory twice, halves to B, and writes the very bytes
    of the run at B. The cap comes from measured peaks at B/2 and B, so constant costs (workspaces) do
    not blur it."""
    target = load_target("tiny", device="cuda", dtype="bf16")
    prepared = make_prepared(tmp_path / "prepared", num_samples=256, min_len=900, max_len=1024, vocab=259)
    budget, shard_tokens = 65536, 1 << 18  # one shard holds every sample, so a forced pass reaches 4B

    def run(b, name):
        return lambda: capture(_cfg("tiny", dtype="bf16", token_budget=b, shard_tokens=shard_tokens), prepared,
                               tmp_path / name, target=target)

    run(budget // 4, "warm")()  # workspaces and kernels exist before anything is measured
    peak_half = _extra_peak(run(budget // 2, "half"))
    peak = _extra_peak(run(budget, "ref"))
    per_budget = 2 * (peak - peak_half)  # what B more tokens per pass cost
    assert per_budget > 0, (peak_half, peak)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(target.device).total_memory
    cap = torch.cuda.memory_reserved() + peak + per_budget // 2  # B fits with half a budget to spare; 2B does not
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        got = capture(_cfg("tiny", dtype="bf16", token_budget=4 * budget, shard_tokens=shard_tokens), prepared,
                      tmp_path / "big", target=target)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    detail = dict(got, peak_half=peak_half, peak=peak, cap=cap)
    assert got["complete"] and got["oom_splits"] == 2 and got["final_token_budget"] == budget, detail
    assert got["tokens"] == json.loads((tmp_path / "ref" / "summary.json").read_text())["tokens"]
    assert _shard_hashes(tmp_path / "big") == _shard_hashes(tmp_path / "ref")


def test_pinned_buffers_reused_across_shards_hold_the_right_states(tmp_path):
    """Many small shards, one writer thread, few buffers: every buffer is refilled through the copy stream
    while the writer still streams others; each stored sample must match its own batch-1 recomputation."""
    target = load_target("tiny", device="cuda", dtype="bf16")
    prepared = make_prepared(tmp_path / "prepared", num_samples=96, min_len=8, max_len=120, vocab=259)
    summary = capture(_cfg("tiny", writer_threads=1, dtype="bf16", token_budget=256, shard_tokens=300), prepared,
                      tmp_path / "s", target=target)
    assert summary["complete"] and summary["num_shards"] >= 15 and summary["staging_buffers"] == 3
    features = FeatureCapture(target, StoreReader(tmp_path / "s").aux_layers)
    reader = StoreReader(tmp_path / "s")
    for i in range(len(reader)):
        s = reader[i]
        aux, final = features(s["input_ids"][None].cuda(), None)
        for got, want in ((s["aux_hidden"], aux[0].float().cpu()), (s["final_hidden"], final[0].float().cpu())):
            assert (got - want).abs().max() <= 3e-2 * want.abs().max(), (i, s["sample_id"])


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_capture_is_deterministic_on_cuda(tmp_path, dtype):
    """Resume relies on it: the same plan and budget give byte-identical shards on the GPU too."""
    target = load_target("tiny", device="cuda", dtype="bf16")
    prepared = make_prepared(tmp_path / "prepared", num_samples=64, min_len=16, max_len=300, vocab=259)
    for name in ("a", "b"):
        capture(_cfg("tiny", dtype=dtype, token_budget=2048, shard_tokens=2000), prepared, tmp_path / name, target=target)
    assert _shard_hashes(tmp_path / "a") == _shard_hashes(tmp_path / "b")


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


def test_nonfinite_states_counted_through_the_copy_stream(tmp_path):
    """NaN states are counted per sample on the device and read by the writer from pinned memory after the
    copy stream's events: the manifest names exactly the samples whose stored states hold a NaN."""
    from store_helpers import poison_embeddings, poisoned_prepared

    target = poison_embeddings(load_target("tiny", device="cuda", dtype="bf16"))
    poisoned = {i: i % 40 for i in range(3, 200, 17)}
    prepared, _ = poisoned_prepared(tmp_path / "prepared", poisoned, num_samples=200, min_len=40, max_len=300)
    store = tmp_path / "store"
    summary = capture(_cfg("tiny", dtype="bf16", token_budget=2048, shard_tokens=8192), prepared, store, target=target)
    manifest = json.loads((store / "manifest.json").read_text())
    assert summary["nonfinite_samples"] == len(poisoned) and len(manifest["shards"]) >= 3
    flagged = {sid for rec in manifest["shards"] for sid in rec.get("nonfinite_ids", [])}
    assert flagged == {f"s{i:04d}" for i in poisoned}
    reader, counted = StoreReader(store), 0
    for i in range(len(reader)):
        s = reader[i]
        bad = ~(torch.isfinite(s["aux_hidden"]).all(-1) & torch.isfinite(s["final_hidden"]).all(-1))  # [T]
        counted += int(bad.sum())
        assert bool(bad.any()) == (s["sample_id"] in flagged)
    assert counted == sum(rec["nonfinite_tokens"] for rec in manifest["shards"])
