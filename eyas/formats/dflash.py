"""The DFlash adapter: a `DFlashDraft` <-> the layout vLLM and SGLang load (docs/FORMATS.md "DFlash drafts").

Both engines read one layout, so the `sglang` and `vllm` exports of a DFlash draft hold the same
`config.json` and weights (only README and eyas.json differ): `architectures: ["DFlashDraftModel"]`, a Qwen3
config of the draft's layers, `block_size` at the top level and in `dflash_config` (SGLang reads either,
released checkpoints use both), `dflash_config.{mask_token_id, target_layer_ids}` and the target's depth
`num_target_layers` (SGLang checks the ids against it, and falls back to the draft's depth without it).

Layer ids: eyas numbers a target layer by its HF `hidden_states` index (0 = the embeddings); DFlash's
`target_layer_ids` are 0-based decoder layers whose output is hidden_states[id + 1]. Export writes
eyas - 1, loading adds 1 back.

Weights are unprefixed (vLLM prepends `model.` itself; SGLang takes either) and leave out the frozen
`embed_tokens` and `lm_head`: the engines use the target's. speculators' DFlash format is not written.
"""

from __future__ import annotations

from pathlib import Path

from eyas.common import EyasError
from eyas.formats.configs import TORCH_DTYPE_NAMES, llama_layer_config, provenance, serving_target

ARCHITECTURE = "DFlashDraftModel"
FORMATS = ("sglang", "vllm")  # the exports a DFlash draft has; speculators' DFlash layout is not written
TARGET_KEYS = ("embed_tokens.weight", "lm_head.weight")  # the target's, frozen: in the draft, never exported
TOP_PARAMS = ("fc.weight", "hidden_norm.weight", "norm.weight")
LAYER_PARAMS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
# dflash_config keys eyas's draft computes as the engines do; any other one (sliding windows, attention
# sinks, conv/selector projectors, ...) changes the draft's computation and is refused on load
DFLASH_CONFIG_KEYS = ("block_size", "mask_token_id", "mask_token", "target_layer_ids", "num_target_layers",
                      "use_aux_hidden_state", "causal", "use_swa")


def draft_keys(num_layers: int) -> tuple[str, ...]:
    """The trained weights of a draft of `num_layers` layers: what checkpoints and exports hold."""
    return TOP_PARAMS + tuple(f"layers.{i}.{p}" for i in range(num_layers) for p in LAYER_PARAMS)


def to_dflash_ids(aux_layers: list[int]) -> list[int]:
    """eyas (HF hidden_states index) -> DFlash target_layer_ids (0-based decoder layer)."""
    return [int(i) - 1 for i in aux_layers]


# ---- writing

def export_state(draft, dtype: str) -> dict:
    """The draft's trained weights, unprefixed, floats in the export dtype, without the target's tensors."""
    import torch

    cast = getattr(torch, TORCH_DTYPE_NAMES[dtype])
    return {k: v.detach().cpu().to(cast).contiguous() for k, v in draft.state_dict().items() if k not in TARGET_KEYS}


def engine_config(dc: dict, target_num_layers: int, dtype: str) -> dict:
    """config.json for both engines (dc: DFlashConfig.to_dict(); its target_layers in eyas's numbering)."""
    block = int(dc["block_size"])
    return {
        "architectures": [ARCHITECTURE],
        **llama_layer_config(dc),
        "model_type": "qwen3",
        "num_hidden_layers": dc["num_layers"],
        "layer_types": ["full_attention"] * dc["num_layers"],  # full attention = non-causal in both engines
        "block_size": block,
        "num_target_layers": int(target_num_layers),
        "dflash_config": {"block_size": block, "mask_token_id": int(dc["mask_token_id"]),
                          "target_layer_ids": to_dflash_ids(dc["target_layers"])},
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
    }


def launch_command(fmt: str, target: str, draft_dir: str, block_size: int) -> str:
    """One line (scripts grep the README for it). SGLang counts the anchor among its draft tokens, vLLM does not."""
    if fmt == "sglang":
        return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                f"--speculative-draft-model-path {draft_dir} --speculative-num-draft-tokens {block_size}")
    spec = f'{{"method": "dflash", "model": "{draft_dir}", "num_speculative_tokens": {block_size - 1}}}'
    return f"vllm serve {target} --speculative-config '{spec}'"


