"""`load_draft`: read any draft eyas meets into an `Eagle3Draft` or a `DFlashDraft` plus what it was trained for.

Accepted: a run directory (follows `latest`, also `RUN/train/latest`), a checkpoint step directory
(`draft.json` + `model.safetensors`), an export of any of the three kinds (SGLang, vLLM, speculators),
and a research checkpoint as EAGLE's and SpecForge's trainers write it (`config.json` with a flat
Llama config and `midlayer.*` weights in `model.safetensors` or `pytorch_model.bin`). Weight names go
through the one key map in `eyas.formats.keys`.

Aux layer ids in `meta` are always in the Hugging Face `output_hidden_states` convention
(docs/ALGORITHM.md section 1), whatever convention the source wrote.

A DFlash draft (draft.json `method: "dflash"`, or a config.json of architecture `DFlashDraftModel`) goes
through its own adapter, `eyas.formats.dflash`; `meta["method"]` says which kind was read.
"""

from __future__ import annotations

from pathlib import Path

from eyas.common import EyasError, nonfinite_tensors, read_json
from eyas.formats import dflash
from eyas.formats.configs import FORMATS
from eyas.formats.keys import EMBED, FROM_FOREIGN, from_foreign

# config flags that change the draft's computation (vLLM reads them on both config paths). eyas's draft has
# the first two off always; the EAGLE 3.1 pair it can have on (DraftConfig.fc_norm, .norm_output)
LAYOUT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
REFUSED_FLAGS = ("norm_before_residual", "norm_before_fc")
EAGLE31_FLAGS = ("fc_norm", "norm_output")
METHODS = ("eagle3", "dflash")


def resolve_draft_dir(path: str | Path) -> Path:
    """The directory that holds the draft: follows run dirs' `latest` links."""
    p = Path(path).expanduser()
    if not p.exists():
        raise EyasError(f"{path}: no such file or directory; pass a run dir, a step dir or an export dir")
    if p.is_file():
        p = p.parent
    for link in (p / "latest", p / "train" / "latest"):
        if link.exists():
            return link.resolve()
    if not (p / "draft.json").is_file() and not (p / "config.json").is_file():
        steps = sorted(d for d in p.glob("step-*") if (d / "draft.json").is_file())
        if steps:
            return steps[-1]
        raise EyasError(f"{p}: neither a run dir (no latest link, no step-* dirs), a checkpoint (no draft.json) "
                        f"nor an export (no config.json)")
    return p


def _weights_file(d: Path) -> Path:
    if (d / "model.safetensors").is_file():
        return d / "model.safetensors"
    if (d / "pytorch_model.bin").is_file():
        return d / "pytorch_model.bin"
    files = sorted(d.glob("*.safetensors"))
    if len(files) == 1:
        return files[0]
    raise EyasError(f"{d}: expected one weights file (model.safetensors or pytorch_model.bin), found "
                    f"{[f.name for f in files] or 'none'}")


