"""`eyas train` from a real store of the tiny target, online from prepared data, and refusals."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eyas.cli import main as eyas_main
from eyas.config import load_config


@pytest.fixture(scope="module")
def prepared_and_store(tmp_path_factory):
    import datasets

    from eyas.data.vocab import build_vocab, save_vocab
    from eyas.stages import capture

    root = tmp_path_factory.mktemp("train_cmd")
    rng = np.random.default_rng(0)
    rows = {"sample_id": [], "input_ids": [], "loss_mask": []}
    for i in range(12):
        n = int(rng.integers(16, 40))
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        rows["sample_id"].append(f"s{i}")
        rows["input_ids"].append(rng.integers(0, 256, n).tolist())
        rows["loss_mask"].append(mask)
    datasets.Dataset.from_dict(rows).save_to_disk(str(root / "prepared" / "dataset"))
    (root / "prepared" / "prepare.json").write_text(json.dumps({"source": "test", "kept": len(rows["sample_id"])}))
    counts = torch.zeros(320, dtype=torch.long)
    for ids in rows["input_ids"]:
        counts += torch.bincount(torch.tensor(ids), minlength=320)
    save_vocab(build_vocab(counts, 200), root / "prepared" / "vocab.safetensors")
    capture.run(load_config("tiny"), capture.Inputs(root / "prepared"), root / "store")
    return root


TINY = ["--config", "tiny", "--steps", "3", "--set", "train.log_every=1"]


def test_store_and_online_sources_train_the_same_draft(prepared_and_store, capsys):
    root = prepared_and_store
    assert eyas_main(["train", *TINY, "--store", str(root / "store"), "--out", str(root / "run")]) == 0
    assert eyas_main(["train", *TINY, "--source", "online", "--data", str(root / "prepared"),
                      "--out", str(root / "online")]) == 0
    out = capsys.readouterr().out
    assert "step 3/3 | loss" in out and "tok/s" in out and "GiB" in out
    a = load_file(str(root / "run" / "latest" / "model.safetensors"))
    b = load_file(str(root / "online" / "latest" / "model.safetensors"))
    vocab = load_file(str(root / "prepared" / "vocab.safetensors"))
    assert torch.equal(a["d2t"], vocab["d2t"]) and torch.equal(a["t2d"], vocab["t2d"])
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    meta = json.loads((root / "run" / "latest" / "draft.json").read_text())
    assert meta["target"]["name"] == "tiny" and meta["aux_layers"] == [1, 2, 3] and meta["store"]


@pytest.mark.parametrize("extra, words", [
    (["--target", "tiny-qwen2"], ["made for target 'tiny', not 'tiny-qwen2'", "pass --target"]),
    (["--set", "target.aux_layers=1,3"], ["holds aux layers [1, 2, 3] but the config asks for [1, 3]",
                                          "drop that setting", "eyas capture --layers 1,3"]),
])
def test_store_that_does_not_match_the_config_is_refused(prepared_and_store, extra, words, capsys):
    root = prepared_and_store
    rc = eyas_main(["train", *TINY, "--store", str(root / "store"), "--out", str(root / "refused"), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and all(w in err for w in words), err
    assert len(err.strip().splitlines()) == 1, err
    assert not (root / "refused" / "latest").exists()


def test_training_adopts_the_layers_the_store_holds(prepared_and_store, capsys):
    """`eyas capture --layers 1,3` then `eyas train --store S` trains on layers [1, 3] (no --layers again)."""
    root = prepared_and_store
    store = root / "store-1-3"
    assert eyas_main(["capture", "--config", "tiny", "--layers", "1,3", "--data", str(root / "prepared"),
                      "--out", str(store)]) == 0
    assert eyas_main(["train", *TINY, "--store", str(store), "--out", str(root / "run-1-3")]) == 0, \
        capsys.readouterr().err
    meta = json.loads((root / "run-1-3" / "latest" / "draft.json").read_text())
    assert meta["aux_layers"] == [1, 3]


def test_tail_trains_on_committed_shards_while_the_capture_runs(prepared_and_store, monkeypatch):
    """--tail takes shards as the manifest commits them: steps are taken before the store is complete."""
    import shutil
    import threading
    import time

    from eyas.common import atomic_write_json, read_json
    from eyas.stages import capture
    from eyas.train import data

    root = prepared_and_store
    full = root / "store-sharded"
    capture.run(load_config("tiny", ["capture.shard_tokens=48"]), capture.Inputs(root / "prepared"), full)
    manifest = read_json(full / "manifest.json")
    assert manifest["complete"] and len(manifest["shards"]) >= 4
    live = root / "store-live"  # the capture "so far": two shards committed, the rest to come
    shutil.copytree(full, live)
    atomic_write_json(live / "manifest.json", {**manifest, "shards": manifest["shards"][:2], "complete": False})
    monkeypatch.setattr(data, "TAIL_GROUP_BATCHES", 1)  # plan every shard as soon as it is committed

    run, result = root / "tail", {}
    args = ["train", "--config", "tiny", "--steps", "8", "--set", "train.log_every=1", "--set", "train.batch_tokens=64",
            "--store", str(live), "--out", str(run), "--tail", "--poll-s", "0.05"]
    thread = threading.Thread(target=lambda: result.update(rc=eyas_main(args)))
    thread.start()
    deadline = time.time() + 60
    while not (run / "metrics.jsonl").is_file() and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    steps_before_complete = len((run / "metrics.jsonl").read_text().splitlines()) if (run / "metrics.jsonl").is_file() else 0
    atomic_write_json(live / "manifest.json", manifest)  # the capture commits the rest and finishes
    thread.join(timeout=120)
    assert result.get("rc") == 0
    assert steps_before_complete >= 1, "training waited for the complete store instead of tailing it"
    state = json.loads((run / "latest" / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["tokens"] > 0


def test_init_from_fine_tunes_an_exported_draft(prepared_and_store, capsys):
    """`eyas train --init-from` with a speculators export (as a user fine-tunes a shared draft):
    the weights start from the export's, and the checkpoint records where they came from."""
    root = prepared_and_store
    store = ["--store", str(root / "store")]
    assert eyas_main(["train", *TINY, *store, "--out", str(root / "base")]) == 0
    assert eyas_main(["export", str(root / "base"), "--to", "speculators", "--out", str(root / "exp")]) == 0
    capsys.readouterr()
    tuned = root / "tuned"
    assert eyas_main(["train", *TINY, "--lr", "1e-12", *store, "--init-from", str(root / "exp"),
                      "--out", str(tuned)]) == 0
    assert "fine-tuning the draft of" in capsys.readouterr().out
    base, got = load_file(str(root / "base" / "latest" / "model.safetensors")), load_file(str(tuned / "latest" / "model.safetensors"))
    # the export is bf16: the fine-tuned weights are the base run's rounded to it
    torch.testing.assert_close(got["fc.weight"], base["fc.weight"].bfloat16().float(), rtol=0, atol=1e-6)
    assert json.loads((tuned / "latest" / "draft.json").read_text())["init_from"] == str(root / "exp")
    rc = eyas_main(["train", *TINY, *store, "--init-from", str(root / "nowhere"), "--out", str(root / "bad")])
    assert rc == 2 and "no such file or directory" in capsys.readouterr().err
    rc = eyas_main(["train", *TINY, *store, "--init-from", str(root / "exp"), "--out", str(root / "bad"),
                    "--vocab", str(root / "prepared" / "vocab.safetensors")])
    assert rc == 2 and "--vocab has no effect" in capsys.readouterr().err
    rc = eyas_main(["train", *TINY, *store, "--init-from", str(root / "base" / "latest"), "--out", str(root / "base")])
    assert rc == 2 and "would replace it; write the fine-tuned draft to another --out" in capsys.readouterr().err
    assert load_file(str(root / "base" / "latest" / "model.safetensors"))["fc.weight"].equal(base["fc.weight"])
    assert not (root / "bad" / "latest").exists()
