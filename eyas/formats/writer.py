"""`export`: a trained draft -> one directory per serving engine (docs/ALGORITHM.md section 6).

Each `OUT/<format>/` holds `model.safetensors` (floats in the serving dtype, `d2t` int64 and `t2d` bool
unless the draft vocabulary is the target's in the same order), the engine's `config.json`, `eyas.json` (the
exact draft config, HF aux ids and target identity, so that eyas reads the export back losslessly)
and a README.md with the launch command. A directory is written under a temporary name and renamed
into place, so a reader never sees half an export.

A DFlash draft gets the one layout both engines load (eyas.formats.dflash) in its `sglang` and `vllm`
directories; it has no speculators export, which `export` says in one printed line.
"""

from __future__ import annotations

import errno
import shutil
import tempfile
from pathlib import Path

from eyas.common import EyasError, atomic_write_json, atomic_write_text, print0, read_json, sha256_file, warn
from eyas.formats import configs, dflash
from eyas.formats.configs import FORMATS, TORCH_DTYPE_NAMES
from eyas.formats.keys import EMBED, to_midlayer
from eyas.formats.load import load_draft
from eyas.identity import check_target
from eyas.layers import to_sglang_ids
from eyas.ownership import check_claimable, claim, read_marker

SCHEMA_VERSION = 1


def check_exportable(draft, meta: dict, formats: list[str]) -> None:
    """Refuse (EyasError) a draft whose target identity or layer ids are missing or inconsistent."""
    src = meta.get("path", "the draft")
    ident = meta.get("target")
    if not ident or not ident.get("name") or not ident.get("config_hash"):
        raise EyasError(f"{src}: no target identity recorded (name, config_hash); eyas cannot say which model "
                        f"this draft serves. Re-export from the eyas checkpoint it came from")
    aux = meta.get("aux_layers")
    if not aux:
        raise EyasError(f"{src}: no aux layer ids recorded; without them an engine captures the wrong layers")
    if any(not isinstance(i, int) or isinstance(i, bool) for i in aux) or aux != sorted(set(aux)) or aux[0] < 1:
        raise EyasError(f"{src}: aux layer ids {aux} must be distinct ascending integers >= 1 (HF convention)")
    if meta.get("method") == "dflash":
        dflash.check_exportable(draft, meta, src)
        _check_store(meta, src, aux)
        return
    n = meta.get("num_layers")
    if n is not None and aux[-1] > int(n) - 1:
        raise EyasError(f"{src}: aux layer ids {aux} are out of range for the recorded {n}-layer target: "
                        f"residual-stream ids are 1..{int(n) - 1} in the HF convention")
    if n is None:
        warn(f"{src}: the target's number of layers is not recorded; aux ids {aux} were not range-checked")
    hidden = draft.cfg.hidden_size
    fc_in = draft.fc.weight.shape[1]
    if fc_in != len(aux) * hidden or draft.cfg.num_aux_layers != len(aux):
        raise EyasError(f"{src}: {len(aux)} aux layer ids {aux} but fc takes {fc_in} = {fc_in / hidden:g} x "
                        f"hidden_size {hidden} inputs; the recorded ids do not belong to these weights")
    if len(aux) != 3 and set(formats) & {"sglang", "vllm"}:
        raise EyasError(f"{src}: the draft fuses {len(aux)} aux layers, but vLLM (and SGLang before its "
                        f"PR #24663) builds fc for exactly 3; export it only with --to speculators, or train "
                        f"with train.features=fused")
    _check_store(meta, src, aux)


def _check_store(meta: dict, src: str, aux: list[int]) -> None:
    """The store the checkpoint trained on must have captured its layers, from its target."""
    store = meta.get("store")
    if store and (Path(store) / "manifest.json").is_file():
        manifest = read_json(Path(store) / "manifest.json")
        captured = manifest.get("aux_layers")
        if meta.get("method") == "dflash":  # a DFlash draft fuses any of the captured layers
            bad = captured is not None and not set(aux) <= set(captured)
        else:  # a "last"-features draft (EAGLE-2 style baseline) uses only the deepest captured layer
            expected = captured[-1:] if captured and meta.get("features") == "last" else captured
            bad = expected is not None and expected != aux
        if bad:
            raise EyasError(f"{src}: the checkpoint records aux layers {aux} ({meta.get('features')} features) "
                            f"but its store {store} captured {captured}")
        check_target(manifest.get("target"), meta.get("target"), what=f"the store {store} of {src}",
                     fix="the checkpoint and its store must come from one training run")


def _embed_from_store(draft, meta: dict) -> None:
    """Checkpoints leave the frozen target embedding out; the store they trained on keeps a copy."""
    head = Path(meta.get("store") or "") / "target_head.safetensors"
    if meta.get("store") and head.is_file():
        from safetensors import safe_open

        with safe_open(str(head), framework="pt") as f:
            embed = f.get_tensor(EMBED)
        if tuple(embed.shape) == tuple(draft.embed_tokens.weight.shape):
            draft.embed_tokens.weight.data.copy_(embed)
            meta["has_embed"] = True


def _weights(draft, meta: dict, dtype: str, with_embed: bool) -> dict:
    import torch

    cast = getattr(torch, TORCH_DTYPE_NAMES[dtype])
    state = {k: v.detach().cpu() for k, v in draft.state_dict().items()}
    if not (with_embed and meta.get("has_embed")):
        if with_embed:
            warn(f"{meta.get('path')}: no target embedding in the checkpoint or its store; "
                 f"exporting without embed_tokens.weight")
        state.pop(EMBED)
    if draft.cfg.draft_vocab_size == draft.cfg.vocab_size and not state["d2t"].any():
        state.pop("d2t"), state.pop("t2d")  # identity mapping: engines treat a missing map as the identity
    else:
        state["d2t"], state["t2d"] = state["d2t"].to(torch.int64), state["t2d"].to(torch.bool)
    return {k: (v.to(cast) if v.is_floating_point() else v).contiguous() for k, v in state.items()}