def _read_weights(d: Path) -> tuple[Path, dict]:
    """(the weights file, its tensors); a truncated or corrupt file, or one holding a value that is not finite,
    is an EyasError naming the file (and the tensor)."""
    import pickle

    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = _weights_file(d)
    try:
        if path.suffix == ".bin":
            state = torch.load(path, map_location="cpu", weights_only=True)
        else:
            state = load_file(path)
    except (SafetensorError, pickle.UnpicklingError, EOFError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise EyasError(f"{path}: not a readable weights file ({first}); it is truncated or corrupt: copy it "
                        f"again, or use another checkpoint (step-*) or export") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise EyasError(f"{path}: does not hold a mapping of names to tensors; not a draft's weights")
    nonfinite = nonfinite_tensors(state)
    if nonfinite:
        name, bad = next(iter(nonfinite.items()))
        raise EyasError(f"{path}: tensor {name} holds {bad:,} value(s) that are NaN or infinite; the draft is "
                        f"broken (training diverged or the file was damaged): use an earlier checkpoint "
                        f"(step-*) or train again")
    return path, state


def _num_aux(state: dict, hidden: int, source: str) -> int:
    fc_in = state["fc.weight"].shape[1]
    if fc_in % hidden:
        raise EyasError(f"{source}: fc.weight has {fc_in} inputs, not a multiple of hidden_size {hidden}")
    return fc_in // hidden


def _target_facts(dj: dict) -> dict:
    """num_layers and architectures of the target, from draft.json, its store's manifest or the target dir."""
    cfg = dict(dj.get("target_config") or {})
    facts = {"num_layers": dj.get("target_num_layers") or dj.get("num_layers") or cfg.get("num_hidden_layers"),
             "architectures": dj.get("target_architectures") or cfg.get("architectures"),
             "name_or_path": cfg.get("_name_or_path")}
    sources = []
    if dj.get("store"):
        sources.append(Path(dj["store"]) / "manifest.json")
    if dj.get("target_model"):
        sources.append(Path(str(dj["target_model"])).expanduser() / "config.json")
    for src in sources:
        if facts["num_layers"] and facts["architectures"]:
            break
        try:
            doc = read_json(src)
        except (OSError, ValueError):
            continue
        tc = doc.get("target_config", doc)  # a store manifest nests the HF config; a config.json is one
        facts["num_layers"] = facts["num_layers"] or doc.get("num_layers") or tc.get("num_hidden_layers")
        facts["architectures"] = facts["architectures"] or tc.get("architectures")
        facts["name_or_path"] = facts["name_or_path"] or tc.get("_name_or_path")
    return facts


def _read_doc(path: Path) -> dict:
    """A JSON object from a draft's directory, or an EyasError naming the file."""
    try:
        doc = read_json(path)
    except (ValueError, UnicodeDecodeError) as e:
        raise EyasError(f"{path}: not valid JSON ({e}); the draft is damaged: copy it again or use another "
                        f"checkpoint") from None
    if not isinstance(doc, dict):
        raise EyasError(f"{path}: expected a JSON object; the draft is damaged or not eyas's")
    return doc


def _meta_from_checkpoint(d: Path) -> tuple[dict, dict]:
    dj = _read_doc(d / "draft.json")
    if "draft_config" not in dj:
        raise EyasError(f"{d / 'draft.json'}: no draft_config; the checkpoint is incomplete or not eyas's")
    facts = _target_facts(dj)
    meta = {"kind": "checkpoint", "aux_layers": dj.get("aux_layers"), "target": dj.get("target"),
            "target_model": dj.get("target_model"), "features": dj.get("features", "fused"), "ttt": dj.get("ttt"),
            "num_layers": facts["num_layers"], "target_architectures": facts["architectures"],
            "target_name_or_path": facts["name_or_path"], "store": dj.get("store")}
    return dj["draft_config"], meta


def _aux_from_flat(cfg: dict, source: str) -> list[int] | None:
    """HF ids from a flat config: the top-level list (vLLM, HF convention) or eagle_config's (SGLang, HF - 1)."""
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    sgl = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from_sgl = [int(i) + 1 for i in sgl] if sgl else None
    if top and from_sgl and list(top) != from_sgl:
        raise EyasError(f"{source}: the top-level eagle_aux_hidden_state_layer_ids {list(top)} (HF convention) and "
                        f"eagle_config's {list(sgl)} (SGLang convention, HF - 1) name different layers")
    return list(top) if top else from_sgl


def _check_eyas_export(d: Path, cfg: dict, ej: dict, weight_names: list[str]) -> None:
    """An eyas export must say in config.json what its engine reads: no engine looks at eyas.json, and one
    that finds no aux ids in its own key captures its default layers ([2, n//2, n-3] in HF ids)."""
    fmt = ej.get("format")
    if fmt not in FORMATS:
        raise EyasError(f"{d / 'eyas.json'}: format {fmt!r} is not one of {', '.join(FORMATS)}")
    if ("speculators_model_type" in cfg) != (fmt == "speculators"):
        raise EyasError(f"{d}: eyas.json says format {fmt!r} but config.json is "
                        f"{'a speculators' if 'speculators_model_type' in cfg else 'a flat'} config")
    if fmt == "sglang":  # SGLang reads only eagle_config's list, vLLM and speculators only the top-level one
        key, found = "eagle_config.eagle_aux_hidden_state_layer_ids", (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
    else:
        key, found = "eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids")
    expected = ej.get("aux_layers_written")
    if expected is None or found is None or list(found) != list(expected):
        raise EyasError(f"{d / 'config.json'}: {key} is {'missing' if found is None else list(found)}, but "
                        f"eyas.json says {expected} ({ej.get('aux_layers_convention')} convention) was written "
                        f"there; without it the engine captures its default layers")
    if fmt == "sglang":  # SGLang skips, without a word, any weight it cannot place (see keys.py)
        layer = [k for k in weight_names if FROM_FOREIGN.get(k, "").startswith("layers.0.")]
        wrong = sorted(k for k in layer if not k.startswith("midlayer."))
        if wrong:
            raise EyasError(f"{d / 'model.safetensors'}: an SGLang export names its decoder layer `midlayer.*`, "
                            f"found {wrong[:3]}; SGLang would serve a random layer")


def _meta_from_export(d: Path, cfg: dict, state: dict, weight_names: list[str]) -> tuple[dict, dict]:
    from eyas.draft import DraftConfig

    source = str(d / "config.json")
    speculators = "speculators_model_type" in cfg
    if speculators and cfg["speculators_model_type"] != "eagle3":
        raise EyasError(f"{source}: speculators model type {cfg['speculators_model_type']!r} is not eagle3")
    # vLLM treats a missing norm_before_residual as true on the speculators path, as false on the flat one
    on = [f for f in REFUSED_FLAGS if cfg.get(f, speculators and f == "norm_before_residual")]
    if on:
        raise EyasError(f"{source}: {on} set to true; eyas's EAGLE-3 draft supports neither "
                        f"(both false{'' if speculators else ' or absent'}); of the other layout flags it has "
                        f"fc_norm and norm_output")
    flags = {f: bool(cfg.get(f, False)) for f in EAGLE31_FLAGS}  # what every engine reads (missing = false)
    if not (cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        raise EyasError(f"{source}: eagle_config.use_aux_hidden_state is false: engines would feed the target's "
                        f"hidden state to the layer without fc; eyas's draft always fuses its aux states through fc")
    if speculators:
        layer_cfg = dict(cfg["transformer_layer_config"])
        aux = cfg.get("eagle_aux_hidden_state_layer_ids")
        verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
        target_model, archs = verifier.get("name_or_path"), verifier.get("architectures")
    else:
        layer_cfg = cfg
        aux = _aux_from_flat(cfg, source)
        target_model, archs = None, None
    hidden = int(layer_cfg["hidden_size"])
    if int(cfg.get("target_hidden_size") or hidden) != hidden:
        raise EyasError(f"{source}: target_hidden_size {cfg['target_hidden_size']} != draft hidden_size {hidden}; "
                        f"eyas drafts use the target's hidden size")
    if int(layer_cfg.get("num_hidden_layers", 1)) != 1:
        raise EyasError(f"{source}: {layer_cfg['num_hidden_layers']} draft layers; eyas drafts have exactly one")
    vocab = int(layer_cfg["vocab_size"])
    draft_cfg = DraftConfig.from_target_config(
        layer_cfg, draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab),
        num_aux_layers=_num_aux(state, hidden, source), **flags).to_dict()
    meta = {"kind": "speculators" if speculators else "flat", "aux_layers": list(aux) if aux else None,
            "target": None, "target_model": target_model, "features": "fused", "ttt": None, "num_layers": None,
            "target_architectures": archs, "target_name_or_path": None, "store": None}
    side = d / "eyas.json"  # written by eyas's exporter next to config.json: the exact draft config and target
    if side.is_file():
        ej = _read_doc(side)
        _check_eyas_export(d, cfg, ej, weight_names)
        if meta["aux_layers"] is not None and list(ej.get("aux_layers") or []) != meta["aux_layers"]:
            raise EyasError(f"{d}: config.json names aux layers {meta['aux_layers']} (HF convention) but eyas.json "
                            f"{ej.get('aux_layers')}; one of them was edited")
        draft_cfg = ej.get("draft_config", draft_cfg)
        differ = [f for f in EAGLE31_FLAGS if bool(draft_cfg.get(f, False)) != flags[f]]
        if differ:
            said = ", ".join(f"{f} is {str(flags[f]).lower()}" for f in differ)
            raise EyasError(f"{source}: {said} there, but eyas.json's draft has "
                            f"{', '.join(f'{f}={str(not flags[f]).lower()}' for f in differ)}; an engine reads "
                            f"config.json and would compute another draft: export again")
        meta.update(kind=ej.get("format", meta["kind"]), aux_layers=ej.get("aux_layers"), target=ej.get("target"),
                    target_model=ej.get("target_model", target_model), features=ej.get("features", "fused"),
                    ttt=ej.get("ttt"), num_layers=ej.get("target_num_layers"),
                    target_architectures=ej.get("target_architectures", archs),
                    target_name_or_path=ej.get("target_name_or_path"))
    return draft_cfg, meta


def _made_for(meta: dict) -> str:
    name = (meta.get("target") or {}).get("name") or meta.get("target_model") or meta.get("target_name_or_path")
    return f"made for {name!r}" if name else "its files do not name it"


def _method(d: Path) -> str:
    """The draft's method, eagle3 or dflash: a checkpoint's draft.json says (none: EAGLE-3), an export's
    config.json architectures do."""
    if (d / "draft.json").is_file():
        method = _read_doc(d / "draft.json").get("method") or "eagle3"
        if method not in METHODS:
            raise EyasError(f"{d / 'draft.json'}: method {method!r} is not one of {', '.join(METHODS)}; this eyas "
                            f"cannot read the checkpoint (written by a newer eyas, or damaged)")
        return method
    cfg = _read_doc(d / "config.json")
    return "dflash" if dflash.ARCHITECTURE in (cfg.get("architectures") or []) else "eagle3"


def _load_dflash(d: Path, embed_tokens, lm_head):
    weights_path, raw = _read_weights(d)
    if (d / "draft.json").is_file():
        draft_cfg, meta = _meta_from_checkpoint(d)
    else:
        draft_cfg, meta = dflash.meta_from_export(d, _read_doc(d / "config.json"), _read_doc)
    return dflash.build(d, weights_path, raw, draft_cfg, meta, embed_tokens, lm_head)


def load_draft(path: str | Path, embed_tokens=None, lm_head=None):
    """(Eagle3Draft or DFlashDraft in fp32 on CPU, eval mode; meta dict). See the module doc for what `path`
    may be.

    meta: method ("eagle3" or "dflash"), kind, path, aux_layers (HF ids or None if the source does not say),
    target (identity dict or None for foreign checkpoints), target_model, features, ttt, num_layers,
    target_architectures, has_embed, draft_config (a DFlash draft's also has_lm_head). Without an embedding
    in the file and without `embed_tokens` (the target's [V, H] embedding), the draft's embedding is NaN so
    that forgetting it cannot go unnoticed; the same holds for a DFlash draft's `lm_head` (the target's
    [V, H] head). An EAGLE-3 draft has a head of its own and ignores `lm_head`.
    """
    import torch

    from eyas.draft import DraftConfig, Eagle3Draft

    d = resolve_draft_dir(path)
    if _method(d) == "dflash":
        return _load_dflash(d, embed_tokens, lm_head)
    _, raw = _read_weights(d)
    try:
        state = from_foreign(raw, str(d))
    except ValueError as e:
        raise EyasError(str(e)) from None
    if (d / "draft.json").is_file():
        draft_cfg, meta = _meta_from_checkpoint(d)
    else:
        cfg = _read_doc(d / "config.json")
        draft_cfg, meta = _meta_from_export(d, cfg, state, list(raw))
    try:
        dc = DraftConfig.from_dict(draft_cfg)
    except (TypeError, ValueError) as e:
        raise EyasError(f"{d}: draft config does not describe an eyas draft ({e})") from None
    norms = sorted(k for k in state if k.startswith("fc_norm."))
    if dc.fc_norm and len(norms) != dc.num_aux_layers or not dc.fc_norm and norms:
        raise EyasError(f"{d}: the config says fc_norm={str(dc.fc_norm).lower()} for {dc.num_aux_layers} aux "
                        f"states but the weights hold {norms or 'no fc_norm.*'}; config and weights do not "
                        f"belong together")
    draft = Eagle3Draft(dc)
    expected = draft.state_dict()
    for name, value in state.items():
        if name in expected and tuple(value.shape) != tuple(expected[name].shape):
            raise EyasError(f"{d}: {name} has shape {list(value.shape)}, "
                            f"the config implies {list(expected[name].shape)}")
    has_embed = EMBED in state
    if not has_embed:
        if embed_tokens is not None:
            if tuple(embed_tokens.shape) != tuple(expected[EMBED].shape):
                raise EyasError(f"{d}: the draft is built for a target embedding of shape "
                                f"{list(expected[EMBED].shape)} (vocabulary, hidden size), the target's is "
                                f"{list(embed_tokens.shape)}: it was trained for another target "
                                f"({_made_for(meta)}); use the draft's own target")
            state[EMBED] = embed_tokens.detach()
        else:
            state[EMBED] = torch.full_like(expected[EMBED], float("nan"))
    vocab = {k: state.pop(k) for k in ("d2t", "t2d") if k in state}
    if not vocab and dc.draft_vocab_size != dc.vocab_size:
        raise EyasError(f"{d}: draft vocab {dc.draft_vocab_size} < target vocab {dc.vocab_size} but no d2t/t2d "
                        f"mapping in the weights")
    state.update({k: expected[k] for k in ("d2t", "t2d")})
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    if vocab:
        try:
            draft.set_vocab(vocab["d2t"].long(), vocab["t2d"].bool())
        except (AssertionError, ValueError) as e:
            raise EyasError(f"{d}: bad draft vocabulary mapping ({e})") from None
    draft.eval()
    meta.update(method="eagle3", path=str(d), has_embed=has_embed or embed_tokens is not None,
                draft_config=dc.to_dict())
    return draft, meta
