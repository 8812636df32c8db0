"""Data-parallel capture: 2 CPU processes under torchrun (gloo), each writing its own shards, one merged manifest."""

import json
import subprocess
import sys

import torch

from eyas.store import StoreReader
from store_helpers import capture, make_prepared, tiny_cfg


def test_two_ranks_write_their_shards_and_merge(tmp_path, tiny_target):
    prepared = make_prepared(tmp_path / "prepared", num_samples=40, seed=7)
    ref = tmp_path / "ref"
    capture(tiny_cfg(shard_tokens=150, token_budget=128), prepared, ref, target=tiny_target)
    store = tmp_path / "store"
    boot = "import sys, torch; torch.set_num_threads(1); from eyas.cli import main; sys.exit(main(sys.argv[1:]))"
    script = tmp_path / "boot.py"
    script.write_text(boot + "\n")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(script), "capture", "--config", "tiny", "--set", "target.device=cpu", "--data", str(prepared),
            "--out", str(store), "--set", "capture.shard_tokens=150", "--set", "capture.token_budget=128"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 of 2" in done.stdout and done.stdout.count("captured ") == 1  # rank 0 prints

    manifest = json.loads((store / "manifest.json").read_text())
    ref_manifest = json.loads((ref / "manifest.json").read_text())
    assert manifest["complete"] and not list(store.glob("manifest.rank-*.json"))
    assert [s["index"] for s in manifest["shards"]] == list(range(len(ref_manifest["shards"])))
    assert manifest["num_samples"] == 40 and manifest["num_tokens"] == ref_manifest["num_tokens"]
    a, b = StoreReader(store), StoreReader(ref)
    ids = [a[i]["sample_id"] for i in range(len(a))]
    assert len(set(ids)) == 40
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["sample_id"] == y["sample_id"] and torch.equal(x["loss_mask"], y["loss_mask"])
        torch.testing.assert_close(x["aux_hidden"], y["aux_hidden"], rtol=1e-5, atol=1e-5)
