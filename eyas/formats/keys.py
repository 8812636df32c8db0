"""The one key map between eyas's draft state dict and the names other tools write and read.

eyas's names (`Eagle3Draft.state_dict()`) are the unprefixed export keys of docs/ALGORITHM.md section 6;
vLLM and speculators load them as they are. Two other spellings exist in the wild:

- `midlayer.*` for the decoder layer: EAGLE's and SpecForge's trainers write it, and SGLang's
  `LlamaForCausalLMEagle3` names its layer `model.midlayer` and silently skips any weight it cannot
  place, so an SGLang export must use it (vLLM renames `midlayer.` to `layers.0.` itself).
- a `model.` prefix on everything but `lm_head`, as `save_pretrained` of a wrapped model writes.

An EAGLE 3.1 draft with `fc_norm` adds one RMSNorm per aux state, `fc_norm.{i}.weight`: vLLM, SGLang's
newer loader and speculators all load that name (older SGLang also read `aux_norm_low/mid/high`).

Every foreign key is translated through the explicit table below; anything left over is an error,
never silently dropped.
"""

from __future__ import annotations

# the decoder layer's parameters, relative to the layer
LAYER_PARAMS = (
    "hidden_norm.weight",
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
TOP_PARAMS = ("fc.weight", "norm.weight", "lm_head.weight")
VOCAB_BUFFERS = ("d2t", "t2d")
EMBED = "embed_tokens.weight"

EYAS_KEYS = TOP_PARAMS + tuple(f"layers.0.{p}" for p in LAYER_PARAMS)  # always present
MAX_AUX = 16  # the most aux states a draft's fc_norm may hold a norm for
FC_NORM_KEYS = tuple(f"fc_norm.{i}.weight" for i in range(MAX_AUX))  # present with cfg.fc_norm only

# eyas name -> midlayer name (SGLang, EAGLE and SpecForge checkpoints)
TO_MIDLAYER = {f"layers.0.{p}": f"midlayer.{p}" for p in LAYER_PARAMS}

# every spelling we accept -> the eyas name
FROM_FOREIGN: dict[str, str] = {}
for _name in EYAS_KEYS + FC_NORM_KEYS + VOCAB_BUFFERS + (EMBED,):
    _aliases = {_name, f"model.{_name}"}
    if _name in TO_MIDLAYER:
        _mid = TO_MIDLAYER[_name]
        _aliases |= {_mid, f"model.{_mid}"}
    for _alias in _aliases:
        FROM_FOREIGN[_alias] = _name

for _i, _old in enumerate(("low", "mid", "high")):  # SGLang's earlier names of the three aux norms
    FROM_FOREIGN[f"aux_norm_{_old}.weight"] = FROM_FOREIGN[f"model.aux_norm_{_old}.weight"] = FC_NORM_KEYS[_i]

# keys that carry no draft weights: rotary caches of old checkpoints, speculators' frozen copies of
# the verifier's head and norm (used only for its training loss)
IGNORED = {
    "layers.0.self_attn.rotary_emb.inv_freq", "midlayer.self_attn.rotary_emb.inv_freq",
    "verifier_lm_head.weight", "verifier_norm.weight",
}


def to_midlayer(state: dict) -> dict:
    """eyas names -> SGLang/EAGLE names (`layers.0.X` -> `midlayer.X`); other keys unchanged."""
    return {TO_MIDLAYER.get(k, k): v for k, v in state.items()}


def from_foreign(state: dict, source: str) -> dict:
    """Any accepted spelling -> eyas names. Raises ValueError naming unknown or missing keys."""
    out, unknown = {}, []
    for key, value in state.items():
        if key in IGNORED:
            continue
        name = FROM_FOREIGN.get(key)
        if name is None:
            unknown.append(key)
        elif name in out:
            raise ValueError(f"{source}: two keys map to {name!r} (one of them is {key!r})")
        else:
            out[name] = value
    if unknown:
        raise ValueError(f"{source}: unexpected weight names {sorted(unknown)[:6]}; expected eyas/vLLM names "
                         f"(fc.weight, layers.0.*) or EAGLE/SGLang names (midlayer.*)")
    missing = [k for k in EYAS_KEYS if k not in out]
    if missing:
        raise ValueError(f"{source}: missing draft weights {missing}")
    if ("d2t" in out) != ("t2d" in out):
        raise ValueError(f"{source}: has only one of d2t and t2d; both are needed to map the draft vocabulary")
    return out
