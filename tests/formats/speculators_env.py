"""The `speculators` package from PyPI, importable by a subprocess beside the project, built once per machine.

Why not in the project's environment: `speculators` pins and drags in packages (torchvision, torchaudio, its own
transformers and vLLM-oriented extras) that must not be resolved into it; installing it there could silently
replace our torch or transformers. Two ways, the first where it works:

1. An overlay: speculators and its small `hs-connectors` companion alone (`pip install --target DIR --no-deps`),
   put on PYTHONPATH of a subprocess of the project's own python, which then loads speculators over the project's
   exact torch and transformers. Nothing in the project's environment changes. It works where that environment
   already holds speculators' other dependencies (pydantic, loguru, openai, ...: vLLM brings them, and `make test`
   installs vLLM's CPU build); about 8 s to install and check, against 80 s for a venv on 2 cores.
2. Otherwise a separate venv, with the project's exact torch and transformers versions and speculators' own
   dependencies resolved there. Seen on CPU: speculators 0.9.0 installs beside torch 2.13.0 and transformers 5.19
   and imports once torchvision and torchaudio (which it pulls from PyPI and which do not load beside the CPU torch
   build) are uninstalled again.

Either lives under $EYAS_CACHE (default ~/.cache/eyas), keyed by the versions, built under a file lock so that
parallel test runs do not collide, and marked complete only at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eyas.common import atomic_write_json, cache_dir, file_lock

SPECULATORS_VERSION = "0.9.0"
HS_CONNECTORS_VERSION = "0.9.0"  # speculators 0.9.0's companion package (it needs only safetensors and torch)


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {
        "speculators": SPECULATORS_VERSION,
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _key() -> str:
    v = _versions()
    return f"spec{v['speculators']}-torch{v['torch']}-tf{v['transformers']}-py{v['python']}"


def venv_dir() -> Path:
    return cache_dir() / "speculators-venv" / _key()


def overlay_dir() -> Path:
    return cache_dir() / "speculators-overlay" / _key()


def speculators_command(timeout_s: float = 1800) -> tuple[str, dict]:
    """-> (the python to run a script with, its environment) where `import speculators` works: the overlay over
    the project's python where the project holds speculators' dependencies, else the separate venv."""
    overlay = _overlay(timeout_s)
    if overlay is not None:
        return sys.executable, {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(overlay), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return str(speculators_python(timeout_s)), dict(os.environ)


def _overlay(timeout_s: float) -> Path | None:
    """The overlay directory, built on first use; None where speculators does not import over this environment
    (recorded, so that the check runs once per machine)."""
    root = overlay_dir()
    marker = root.with_name(root.name + ".json")
    if not marker.is_file():
        with file_lock(root.parent / f"{root.name}.lock"):
            if not marker.is_file():  # not built by a parallel run while we waited
                shutil.rmtree(root, ignore_errors=True)  # a partial build from an interrupted run
                start = time.monotonic()
                subprocess.run([sys.executable, "-m", "pip", "-q", "install", "--no-deps", "--target", str(root),
                                f"speculators=={SPECULATORS_VERSION}", f"hs-connectors=={HS_CONNECTORS_VERSION}"],
                               check=True, timeout=timeout_s)
                env = {**os.environ, "PYTHONPATH": str(root)}
                probe = subprocess.run([sys.executable, "-c", "import speculators"], env=env, capture_output=True,
                                       text=True, timeout=300)
                atomic_write_json(marker, {**_versions(), "imports": probe.returncode == 0,
                                           "error": probe.stderr[-2000:], "build_s": round(time.monotonic() - start, 1)})
    return root if json.loads(marker.read_text())["imports"] else None


def _python(root: Path) -> Path:
    return root / "bin" / "python"


def speculators_python(timeout_s: float = 1800) -> Path:
    """The python of a venv where `import speculators` works; builds it on first use."""
    root = venv_dir()
    marker = root / "COMPLETE.json"
    if marker.is_file():
        return _python(root)
    with file_lock(root.parent / f"{root.name}.lock"):
        if marker.is_file():  # built by a parallel run while we waited
            return _python(root)
        shutil.rmtree(root, ignore_errors=True)  # a partial build from an interrupted run
        v = _versions()
        start = time.monotonic()

        def pip(*args: str) -> None:
            subprocess.run([str(_python(root)), "-m", "pip", "-q", *args], check=True, timeout=timeout_s)

        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
        # torch first, at our exact version, so that speculators' resolver keeps it (on this kind of
        # machine pip's configured find-links supply the CPU wheel)
        pip("install", f"torch=={v['torch']}")
        pip("install", f"speculators=={v['speculators']}", f"transformers=={v['transformers']}", f"torch=={v['torch']}")
        # pulled in from PyPI for vision/audio models; built for another torch, they break `import speculators`
        pip("uninstall", "-y", "torchvision", "torchaudio")
        subprocess.run([str(_python(root)), "-c", "import speculators"], check=True, timeout=300)
        atomic_write_json(marker, {**v, "build_s": round(time.monotonic() - start, 1)})
    return _python(root)


def build_info() -> dict:
    marker = venv_dir() / "COMPLETE.json"
    return json.loads(marker.read_text()) if marker.is_file() else {}


if __name__ == "__main__":
    print(speculators_command()[0])
    print(build_info())
