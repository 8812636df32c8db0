"""The store on disk: layout, manifest, round trip against the hooks, dtypes and sizes, refusal, rank split."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eyas.common import EyasError
from eyas.ownership import MARKER
from eyas.store import StoreReader
from eyas.data.prepared import load_prepared_arrays
from eyas.target.capture import FeatureCapture

from store_helpers import capture, make_prepared, tiny_cfg


def test_round_trip_layout_and_manifest(tmp_path, prepared, tiny_target):
    store = tmp_path / "store"
    summary = capture(tiny_cfg(shard_tokens=200, token_budget=128), prepared, store, target=tiny_target)
    data = load_prepared_arrays(prepared)
    assert summary["complete"] and summary["num_samples"] == len(data) == 24
    assert summary["num_tokens"] == int(data.offsets[-1]) and summary["num_shards"] >= 3

    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["schema_version"] == 2 and manifest["complete"] is True
    assert manifest["aux_layers"] == [1, 2, 3] and manifest["final_hidden"] == "post_norm"
    assert manifest["target"] == tiny_target.identity and manifest["dtype"] == "fp32"
    assert manifest["token_budget"] == 128  # reused on resume
    assert manifest["target_config"]["hidden_size"] == 64 and manifest["target_config"]["num_hidden_layers"] == 4
    assert sum(s["num_tokens"] for s in manifest["shards"]) == manifest["num_tokens"]
    assert sorted(p.name for p in store.iterdir()) == sorted(
        [MARKER, "manifest.json", "summary.json", "target_head.safetensors"] + [s["file"] for s in manifest["shards"]])
    head = load_file(store / "target_head.safetensors")
    assert torch.equal(head["embed_tokens.weight"], tiny_target.embed_tokens.weight)
    assert torch.equal(head["lm_head.weight"], tiny_target.lm_head.weight)
    with safe_open(str(store / manifest["shards"][0]["file"]), "pt") as f:  # packed: no padding
        t = manifest["shards"][0]["num_tokens"]
        assert f.get_slice("aux_hidden").get_shape() == [t, 3 * 64]
        assert f.get_slice("final_hidden").get_shape() == [t, 64]
        assert int(f.get_tensor("offsets")[-1]) == t

    reader = StoreReader(store)
    assert len(reader) == 24
    features = FeatureCapture(tiny_target, [1, 2, 3])
    seen = set()
    for i in range(len(reader)):
        s = reader[i]
        row = data.sample_ids.index(s["sample_id"])
        assert torch.equal(s["input_ids"], torch.from_numpy(data.input_ids(row)))
        assert torch.equal(s["loss_mask"], torch.from_numpy(data.loss_mask(row)).long())
        aux, final = features(s["input_ids"][None], None)
        torch.testing.assert_close(s["aux_hidden"], aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s["final_hidden"], final[0], rtol=1e-5, atol=1e-5)
        seen.add(s["sample_id"])
    assert seen == set(data.sample_ids)
    parts = [reader.indices(r, 3) for r in range(3)]
    assert sorted(sum(parts, [])) == list(range(24)) and max(map(len, parts)) - min(map(len, parts)) <= 1


def test_dtypes_sizes_and_error(tmp_path, prepared, tiny_target):
    reference = StoreReader(_capture(tmp_path / "fp32", prepared, tiny_target, "fp32"))
    sizes = {}
    bf16, fp8 = 1e-2, 7e-2  # largest relative error of a stored layer
    for dtype, aux_tol, final_tol in (("bf16", bf16, bf16), ("fp8", fp8, fp8), ("fp8-aux", fp8, bf16)):
        store = _capture(tmp_path / dtype, prepared, tiny_target, dtype)
        reader = StoreReader(store)
        sizes[dtype] = reader.manifest["num_bytes"] / reader.manifest["num_tokens"]
        for i in (0, 7, 23):
            got, ref = reader[i], reference[i]
            assert got["sample_id"] == ref["sample_id"] and got["aux_hidden"].dtype == torch.float32
            for key, tol in (("aux_hidden", aux_tol), ("final_hidden", final_tol)):
                err = (got[key] - ref[key]).abs().max() / ref[key].abs().max()
                assert 0 < err < tol, (dtype, key, err)
        assert StoreReader(store, dtype=torch.bfloat16)[0]["final_hidden"].dtype == torch.bfloat16
    fp32 = reference.manifest["num_bytes"] / reference.manifest["num_tokens"]
    # 4 x 64 states per token: 1024 B in fp32, 512 in bf16, 256 + 16 B of scales in fp8, and in fp8-aux
    # 192 + 12 B of scales for the three auxiliary layers and 128 for the final one (+ ids, masks, headers)
    assert 1024 < fp32 < 1100 and 512 < sizes["bf16"] < 560 and 272 < sizes["fp8"] < 310
    assert 332 < sizes["fp8-aux"] < 370


def _capture(store, prepared, target, dtype, **kw):
    capture(tiny_cfg(dtype=dtype, shard_tokens=300, **kw), prepared, store, target=target)
    return store


def test_reader_refuses_other_target_or_layers(tmp_path, prepared, tiny_target):
    store = _capture(tmp_path / "s", prepared, tiny_target, "fp32")
    StoreReader(store, expect={"aux_layers": [1, 2, 3], "target": tiny_target.identity})
    other = dict(tiny_target.identity, name="other", config_hash="0" * 16)
    with pytest.raises(EyasError) as e:
        StoreReader(store, expect={"aux_layers": [2, 3], "target": other, "dtype": "fp32"})
    msg = str(e.value)
    assert "aux_layers: expected [2, 3], found [1, 2, 3]" in msg and "target: expected" in msg and "dtype" not in msg


def test_rerun_with_other_settings_is_refused(tmp_path, prepared, tiny_target):
    store = _capture(tmp_path / "s", prepared, tiny_target, "fp32")
    with pytest.raises(EyasError, match="differs in: dtype"):
        _capture(store, prepared, tiny_target, "bf16")
    other = make_prepared(tmp_path / "other", num_samples=10, seed=5)
    with pytest.raises(EyasError, match="plan"):
        _capture(store, other, tiny_target, "fp32")


def test_resume_in_another_compute_dtype_is_refused(tmp_path, prepared, tiny_target):
    """An fp32 store resumed by a bf16 target would hold states of two precisions."""
    from eyas.target import load_target

    store = _capture(tmp_path / "s", prepared, tiny_target, "fp32")
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["compute_dtype"] == "float32"
    bf16_target = load_target("tiny", device="cpu", dtype="bf16")
    with pytest.raises(EyasError, match="differs in: compute_dtype.*computed in float32, this run computes in bfloat16"):
        _capture(store, prepared, bf16_target, "fp32")
    assert _capture(store, prepared, tiny_target, "fp32") == store  # the same dtype resumes (nothing left to do)


def test_token_budget_from_ram_and_batches_by_tokens(tiny_target):
    import numpy as np

    from eyas.store.batching import auto_token_budget, plan_shards, token_batches

    small = auto_token_budget(tiny_target, 3, max_len=40, ram_budget_gb=0.001)
    large = auto_token_budget(tiny_target, 3, max_len=40, ram_budget_gb=0.1)
    assert 40 <= small < large <= 16384
    lengths = np.array([5, 40, 12, 40, 7, 30])
    shards = plan_shards(lengths, shard_tokens=60)
    assert [s.tolist() for s in shards] == [[1], [3], [5, 2, 4, 0]]  # longest first, ties by row, <= 60 tokens
    batches = token_batches(np.array([1, 3, 5, 2, 4, 0]), lengths, budget=80)
    assert [b.tolist() for b in batches] == [[1, 3], [5, 2], [4, 0]]  # count x longest <= 80
