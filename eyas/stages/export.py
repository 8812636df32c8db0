"""The export stage: a trained draft -> one directory per serving engine (eyas.formats.export)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from eyas.ownership import writing


@dataclass(frozen=True)
class Inputs:
    draft: str | Path  # a run directory (its latest checkpoint), a step directory or an export directory


def run(cfg, inputs: Inputs, out: str | Path) -> dict:
    """Write cfg.export.formats into `out` (with one format, `out` is that export; with several, OUT/<format>/)
    and return the stage summary. Nothing else is written: an export directory holds exactly what the
    engine reads, and each one's README.md has its launch line."""
    from eyas.formats import export

    t0 = time.perf_counter()
    ec = cfg.export
    with writing(out, "export") as out:
        paths = export(inputs.draft, out, ec.formats, dtype=ec.dtype, embed_tokens=ec.embed_tokens)
    return {"stage": "export", "wall_s": round(time.perf_counter() - t0, 3), "dtype": ec.dtype,
            "formats": {fmt: str(path) for fmt, path in paths.items()}}
