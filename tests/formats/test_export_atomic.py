"""An export is replaced whole or not at all: a full disk while writing it removes the temporary directory,
keeps the export already there and says "disk full" naming it; only a directory eyas made is replaced."""

import errno

import pytest

from eyas.common import EyasError
from eyas.formats import export
from eyas.ownership import MARKER, owned


def files(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_full_disk_keeps_the_committed_export(make_run, tmp_path, monkeypatch):
    run, _ = make_run()
    out = export(run, tmp_path / "out", ["vllm"], dtype="fp32")["vllm"]
    assert owned(out, "export") and (out / MARKER).is_file()
    before = files(out)

    def full(state, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(EyasError, match=rf"^disk full while writing the vllm export {out}: .* stays as it was"):
        export(run, tmp_path / "out", ["vllm"], dtype="fp32")
    assert files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no .tmp or .old left


def test_an_export_over_a_user_directory_is_refused(make_run, tmp_path):
    run, _ = make_run()
    mine = tmp_path / "mine"
    (mine / "vllm").mkdir(parents=True)
    (mine / "vllm" / "eyas.json").write_text("{}")  # looks like an export, but eyas did not make it
    with pytest.raises(EyasError, match="was not made by eyas"):
        export(run, mine / "vllm", ["vllm"])
    assert files(mine) == {"vllm/eyas.json": b"{}"}
