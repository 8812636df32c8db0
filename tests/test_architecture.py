"""The layering of DESIGN.md: imports go toward `config`, never toward `cli` (see docs/INTERNALS.md)."""

import ast
from pathlib import Path

import eyas

ROOT = Path(eyas.__file__).parent
ORDER = ["config", "common", "data", "target", "store", "draft", "train", "spec", "export", "gpu", "pipeline", "cli"]
MODEL_CODE = {"data", "target", "store", "draft", "train", "spec", "export"}
THIRD_PARTY_MODEL_CODE = {"torch", "transformers", "safetensors"}


def layer_of(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "eyas"
    if len(parts) == 1 or parts[1] in ("__main__", "commands"):
        return "cli"
    return parts[1]


def eyas_modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def imports_of(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno


def violations():
    found = []
    for module, path in eyas_modules():
        src = layer_of(module)
        for imported, line in imports_of(path):
            top = imported.split(".")[0]
            where = f"{path.relative_to(ROOT.parent)}:{line} imports {imported}"
            if top in THIRD_PARTY_MODEL_CODE and src in ("gpu", "pipeline"):
                found.append(f"{where}: gpu/pipeline must not import model code")
            if top != "eyas":
                continue
            dst = layer_of(imported) if imported != "eyas" else "cli"
            if imported == "eyas":
                continue
            if ORDER.index(dst) > ORDER.index(src):
                found.append(f"{where}: {src} may not import {dst} (a later layer)")
            if src == "draft" and dst not in ("draft", "config"):
                found.append(f"{where}: draft may import only config")
            if src == "train" and dst == "target":
                found.append(f"{where}: train never imports target")
            if src == "spec" and dst in ("train", "store"):
                found.append(f"{where}: spec never imports train or store")
            if src in ("gpu", "pipeline") and dst in MODEL_CODE:
                found.append(f"{where}: gpu/pipeline import no model code")
    return found


def test_layering_is_respected():
    assert violations() == []


def test_checker_catches_a_violation(tmp_path, monkeypatch):
    bad = ROOT / "draft" / "_layering_probe.py"
    bad.write_text("from eyas.train import loop\n")
    try:
        assert any("_layering_probe" in v for v in violations())
    finally:
        bad.unlink()
