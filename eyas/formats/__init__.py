"""Export a trained draft for SGLang, vLLM and speculators, and read any draft back (docs/FORMATS.md).

    export(run_or_ckpt, out_dir, formats=("sglang", "vllm", "speculators")) -> {format: Path}
    load_draft(path, embed_tokens=None, lm_head=None) -> (Eagle3Draft or DFlashDraft, meta)

A DFlash draft exports to sglang and vllm only (one layout both load: eyas.formats.dflash).
"""

from eyas.formats.configs import FORMATS
from eyas.formats.load import load_draft, resolve_draft_dir
from eyas.formats.writer import check_exportable, export

__all__ = ["FORMATS", "export", "load_draft", "resolve_draft_dir", "check_exportable"]