def readme(fmt: str, draft_dir: str, meta: dict, dtype: str) -> str:
    dc = meta["draft_config"]
    block = int(dc["block_size"])
    engine = {"sglang": "SGLang", "vllm": "vLLM"}[fmt]
    where = ("vLLM needs an attention backend with non-causal support (FLASH_ATTN; FLEX_ATTENTION in newer "
             "releases; `--attention-backend flash_attn` picks it); its CPU build cannot serve DFlash"
             if fmt == "vllm" else "SGLang serves DFLASH on CUDA and NPU devices only")
    lines = [
        f"# DFlash draft for {engine}",
        "",
        provenance(meta),
        "",
        f"- target layers (HF `hidden_states` index): {meta['aux_layers']}; written as "
        f"`dflash_config.target_layer_ids` {to_dflash_ids(meta['aux_layers'])} (0-based decoder layers, HF - 1) "
        f"of a {meta.get('num_layers')}-layer target",
        f"- block size {block} (`block_size` and `dflash_config.block_size`): one draft forward proposes "
        f"{block - 1} tokens; mask token id {dc['mask_token_id']}",
        f"- {dc['num_layers']} draft layer(s), no embedding and no lm_head (the engine uses the target's); "
        f"weights in {TORCH_DTYPE_NAMES[dtype]}; `eyas.json` records the rest",
        f"- the draft attends to its block without a causal mask: {where}",
        "",
        "## Launch",
        "",
    ]
    target = serving_target(meta)
    if target is None:
        lines += [f"The target `{meta.get('target_model')}` is a test model built in code; no engine can serve it. "
                  f"For a real target the command is:", ""]
        target = "TARGET"
    lines += ["```bash", launch_command(fmt, target, draft_dir, block), "```", ""]
    return "\n".join(lines)


def check_exportable(draft, meta: dict, src: str) -> None:
    """What a DFlash export needs beyond what every export needs (identity, ascending ids: writer.py)."""
    aux, n = meta["aux_layers"], meta.get("num_layers")
    if n is None:
        raise EyasError(f"{src}: the target's number of layers is not recorded (draft.json target_num_layers); a "
                        f"DFlash config must carry it as num_target_layers (SGLang checks the layer ids against "
                        f"it): export from the eyas checkpoint the draft was trained into")
    if aux[-1] > int(n) - 1:
        raise EyasError(f"{src}: target layers {aux} are out of range for the recorded {n}-layer target: "
                        f"residual-stream ids are 1..{int(n) - 1} in the HF convention")
    if list(draft.cfg.target_layers) != list(aux):
        raise EyasError(f"{src}: draft.json's aux_layers {aux} differ from its draft_config's target_layers "
                        f"{draft.cfg.target_layers}; the checkpoint is inconsistent")
    hidden, fc_in = draft.cfg.hidden_size, draft.fc.weight.shape[1]
    if fc_in != len(aux) * hidden:
        raise EyasError(f"{src}: {len(aux)} target layers {aux} but fc takes {fc_in} = {fc_in / hidden:g} x "
                        f"hidden_size {hidden} inputs; the recorded ids do not belong to these weights")


# ---- reading

