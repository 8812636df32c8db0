"""The layering of docs/INTERNALS.md, checked transitively: importing `eyas.a.b` runs `eyas/a/__init__.py`
too, and whatever that imports, so a rule such as "train never imports target" holds for everything a
module can reach, not just for the imports it writes itself."""

import ast
from pathlib import Path

import eyas

ROOT = Path(eyas.__file__).parent
# a module may import only eyas modules at or before its own layer
ORDER = ["config", "common", "ownership", "layers", "identity", "layout", "data", "target", "store", "draft", "formats",
         "train", "speculative", "stages", "gpu", "pipeline", "cli"]
MODEL_CODE = {"data", "target", "store", "draft", "formats", "train", "speculative", "stages"}
THIRD_PARTY_MODEL_CODE = {"torch", "transformers", "safetensors", "numpy", "datasets"}
# (importing layer, layers it may never reach, even through another package)
NEVER_REACHES = [
    ("draft", set(ORDER) - {"draft", "config"}),
    ("store", {"target"}),
    ("train", {"target"}),
    ("speculative", {"train", "store"}),
    ("gpu", MODEL_CODE),
    ("pipeline", MODEL_CODE),
]


def layer_of(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "eyas"
    if len(parts) == 1 or parts[1] in ("__main__", "commands"):
        return "cli"
    return parts[1]


def eyas_modules(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(path: Path, module: str):
    """(absolute module name, line, lazy) of every import at any depth of the file, relative ones
    (`from ..train import x`) resolved; `lazy` when it sits in a function, so it runs only if that does."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text(), filename=str(path))
    lazy_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
    for node in ast.walk(tree):
        lazy = id(node) in lazy_nodes
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, lazy
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, node.module] if node.module else base)
            for alias in node.names:  # `from eyas import train` imports the module eyas.train
                yield f"{stem}.{alias.name}", node.lineno, lazy
            yield stem, node.lineno, lazy


def edges(root: Path) -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(module it runs, line, lazy)]: an import of `eyas.a.b` runs eyas, eyas.a and eyas.a.b;
    third-party tops are kept as they are (`torch`)."""
    modules = eyas_modules(root)
    graph = {}
    for module, path in modules.items():
        out = []
        for name, line, lazy in imports_of(path, module):
            parts = name.split(".")
            if parts[0] != "eyas":
                out.append((parts[0], line, lazy))
                continue
            for i in range(2, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != module:
                    out.append((prefix, line, lazy))
        graph[module] = out
    return graph


def reachable(graph: dict, start: str) -> dict[str, list[str]]:
    """Every module `start` can reach -> the chain of imports that reaches it (for the message). Every eyas
    import counts; a third-party one only where `start` writes it or where it runs at import time (a lazy
    `import torch` in a helper of eyas.common runs only for the callers of that helper)."""
    seen = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop()
        for dst, line, lazy in graph.get(m, []):
            if lazy and m != start and not dst.startswith("eyas"):
                continue
            if dst not in seen:
                seen[dst] = seen[m] + [f"{dst} (line {line} of {m})"]
                if dst in graph:
                    todo.append(dst)
    return seen


def violations(root: Path = ROOT) -> list[str]:
    graph = edges(root)
    found = []
    for module in graph:
        src = layer_of(module)
        for dst_module, line, _ in graph[module]:  # direct imports: the layer order
            if dst_module.startswith("eyas.") and ORDER.index(layer_of(dst_module)) > ORDER.index(src):
                found.append(f"{module}:{line} imports {dst_module}: {src} may not import "
                             f"{layer_of(dst_module)} (a later layer)")
        rules = [never for layer, never in NEVER_REACHES if layer == src]
        if not rules:
            continue
        for dst_module, chain in reachable(graph, module).items():
            if dst_module == module:
                continue
            top = dst_module.split(".")[0]
            if top != "eyas":
                if src in ("gpu", "pipeline") and top in THIRD_PARTY_MODEL_CODE:
                    found.append(f"{module} reaches {top}: gpu/pipeline import no model code; via {' -> '.join(chain)}")
                continue
            dst = layer_of(dst_module)
            if dst != src and any(dst in never for never in rules):
                found.append(f"{module} reaches {dst_module}: {src} never imports {dst}; via {' -> '.join(chain)}")
    return sorted(set(found))


def test_layering_is_respected():
    assert violations() == []


def test_checker_catches_a_violation(tmp_path):
    """On a copy of the package (the real one is never written to): direct imports, relative ones, and a
    rule broken only through another package's __init__."""
    import shutil

    copy = tmp_path / "eyas"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(copy) == []
    (copy / "draft" / "_probe_abs.py").write_text("from eyas.train import loop\n")
    (copy / "draft" / "_probe_rel.py").write_text("from ..speculative import engine\nfrom .. import store\n")
    (copy / "gpu" / "_probe.py").write_text("import torch\n")
    # legal on its own (store sits below train), but the store package's __init__ now runs model code
    (copy / "store" / "_probe_init.py").write_text("def f():\n    from eyas.target import load\n")
    with open(copy / "store" / "__init__.py", "a") as f:
        f.write("from eyas.store import _probe_init\n")
    found = violations(copy)
    joined = "\n".join(found)
    assert "eyas.draft._probe_abs:1 imports eyas.train: draft may not import train" in joined, joined
    assert "eyas.draft._probe_rel:1 imports eyas.speculative: draft may not import speculative" in joined, joined
    assert "eyas.draft._probe_rel reaches eyas.store: draft never imports store" in joined, joined
    assert "eyas.gpu._probe reaches torch: gpu/pipeline import no model code" in joined, joined
    assert "eyas.store._probe_init reaches eyas.target.load: store never imports target" in joined, joined
    # a training module reading a store now reaches the target through eyas/store/__init__.py
    assert any(v.startswith("eyas.train.") and "reaches eyas.target" in v and "eyas.store (line" in v
               for v in found), joined
