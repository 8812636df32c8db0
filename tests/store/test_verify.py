"""`eyas verify`: a good store passes; a flipped byte, or states that disagree with the target, fail."""

import json

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyas.cli import main
from eyas.common import sha256_file

from store_helpers import capture, tiny_cfg


def _store(tmp_path, prepared, target, dtype="fp32"):
    store = tmp_path / f"store-{dtype}"
    capture(tiny_cfg(shard_tokens=200, token_budget=256, dtype=dtype), prepared, store, target=target)
    return store


@pytest.mark.parametrize("dtype, final_tol", [("fp8", 0.1), ("fp8-aux", 0.01)])
def test_verify_passes_and_prints_errors_per_layer(tmp_path, prepared, tiny_target, capsys, dtype, final_tol):
    store = _store(tmp_path, prepared, tiny_target, dtype)
    assert main(["verify", str(store), "--samples", "3"]) == 0
    out = capsys.readouterr().out
    assert "recomputed 3 sample(s)" in out and out.rstrip().endswith("OK")
    for layer in ("aux 1", "aux 2", "aux 3", "final"):
        line = next(x for x in out.splitlines() if x.strip().startswith(layer))
        rel = float(line.split()[-1])
        assert 0 < rel < (final_tol if layer == "final" else 0.1)  # fp8 is lossy but close, bf16 closer


def test_verify_catches_a_flipped_byte(tmp_path, prepared, tiny_target, capsys):
    store = _store(tmp_path, prepared, tiny_target)
    shard = store / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) - 100] ^= 0x01
    shard.write_bytes(bytes(data))
    assert main(["verify", str(store), "--samples", "0"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH: shard-00001.safetensors: sha256 differs" in out and "FAILED" in out


def _rewrite_states(store, edit):
    """Apply edit(tensors) to every shard and update the checksums, as a capture that stored them would."""
    manifest = json.loads((store / "manifest.json").read_text())
    for rec in manifest["shards"]:
        path = store / rec["file"]
        tensors = load_file(path)
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        edit(tensors)
        save_file(tensors, str(path), metadata=meta)
        rec["sha256"], rec["bytes"] = sha256_file(path), path.stat().st_size
    (store / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_verify_recomputation_catches_wrong_states(tmp_path, prepared, tiny_target, capsys):
    """A shard whose checksum was updated with its content (so files look fine) but whose states are wrong."""
    store = _store(tmp_path, prepared, tiny_target)

    def off_by_5_percent(tensors):
        h = 64
        tensors["aux_hidden"][:, h:2 * h] *= 1.05  # aux layer 2

    _rewrite_states(store, off_by_5_percent)
    assert main(["verify", str(store), "--samples", "2"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH: sample" in out and "aux 2: relative error" in out
    assert "aux 1: relative" not in out and "final: relative" not in out


def test_verify_fails_on_nan_states(tmp_path, prepared, tiny_target, capsys):
    store = _store(tmp_path, prepared, tiny_target)

    def nan(tensors):
        tensors["final_hidden"][3, 5] = float("nan")

    _rewrite_states(store, nan)
    assert main(["verify", str(store), "--samples", "100"]) == 1
    out = capsys.readouterr().out
    assert "final: NaN or inf" in out and "FAILED" in out


def test_verify_catches_another_layers_states(tmp_path, prepared, tiny_target, capsys):
    """The states of another layer are close by the largest value (a few huge activations set it) but not token
    by token: the per-token check names them."""
    store = _store(tmp_path, prepared, tiny_target)
    manifest = json.loads((store / "manifest.json").read_text())
    h, layers = manifest["hidden_size"], manifest["aux_layers"]

    def final_as_last_aux(tensors):  # the final norm's input stored as its output: a layer off by one step
        last = tensors["aux_hidden"][:, (len(layers) - 1) * h:]
        tensors["aux_hidden"][:, (len(layers) - 1) * h:] = last * 1.0005 + tensors["final_hidden"].to(last.dtype)

    _rewrite_states(store, final_as_last_aux)
    assert main(["verify", str(store), "--samples", "2"]) == 1
    out = capsys.readouterr().out
    assert f"aux {layers[-1]}: each token's state differs" in out or f"aux {layers[-1]}: relative error" in out


def test_capture_command_flags_then_verify(tmp_path, prepared, capsys):
    store = tmp_path / "cli"
    argv = ["capture", "--config", "tiny", "--device", "cpu", "--data", str(prepared), "--out", str(store),
            "--layers", "1,3", "--dtype", "bf16", "--token-budget", "64", "--shard-tokens", "100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "layers [1, 3] + final (post-norm), bf16" in out and "B/token" in out and "complete" in out
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["aux_layers"] == [1, 3] and manifest["dtype"] == "bf16" and manifest["shard_tokens"] == 100
    assert all(s["num_tokens"] <= 100 for s in manifest["shards"] if s["num_samples"] > 1)
    assert main(argv) == 0 and "nothing to capture" in capsys.readouterr().out
    assert main(["capture", "--config", "tiny", "--device", "cpu", "--data", str(prepared), "--out", str(store),
                 "--layers", "1,2"]) == 2
    assert "differs in: aux_layers" in capsys.readouterr().err
    assert main(["verify", str(store), "--samples", "2"]) == 0


def test_verify_names_a_part_stored_in_another_dtype_than_the_manifest_says(tmp_path, prepared, tiny_target, capsys):
    """fp8-aux keeps the final state in bf16: a manifest that claims fp8 for the whole store is caught per part."""
    from eyas.store.manifest import MANIFEST

    store = _store(tmp_path, prepared, tiny_target, "fp8-aux")
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["dtype"] = "fp8"
    (store / MANIFEST).write_text(json.dumps(manifest))
    assert main(["verify", str(store), "--samples", "0"]) == 1
    out = capsys.readouterr().out
    assert "final_hidden is BF16, the manifest's dtype fp8 stores it as F8_E4M3" in out
    assert "aux_hidden is" not in out
