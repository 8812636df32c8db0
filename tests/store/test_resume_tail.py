"""Kill -9 a real capture twice at random points, resume it, and read the store by tail() meanwhile.

The final store holds every sample exactly once and its shards are bit-identical to an uninterrupted
run; the tail reader sees shards while the capture is still writing and ends when it completes.
"""

import json
import random
import signal
import subprocess
import threading
import time

import torch

from eyas.ownership import MARKER
from eyas.store import StoreReader
from store_helpers import capture, capture_argv, make_prepared, tiny_cfg

SETS = ["capture.shard_tokens=160", "capture.token_budget=64", "capture.dtype=bf16"]


def _committed(store):
    try:
        return len(json.loads((store / "manifest.json").read_text())["shards"])
    except (OSError, ValueError):
        return 0


def _run_and_kill(argv, store, after_shards, rng):
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 120
        while _committed(store) < after_shards and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        # a random point: mid-forward, mid-write, or between shard and manifest; but at most two more
        # shards on, so that a fast machine cannot finish the capture before the kill
        until = time.time() + rng.uniform(0.0, 0.25)
        while time.time() < until and _committed(store) < after_shards + 2 and proc.poll() is None:
            time.sleep(0.002)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    return proc.returncode


def test_kill9_resume_bit_identical_and_tail(tmp_path, tiny_target, capsys):
    rng = random.Random()
    prepared = make_prepared(tmp_path / "prepared", num_samples=160, min_len=4, max_len=48, seed=3)
    ref = tmp_path / "ref"
    cfg = tiny_cfg(shard_tokens=160, token_budget=64, dtype="bf16")
    capture(cfg, prepared, ref, target=tiny_target)
    ref_manifest = json.loads((ref / "manifest.json").read_text())
    num_shards = len(ref_manifest["shards"])
    assert num_shards >= 20

    store = tmp_path / "store"
    argv = capture_argv(prepared, store, *SETS)
    codes = [_run_and_kill(argv, store, after_shards=2, rng=rng)]
    first = _committed(store)
    assert codes[0] == -signal.SIGKILL and 0 < first < num_shards

    tailed, flags = [], []

    def tail():
        reader = StoreReader(store)
        for sample in reader.tail(poll_s=0.02, timeout_s=120):
            tailed.append(sample["sample_id"])
            flags.append(reader.complete)

    tail_thread = threading.Thread(target=tail)
    tail_thread.start()
    codes.append(_run_and_kill(argv, store, after_shards=first + 3, rng=rng))
    assert codes[1] == -signal.SIGKILL
    assert _committed(store) < num_shards, "the second run finished before it was killed; make the data bigger"
    # the last rerun goes through the same resume path in this process (a third interpreter start costs ~15 s)
    assert capture(cfg, prepared, store, target=tiny_target)["complete"]
    assert "resuming" in capsys.readouterr().out
    tail_thread.join(timeout=60)
    assert not tail_thread.is_alive()

    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["complete"]
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in ref_manifest["shards"]]
    reader = StoreReader(store)
    ids = [reader[i]["sample_id"] for i in range(len(reader))]
    assert len(ids) == len(set(ids)) == 160
    assert not [p for p in store.iterdir() if p.name.startswith(".") and p.name != MARKER]
    # tail: every sample exactly once, many of them while the capture was still running
    assert sorted(tailed) == sorted(ids)
    assert flags.count(False) > 0
    first_tailed = StoreReader(store)[0]
    assert torch.equal(first_tailed["aux_hidden"], StoreReader(ref)[0]["aux_hidden"])
