"""The layering of DESIGN.md: imports go toward `config`, never toward `cli` (see docs/INTERNALS.md)."""

import ast
from pathlib import Path

import eyas

ROOT = Path(eyas.__file__).parent
ORDER = ["config", "common", "data", "target", "store", "draft", "train", "speculative", "export", "gpu", "pipeline", "cli"]
MODEL_CODE = {"data", "target", "store", "draft", "train", "speculative", "export"}
THIRD_PARTY_MODEL_CODE = {"torch", "transformers", "safetensors"}


def layer_of(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "eyas"
    if len(parts) == 1 or parts[1] in ("__main__", "commands"):
        return "cli"
    return parts[1]


def eyas_modules(root: Path):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def imports_of(path: Path, module: str):
    """(absolute module name, line) of every import, relative ones (`from ..train import x`) resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            if node.module:
                yield ".".join([*base, node.module]), node.lineno
            else:  # `from .. import train`: each name may be a module
                for alias in node.names:
                    yield ".".join([*base, alias.name]), node.lineno


def violations(root: Path = ROOT):
    found = []
    for module, path in eyas_modules(root):
        src = layer_of(module)
        for imported, line in imports_of(path, module):
            top = imported.split(".")[0]
            where = f"{path.relative_to(root.parent)}:{line} imports {imported}"
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
            if src == "speculative" and dst in ("train", "store"):
                found.append(f"{where}: spec never imports train or store")
            if src in ("gpu", "pipeline") and dst in MODEL_CODE:
                found.append(f"{where}: gpu/pipeline import no model code")
    return found


def test_layering_is_respected():
    assert violations() == []


def test_checker_catches_a_violation(tmp_path):
    """On a copy of the package (the real one is never written to), absolute and relative imports alike."""
    import shutil

    copy = tmp_path / "eyas"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(copy) == []
    (copy / "draft" / "_probe_abs.py").write_text("from eyas.train import loop\n")
    (copy / "draft" / "_probe_rel.py").write_text("from ..speculative import engine\nfrom .. import store\n")
    (copy / "gpu" / "_probe.py").write_text("import torch\n")
    (copy / "train" / "_probe.py").write_text("from ..target import load\n")
    found = violations(copy)
    assert any("_probe_abs.py:1 imports eyas.train: draft may not import train" in v for v in found), found
    assert any("_probe_rel.py:1 imports eyas.speculative: draft may not import spec" in v for v in found), found
    assert any("_probe_rel.py:2 imports eyas.store: draft may import only config" in v for v in found), found
    assert any("train/_probe.py:1 imports eyas.target: train never imports target" in v for v in found), found
    assert any("gpu/_probe.py:1 imports torch: gpu/pipeline must not import model code" in v for v in found), found