def _write_one(fmt: str, final: Path, state: dict, meta: dict, dtype: str) -> Path:
    from safetensors.torch import save_file

    dc, aux, method = meta["draft_config"], list(meta["aux_layers"]), meta.get("method", "eagle3")
    final = check_claimable(final, "export").resolve()  # only an export eyas made is ever replaced
    out_dir = final.parent
    target = configs.serving_target(meta)
    convention = "sglang (HF - 1)" if fmt == "sglang" else "hf"
    if method == "dflash":  # one layout for both engines
        cfg, written = dflash.engine_config(dc, meta["num_layers"], dtype), dflash.to_dflash_ids(aux)
        convention = "dflash target_layer_ids (0-based decoder layer, HF - 1)"
    elif fmt == "sglang":
        cfg, written = configs.sglang_config(dc, aux, dtype), to_sglang_ids(aux)
        state = to_midlayer(state)  # SGLang's layer is `midlayer`; it skips names it cannot place
    elif fmt == "vllm":
        cfg, written = configs.vllm_config(dc, aux, dtype), aux
    else:
        cfg, written = configs.speculators_config(dc, aux, dtype, target, meta.get("target_architectures")), aux
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{fmt}.", suffix=".tmp", dir=out_dir))
    tmp.chmod(0o755)  # mkdtemp makes it private; an export is meant to be read by a server
    old = None
    try:
        claim(tmp, "export", (read_marker(final) or {}).get("run_id"))
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", cfg)
        atomic_write_json(tmp / "eyas.json", {
            "schema_version": SCHEMA_VERSION, "format": fmt, "method": method, "dtype": dtype,
            "aux_layers": aux, "aux_layers_written": written, "aux_layers_convention": convention,
            "target": meta.get("target"), "target_model": meta.get("target_model"),
            "target_num_layers": meta.get("num_layers"), "target_architectures": meta.get("target_architectures"),
            "target_name_or_path": meta.get("target_name_or_path"),
            "features": meta.get("features"), "ttt": meta.get("ttt"), "draft_config": dc,
            "source": meta.get("path"), "weights_sha256": sha256_file(tmp / "model.safetensors"),
        })
        text = (dflash.readme(fmt, str(final), meta, dtype) if method == "dflash"
                else configs.readme(fmt, str(final), meta, written, dtype))
        atomic_write_text(tmp / "README.md", text)
        if final.exists():  # moved onto an empty directory of its own, then removed: never a name in use
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=out_dir))
            final.rename(old)
        tmp.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists():  # the swap failed halfway: the committed export goes back
            old.rename(final)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            kept = "the export there stays as it was" if final.exists() else "nothing was written"
            raise EyasError(f"disk full while writing the {fmt} export {final}: free space on that device or "
                            f"choose another --out, then export again; {kept}") from None
        raise
    return final


def _dflash_formats(formats: list[str], meta: dict) -> list[str]:
    """The requested formats a DFlash draft has; a skipped speculators export is said, never silent."""
    kept = [f for f in formats if f in dflash.FORMATS]
    if not kept:
        raise EyasError(f"{meta['path']}: a DFlash draft exports to {' and '.join(dflash.FORMATS)} only (eyas does not "
                        f"write speculators' DFlash format); use --to {' or --to '.join(dflash.FORMATS)} or --to all")
    if "speculators" in formats:
        print0("export speculators -> not written: eyas does not write speculators' DFlash format; vLLM serves "
               "the vllm export")
    return kept


def export(run_or_ckpt: str | Path, out_dir: str | Path, formats=("sglang", "vllm", "speculators"), *,
           dtype: str = "bf16", embed_tokens: bool = False) -> dict[str, Path]:
    """Export a run dir / step dir / export dir; returns {format: directory written}.

    With one format `out_dir` is that export's directory; with several, each goes to `out_dir/<format>/`.
    """
    formats = list(FORMATS) if formats in ("all", None) else [formats] if isinstance(formats, str) else list(formats)
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise EyasError(f"unknown export format(s) {bad}; choose from: {', '.join(FORMATS)}, all")
    if dtype not in TORCH_DTYPE_NAMES:
        raise EyasError(f"export dtype {dtype!r} is not one of {', '.join(TORCH_DTYPE_NAMES)}")
    draft, meta = load_draft(run_or_ckpt)
    several = len(formats) > 1  # the layout the user asked for, whatever a DFlash draft leaves out
    if meta["method"] == "dflash":
        formats = _dflash_formats(formats, meta)
    check_exportable(draft, meta, formats)
    if meta["method"] == "dflash":
        if embed_tokens:
            warn(f"{meta['path']}: a DFlash export never holds the target's embedding or lm_head (the engines use "
                 f"the target's); --embed / export.embed_tokens is ignored")
        state = dflash.export_state(draft, dtype)
    else:
        if embed_tokens and not meta["has_embed"]:
            _embed_from_store(draft, meta)
        state = _weights(draft, meta, dtype, embed_tokens)
    if several:
        claim(out_dir, "export")  # the directory that holds one export per format is eyas's too
    paths = {}
    for fmt in formats:
        final = Path(out_dir) / fmt if several else Path(out_dir)
        paths[fmt] = _write_one(fmt, final, state, meta, dtype)
        print0(f"export {fmt:<11} -> {paths[fmt]}")
    return paths