def _refuse_other_computation(cfg: dict, source: str) -> None:
    """An engine computes what config.json says; refuse the settings that eyas's draft does not compute."""
    dfc = cfg.get("dflash_config") or {}
    other = sorted(k for k in dfc if k not in DFLASH_CONFIG_KEYS)
    said = []
    if other:
        said.append(f"dflash_config keys {other}")
    kinds = sorted(set(cfg.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if kinds:
        said.append(f"layer_types {kinds} (sliding-window layers)")
    if dfc.get("use_swa"):
        said.append("dflash_config.use_swa true (sliding windows)")
    if cfg.get("is_causal") or dfc.get("causal"):
        said.append("causal attention (is_causal / dflash_config.causal)")
    if not dfc.get("use_aux_hidden_state", True):
        said.append("dflash_config.use_aux_hidden_state false (no fc)")
    if cfg.get("attention_bias"):
        said.append("attention_bias true")
    if int(cfg.get("draft_vocab_size") or cfg["vocab_size"]) != int(cfg["vocab_size"]):
        said.append(f"a draft vocabulary of {cfg['draft_vocab_size']} (d2t)")
    if int(cfg.get("target_hidden_size") or cfg["hidden_size"]) != int(cfg["hidden_size"]):
        said.append(f"target_hidden_size {cfg['target_hidden_size']} != hidden_size {cfg['hidden_size']}")
    if said:
        raise EyasError(f"{source}: {'; '.join(said)}: eyas's DFlash draft does not compute that (full, non-causal "
                        f"attention, fc over the target's hidden size, the target's vocabulary), so it cannot "
                        f"load this draft")


def draft_config_from_engine(cfg: dict, source: str) -> dict:
    """config.json as the engines read it -> DFlashConfig.to_dict() (target_layers in eyas's numbering)."""
    from eyas.draft.dflash import DFlashConfig, auto_target_layers

    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in cfg]
    if missing:
        raise EyasError(f"{source}: no {', '.join(missing)}; not a DFlash draft's config (a Qwen3 config of the "
                        f"draft's layers)")
    _refuse_other_computation(cfg, source)
    dfc = cfg.get("dflash_config") or {}
    num_layers = int(cfg.get("num_hidden_layers", 1))
    ids = dfc.get("target_layer_ids", cfg.get("target_layer_ids"))
    n_target = dfc.get("num_target_layers", cfg.get("num_target_layers"))
    if ids is not None:
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise EyasError(f"{source}: dflash_config.target_layer_ids {ids} must be 0-based decoder-layer ids")
        target_layers = [i + 1 for i in ids]
    elif n_target is not None:  # the engines' (and the reference's) default choice
        target_layers = auto_target_layers(int(n_target), num_layers)
    else:
        raise EyasError(f"{source}: neither dflash_config.target_layer_ids nor num_target_layers: the target "
                        f"layers this draft reads are unknown; add dflash_config.target_layer_ids")
    if n_target is not None and target_layers[-1] > int(n_target):
        raise EyasError(f"{source}: target_layer_ids {ids} are out of range for num_target_layers {n_target}")
    mask = dfc.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise EyasError(f"{source}: no dflash_config.mask_token_id (SGLang may look `mask_token` up in the "
                        f"tokenizer; vLLM and eyas need the id): add it to dflash_config")
    blocks = {int(b) for b in (dfc.get("block_size"), cfg.get("block_size")) if b is not None}
    if len(blocks) > 1:
        raise EyasError(f"{source}: block_size {cfg['block_size']} at the top level but {dfc['block_size']} in "
                        f"dflash_config; SGLang reads dflash_config's first: make them agree")
    try:
        return DFlashConfig.from_target_config(cfg, target_layers, int(mask), num_layers=num_layers,
                                               block_size=blocks.pop() if blocks else 16).to_dict()
    except (KeyError, TypeError, ValueError) as e:
        raise EyasError(f"{source}: not a DFlash draft config eyas can build ({type(e).__name__}: {e})") from None


def meta_from_export(d: Path, cfg: dict, read_doc) -> tuple[dict, dict]:
    """(draft config dict, meta) of a DFlash export; an eyas export's eyas.json must agree with config.json."""
    source = d / "config.json"
    dc = draft_config_from_engine(cfg, str(source))
    meta = {"kind": "dflash", "aux_layers": dc["target_layers"], "target": None, "target_model": None,
            "features": "fused", "ttt": None,
            "num_layers": cfg.get("num_target_layers", (cfg.get("dflash_config") or {}).get("num_target_layers")),
            "target_architectures": None, "target_name_or_path": None, "store": None}
    if not (d / "eyas.json").is_file():
        return dc, meta
    ej = read_doc(d / "eyas.json")
    if ej.get("format") not in FORMATS or ej.get("method") != "dflash":
        raise EyasError(f"{d / 'eyas.json'}: format {ej.get('format')!r}, method {ej.get('method')!r}, but config.json "
                        f"is a DFlash draft's (an sglang or vllm export of method dflash)")
    written = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    if written != ej.get("aux_layers_written") or to_dflash_ids(ej.get("aux_layers") or []) != written:
        raise EyasError(f"{source}: dflash_config.target_layer_ids is {written}, but eyas.json says "
                        f"{ej.get('aux_layers_written')} was written there (its aux_layers {ej.get('aux_layers')} "
                        f"- 1); without them the engine reads other layers: export again")
    from eyas.draft.dflash import DFlashConfig

    try:
        exact = DFlashConfig.from_dict(ej.get("draft_config") or {}).to_dict()
    except (TypeError, ValueError) as e:
        raise EyasError(f"{d / 'eyas.json'}: draft_config is not a DFlash draft's ({e})") from None
    differ = [k for k in exact if exact[k] != dc[k]]
    if differ:
        raise EyasError(f"{source}: {', '.join(f'{k}={dc[k]!r}' for k in differ)} there, but eyas.json's draft has "
                        f"{', '.join(f'{k}={exact[k]!r}' for k in differ)}; an engine reads config.json and would "
                        f"compute another draft: export again")
    meta.update(kind=ej["format"], aux_layers=ej.get("aux_layers"), target=ej.get("target"),
                target_model=ej.get("target_model"), features=ej.get("features", "fused"), ttt=ej.get("ttt"),
                num_layers=ej.get("target_num_layers", meta["num_layers"]),
                target_architectures=ej.get("target_architectures"),
                target_name_or_path=ej.get("target_name_or_path"))
    return exact, meta


def from_foreign(raw: dict, num_layers: int, source: str) -> dict:
    """File names (unprefixed, or `model.`-prefixed) -> the draft's names; unknown or missing ones are an error."""
    known = draft_keys(num_layers) + TARGET_KEYS
    out, unknown = {}, []
    for key, value in raw.items():
        name = key[len("model."):] if key.startswith("model.") else key
        if name.endswith("rotary_emb.inv_freq"):  # a rotary cache, recomputed from the config
            continue
        if name not in known:
            unknown.append(key)
        elif name in out:
            raise EyasError(f"{source}: two keys map to {name!r} (one of them is {key!r}); keep one spelling")
        else:
            out[name] = value
    if unknown:
        raise EyasError(f"{source}: weights {sorted(unknown)[:6]} belong to no {num_layers}-layer DFlash draft "
                        f"(fc, hidden_norm, layers.0..{num_layers - 1}.*, norm); the config and the weights do "
                        f"not belong together: use the config.json or draft.json written with them")
    missing = [k for k in draft_keys(num_layers) if k not in out]
    if missing:
        raise EyasError(f"{source}: missing draft weights {missing[:6]}{' ...' if len(missing) > 6 else ''}; the "
                        f"file is incomplete: copy it again, or use another checkpoint (step-*) or export")
    return out


def build(d: Path, weights_path: Path, raw: dict, draft_cfg: dict, meta: dict, embed_tokens=None, lm_head=None):
    """(DFlashDraft fp32 CPU eval, meta) from the file's tensors; the target's embedding and head come from the
    file, else from the arguments (shape-checked), else NaN so that forgetting them shows at once."""
    import torch

    from eyas.draft.dflash import DFlashConfig, DFlashDraft

    try:
        dc = DFlashConfig.from_dict(draft_cfg)
    except (TypeError, ValueError) as e:
        raise EyasError(f"{d}: the draft config does not describe a DFlash draft ({e})") from None
    aux = meta.get("aux_layers")
    if aux is not None and list(aux) != dc.target_layers:
        raise EyasError(f"{d}: aux_layers {aux} differ from the draft config's target_layers {dc.target_layers}; "
                        f"the draft's files are inconsistent: use another checkpoint or export")
    state = from_foreign(raw, dc.num_layers, str(weights_path))
    draft = DFlashDraft(dc)
    expected = draft.state_dict()
    for name, value in state.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise EyasError(f"{weights_path}: {name} has shape {list(value.shape)}, the config implies "
                            f"{list(expected[name].shape)}: config and weights do not belong together (use the "
                            f"config.json or draft.json written with these weights)")
    given = {"embed_tokens.weight": embed_tokens, "lm_head.weight": lm_head}
    for name, tensor in given.items():
        if name in state:
            continue
        if tensor is None:
            state[name] = torch.full_like(expected[name], float("nan"))
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            made_for = (meta.get("target") or {}).get("name") or meta.get("target_model")
            raise EyasError(f"{d}: the DFlash draft is built for a target {name.split('.')[0]} of shape "
                            f"{list(expected[name].shape)} (vocabulary, hidden size), the one given has shape "
                            f"{list(tensor.shape)}: it was trained for another target "
                            f"({f'made for {made_for!r}' if made_for else 'its files do not name it'}); "
                            f"use the draft's own target")
        state[name] = tensor.detach()
    draft.load_state_dict({k: v.float().cpu() for k, v in state.items()}, strict=True)
    draft.eval()
    has = {k: k in raw or f"model.{k}" in raw or given[k] is not None for k in TARGET_KEYS}
    meta.update(method="dflash", path=str(d), draft_config=dc.to_dict(), aux_layers=dc.target_layers,
                has_embed=has["embed_tokens.weight"], has_lm_head=has["lm_head.weight"])
    return draft, meta
