"""A speculative-decoding engine for a loaded target and a draft on disk (EAGLE-3 or DFlash), checked to fit
each other."""

from __future__ import annotations

from pathlib import Path

from eyas.common import EyasError, sha256_json, warn
from eyas.formats import load_draft, resolve_draft_dir
from eyas.identity import check_target
from eyas.layers import resolve_aux_layers
from eyas.speculative.engine import SpecEngine


def weights_stamp(draft_path) -> str:
    """A short id of the draft's weight files (names, sizes, modification times): a draft retrained in place
    gets a new one, so an interrupted eval's requests are not reused for it (eyas.speculative.bench.RequestJournal)."""
    d = resolve_draft_dir(draft_path)
    files = sorted(f for f in d.iterdir() if f.suffix in (".safetensors", ".bin", ".pt") and f.is_file())
    return sha256_json([(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files])[:16]


def build_engine(target, draft_path: str | Path, aux_layers=None, cuda_graphs: bool = False,
                 compile_draft: bool = False, require_compile: bool = False) -> tuple[SpecEngine, dict]:
    """Load a draft for `target` and check that it fits; -> (engine, {"aux": HF ids, "meta": draft meta}).
    cuda_graphs: on a CUDA target, the engine's static path (graphs, one cycle queued ahead, so only the
    total time is measured, not the draft/verify split); nothing changes on a CPU.
    compile_draft: the static path's draft-side passes compiled by inductor. Without that path it has no
    effect, said in a warning (a preset's value, like cuda_graphs), or is refused when `require_compile`
    (asked for on the command line)."""
    static = cuda_graphs and target.device.type == "cuda"
    if compile_draft and not static:
        why = (f"eval.compile_draft needs a CUDA target with eval.cuda_graphs=true (the target is on "
               f"{target.device}, eval.cuda_graphs={str(cuda_graphs).lower()})")
        if require_compile:  # refused, not ignored: whoever asked for it would otherwise time the eager draft
            raise EyasError(f"{why}; drop --compile-draft (or --set eval.compile_draft=false)")
        warn(f"{why}: the draft's passes run uncompiled here (the results record compile_draft: null)")
        compile_draft = False
    # a DFlash draft scores with the target's lm_head, which its files leave out; EAGLE-3 ignores lm_head
    draft, meta = load_draft(draft_path, embed_tokens=target.embed_tokens.weight, lm_head=target.lm_head.weight)
    meta["weights_stamp"] = weights_stamp(draft_path)
    method = getattr(draft, "method", "eagle3")
    dc = draft.cfg
    if dc.hidden_size != target.hidden_size or dc.vocab_size != target.vocab_size:
        raise EyasError(f"draft {draft_path} was built for hidden size {dc.hidden_size} and vocab {dc.vocab_size}, "
                        f"the target {target.name} has {target.hidden_size} and {target.vocab_size}; "
                        f"pass the draft's own target with --target")
    check_target(meta.get("target"), target.identity, what=f"the draft {draft_path}",
                 fix="pass the draft's own target with --target")
    if method == "dflash":  # the draft names its own target layers; target.aux_layers is EAGLE-3's
        aux = list(dc.target_layers)
        if meta.get("aux_layers") and list(meta["aux_layers"]) != aux:
            raise EyasError(f"draft {draft_path}: its files name the aux layers {meta['aux_layers']} but its config "
                            f"fuses the target layers {aux}; they do not belong together")
        bad = [i for i in aux if not 1 <= i <= target.num_layers - 1]
        if bad:
            raise EyasError(f"draft {draft_path} fuses the target layers {aux}: {bad} are outside 1.."
                            f"{target.num_layers - 1} of the {target.num_layers}-layer target {target.name}")
    else:
        aux = meta.get("aux_layers") or resolve_aux_layers(aux_layers, target.num_layers)
        if len(aux) != dc.num_aux_layers:
            raise EyasError(f"draft {draft_path} fuses {dc.num_aux_layers} aux layers but {len(aux)} ids are known "
                            f"({aux})")
    draft = draft.to(device=target.device, dtype=target.dtype)
    engine = SpecEngine(target.model, draft, aux, sync_timing=not static, static=static,
                        compile_draft="inductor" if compile_draft else None)
    return engine, {"aux": aux, "meta": meta, "method": method}
