"""Captured states with NaN or inf: capture counts them per sample, the manifest names the samples, training
skips them (whole store and tailing), verify reports them, and a store of nothing else is refused."""

import json

import pytest
import torch

from eyas.common import EyasError

from eyas.store.reader import StoreReader
from eyas.stages.verify import run as verify_store
from eyas.train.source import GrowingStore, store_source

from store_helpers import capture, poison_embeddings, poisoned_prepared, tiny_cfg


@pytest.fixture
def overflowing_target():
    from eyas.target import load_target

    return poison_embeddings(load_target("tiny", device="cpu", dtype="fp32"))


def test_capture_counts_skips_and_reports(tmp_path, overflowing_target, tiny_target):
    poisoned = {3: 5, 11: 0, 16: 7}
    prepared, lengths = poisoned_prepared(tmp_path / "prepared", poisoned)
    store = tmp_path / "store"
    summary = capture(tiny_cfg(shard_tokens=120, token_budget=64), prepared, store, target=overflowing_target)
    assert summary["complete"] and summary["nonfinite_samples"] == 3

    manifest = json.loads((store / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 3
    flagged, tokens = {}, 0
    reader = StoreReader(store)
    for rec in manifest["shards"]:
        tokens += rec["nonfinite_tokens"]
        for j, sid in zip(rec["nonfinite_samples"], rec.get("nonfinite_ids", [])) if "nonfinite_samples" in rec else ():
            flagged[sid] = j
        assert ("nonfinite_samples" in rec) == (rec["nonfinite_tokens"] > 0)
    assert sorted(flagged) == [f"s{i:04d}" for i in sorted(poisoned)]
    # the count is of the tokens whose stored states hold a NaN: attention carries it at least to every
    # later token (SDPA's masked scores of a NaN key may carry it to the earlier ones too)
    counted = 0
    for i in range(len(reader)):
        s = reader[i]
        bad = ~(torch.isfinite(s["aux_hidden"]).all(-1) & torch.isfinite(s["final_hidden"]).all(-1))  # [T]
        counted += int(bad.sum())
        assert bool(bad.any()) == (s["sample_id"] in flagged), s["sample_id"]
        row = int(s["sample_id"][1:])
        if row in poisoned:
            assert bool(bad[poisoned[row]:].all())
    assert tokens == counted >= sum(lengths[i] - p for i, p in poisoned.items())

    # training over the whole store never sees them
    source = store_source(store)
    assert len(source.lengths) == len(source.samples) == 17
    seen = [source.samples[i]["sample_id"] for i in range(len(source.samples))]
    assert sorted(seen) == sorted(f"s{i:04d}" for i in range(20) if i not in poisoned)
    assert [len(source.samples[i]["input_ids"]) for i in range(17)] == source.lengths
    train, held = source.held_out_split(2, seed=0)
    assert len(train) + len(held) == 17

    # nor does training that tails the store
    growing = GrowingStore(StoreReader(store), poll_s=0.01, timeout_s=5)
    indices = [g for i in range(growing.num_shards) for g in growing.wait_shard(i)]
    assert indices == list(range(17)) and len(growing.lengths) == 17
    assert sorted(growing.skipped) == sorted(flagged)
    assert sorted(growing[g]["sample_id"] for g in indices) == sorted(seen)
    assert all(torch.isfinite(growing[g]["aux_hidden"]).all() for g in indices)

    report = verify_store(store, num_samples=0)
    assert report["problems"] == [] and sorted(report["nonfinite_ids"]) == sorted(flagged)
    # recomputing with the target as it should be: the flagged samples are listed, not judged
    report = verify_store(store, target=tiny_target, num_samples=20)
    assert report["problems"] == [] and len({row["sample"] for row in report["layers"]}) == 17
    assert not {row["sample_id"] for row in report["layers"]} & set(flagged)


def test_a_store_of_only_nonfinite_states_is_refused(tmp_path, overflowing_target):
    prepared, _ = poisoned_prepared(tmp_path / "prepared", {i: 1 for i in range(4)}, num_samples=4)
    store = tmp_path / "store"
    summary = capture(tiny_cfg(shard_tokens=60, token_budget=64), prepared, store, target=overflowing_target)
    assert summary["nonfinite_samples"] == 4
    with pytest.raises(EyasError, match="every sample .* hold NaN or inf"):
        store_source(store)
    growing = GrowingStore(StoreReader(store), poll_s=0.01, timeout_s=5)  # training that tails it
    with pytest.raises(EyasError, match="every sample .* hold NaN or inf"):
        for i in range(growing.num_shards):
            growing.wait_shard(i)


def test_large_finite_fp16_states_are_not_counted(tmp_path):
    """fp16 states whose sum passes 65504 with every value finite (massive activations) are not NaN or inf."""
    from eyas.target import load_target

    target = load_target("tiny", device="cpu", dtype="fp16")
    target.embed_tokens.register_forward_hook(lambda module, args, out: out * 0 + 500.0)
    prepared, _ = poisoned_prepared(tmp_path / "prepared", {}, num_samples=4)
    store = tmp_path / "store"
    summary = capture(tiny_cfg(shard_tokens=60, token_budget=64, dtype="fp32"), prepared, store, target=target)
    sample = StoreReader(store)[0]
    assert float(sample["aux_hidden"][0].sum()) > 65504 and bool(torch.isfinite(sample["aux_hidden"]).all())
    assert summary["nonfinite_samples"] == 0


def test_clean_capture_records_zero(tmp_path, tiny_target):
    prepared, _ = poisoned_prepared(tmp_path / "prepared", {}, num_samples=6)
    store = tmp_path / "store"
    summary = capture(tiny_cfg(shard_tokens=60, token_budget=64), prepared, store, target=tiny_target)
    manifest = json.loads((store / "manifest.json").read_text())
    assert summary["nonfinite_samples"] == 0
    assert all(rec["nonfinite_tokens"] == 0 and "nonfinite_samples" not in rec for rec in manifest["shards"])
    assert len(store_source(store).samples) == 6
