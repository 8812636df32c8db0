"""A reader with check_sha256 (training's) uses a shard only once its sha256 matched the manifest's: a changed
byte stops the read that reaches it (or any later read) with the shard named, also for a shard committed
after the reader opened (tailing a capture)."""

import json
import shutil
import struct
import time

import pytest

from eyas.common import EyasError, atomic_write_json
from eyas.store.reader import StoreReader
from store_helpers import capture, tiny_cfg


def flip_byte(shard, tensor: str = "final_hidden") -> None:
    """Invert the first byte of `tensor`'s data in a safetensors file (its header stays valid)."""
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n + json.loads(raw[8:8 + n])[tensor]["data_offsets"][0]
    raw[start] ^= 0xFF
    shard.write_bytes(bytes(raw))


@pytest.fixture
def sharded_store(tmp_path, prepared):
    store = tmp_path / "store"
    capture(tiny_cfg(shard_tokens=200), prepared, store)
    manifest = json.loads((store / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 3
    return store, manifest


def samples_of(reader, pos):
    first = reader._starts[pos]
    return range(first, first + reader.shards[pos]["num_samples"])


def test_an_intact_store_reads_the_same_with_and_without_checks(sharded_store):
    store, _ = sharded_store
    plain, checked = StoreReader(store), StoreReader(store, check_sha256=True)
    for i in range(len(plain)):
        a, b = plain[i], checked[i]
        assert a["sample_id"] == b["sample_id"] and a["final_hidden"].equal(b["final_hidden"])
    checked.close()


def test_a_changed_byte_stops_the_read_and_names_the_shard(sharded_store):
    store, manifest = sharded_store
    bad = store / manifest["shards"][1]["file"]
    flip_byte(bad)
    reader = StoreReader(store, check_sha256=True)
    pos = next(p for p, rec in enumerate(reader.shards) if rec["file"] == bad.name)
    with pytest.raises(EyasError, match=rf"{bad.name}: its sha256 differs .* `eyas verify {store}`"):
        reader[samples_of(reader, pos)[0]]
    # once known, every later read stops too: no other batch is trained on after the mismatch
    good = next(p for p in range(len(reader.shards)) if p != pos)
    with pytest.raises(EyasError, match=bad.name):
        reader[samples_of(reader, good)[0]]
    reader.close()


def test_the_background_thread_finds_a_mismatch_in_a_shard_not_read_yet(sharded_store):
    store, manifest = sharded_store
    last = store / manifest["shards"][-1]["file"]
    flip_byte(last, "aux_hidden")
    reader = StoreReader(store, check_sha256=True)
    deadline = time.monotonic() + 30
    while reader.checksums.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    pos = next(p for p, rec in enumerate(reader.shards) if rec["file"] != last.name)
    with pytest.raises(EyasError, match=last.name):
        reader[samples_of(reader, pos)[0]]
    reader.close()


def test_a_shard_committed_while_tailing_is_checked_before_use(sharded_store, tmp_path):
    store, manifest = sharded_store
    live = tmp_path / "live"
    shutil.copytree(store, live)
    atomic_write_json(live / "manifest.json", {**manifest, "shards": manifest["shards"][:1], "complete": False})
    reader = StoreReader(live, check_sha256=True)
    assert len(reader.shards) == 1 and reader[0]["sample_id"]
    flip_byte(live / manifest["shards"][1]["file"])
    atomic_write_json(live / "manifest.json", manifest)
    reader.refresh()
    with pytest.raises(EyasError, match=manifest["shards"][1]["file"]):
        reader[samples_of(reader, 1)[0]]
    reader.close()
