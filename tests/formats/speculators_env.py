"""A separate virtual environment holding the `speculators` package from PyPI, built once per machine.

Why a separate venv: `speculators` pins and drags in packages (torchvision, torchaudio, its own
transformers and vLLM-oriented extras) that must not be resolved into the project's environment;
installing it there could silently replace our torch or transformers. So the test that loads an
eyas export with speculators' own classes builds this venv beside the project, with the project's
exact torch and transformers versions, and runs the comparison in a subprocess of it.

Seen on CPU: speculators 0.9.0 installs beside torch 2.13.0 and transformers 5.19 and imports once
torchvision and torchaudio (which it pulls from PyPI and which do not load beside the CPU torch build)
are uninstalled again. The venv lives under $EYAS_CACHE (default ~/.cache/eyas), keyed by the versions,
built under a file lock so that parallel test runs do not collide, and marked complete only at the end.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eyas.common import atomic_write_json, cache_dir, file_lock

SPECULATORS_VERSION = "0.9.0"


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {
        "speculators": SPECULATORS_VERSION,
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def venv_dir() -> Path:
    v = _versions()
    key = f"spec{v['speculators']}-torch{v['torch']}-tf{v['transformers']}-py{v['python']}"
    return cache_dir() / "speculators-venv" / key


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
    print(speculators_python())
    print(build_info())
