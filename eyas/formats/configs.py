"""The config.json each serving engine reads, and the README with its launch command (docs/ALGORITHM.md section 6).

Aux layer ids go into each config in that engine's own convention (docs/ALGORITHM.md section 1):
SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` as 0-based layer outputs (HF id - 1);
vLLM and speculators read a top-level `eagle_aux_hidden_state_layer_ids` in the HF convention.
"""

from __future__ import annotations

from pathlib import Path

from eyas.layers import to_sglang_ids

FORMATS = ("sglang", "vllm", "speculators")
TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SPECULATIVE_TOKENS = 3  # the chain length of the launch commands below
# target specs eyas knows by a short name -> what a serving engine loads
SERVABLE_NAMES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
                  "SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
NOT_SERVABLE = ("tiny", "tiny-llama", "tiny-qwen2", "tiny-moe")


def serving_target(meta: dict) -> str | None:
    """The hub id or directory an engine should serve as the target; None for eyas's test models.

    A checkpoint trained from a store records the target's name (a directory's basename), so a name that
    is neither known, a hub id nor an existing path falls back to the path the target was loaded from.
    """
    spec = meta.get("target_model")
    if not spec or spec in NOT_SERVABLE:
        return None
    if spec in SERVABLE_NAMES:
        return SERVABLE_NAMES[spec]
    path = Path(spec).expanduser()
    if path.exists():
        return str(path.resolve())
    if "/" in spec or not meta.get("target_name_or_path"):
        return spec
    return meta["target_name_or_path"]


def llama_layer_config(dc: dict) -> dict:
    """The draft's one decoder layer as a Llama config (both rope layouts: transformers 4 and 5 readers)."""
    scaling = dc["rope_scaling"] or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))  # "type": transformers' old spelling
    rope_parameters = {**scaling, "rope_type": rope_type, "rope_theta": dc["rope_theta"]}
    return {
        "model_type": "llama",
        "hidden_size": dc["hidden_size"],
        "intermediate_size": dc["intermediate_size"],
        "num_attention_heads": dc["num_attention_heads"],
        "num_key_value_heads": dc["num_key_value_heads"],
        "head_dim": dc["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": dc["hidden_act"],
        "rms_norm_eps": dc["rms_norm_eps"],
        "rope_theta": dc["rope_theta"],
        "rope_scaling": dc["rope_scaling"],
        "rope_parameters": rope_parameters,
        "max_position_embeddings": dc["max_position_embeddings"],
        "vocab_size": dc["vocab_size"],
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def layout_flags(dc: dict) -> dict:
    """The EAGLE 3.1 switches the draft has on, under the top-level names vLLM, SGLang and speculators read
    (`fc_norm`, `norm_output`; each engine takes a missing one as false)."""
    return {name: True for name in ("fc_norm", "norm_output") if dc.get(name)}


def _flat(dc: dict, aux_layers: list[int], dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **llama_layer_config(dc),
        "draft_vocab_size": dc["draft_vocab_size"],
        "target_hidden_size": dc["hidden_size"],
        "num_aux_hidden_states": len(aux_layers),
        **layout_flags(dc),
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
    }


def sglang_config(dc: dict, aux_layers: list[int], dtype: str) -> dict:
    cfg = _flat(dc, aux_layers, dtype)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": to_sglang_ids(aux_layers), "use_aux_hidden_state": True}
    return cfg


def vllm_config(dc: dict, aux_layers: list[int], dtype: str) -> dict:
    cfg = _flat(dc, aux_layers, dtype)
    cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    cfg["norm_before_residual"] = False  # vLLM's flat path defaults it to false too; explicit all the same
    cfg["eagle_config"] = {"use_aux_hidden_state": True}
    return cfg


def speculators_config(dc: dict, aux_layers: list[int], dtype: str, target: str | None,
                       architectures: list[str] | None) -> dict:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_layer_config(dc),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target, "architectures": list(architectures or [])},
        },
        "draft_vocab_size": dc["draft_vocab_size"],
        "target_hidden_size": dc["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "num_aux_hidden_states": len(aux_layers),
        # explicit, because readers disagree on the defaults (vLLM assumes norm_before_residual=true)
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": bool(dc.get("fc_norm")),
        "norm_output": bool(dc.get("norm_output")),
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
    }


def launch_command(fmt: str, target: str, draft_dir: str) -> str:
    """One line (scripts grep the README for it)."""
    k = SPECULATIVE_TOKENS
    if fmt == "sglang":
        return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {draft_dir} --speculative-num-steps {k} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
    spec = f'{{"model": "{draft_dir}", "method": "eagle3", "num_speculative_tokens": {k}}}'
    return f"vllm serve {target} --speculative-config '{spec}'"


def provenance(meta: dict) -> str:
    """The README paragraph naming the target a draft was trained for (every export's README has it)."""
    ident = meta.get("target") or {}
    return (f"Trained by eyas for the target **{ident.get('name', meta.get('target_model'))}** "
            f"(target spec `{meta.get('target_model')}`, config hash `{ident.get('config_hash')}`, "
            f"tokenizer hash `{ident.get('tokenizer_hash')}`). Serve it with exactly that target: "
            f"a different model, even a fine-tune of it, gives a draft that is rarely accepted.")


def readme(fmt: str, draft_dir: str, meta: dict, aux_written: list[int], dtype: str) -> str:
    target = serving_target(meta)
    engine = {"sglang": "SGLang", "vllm": "vLLM", "speculators": "vLLM (speculators format)"}[fmt]
    where = ("`eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang convention: HF index - 1)" if fmt == "sglang"
             else "top-level `eagle_aux_hidden_state_layer_ids` (HF `output_hidden_states` convention)")
    lines = [
        f"# EAGLE-3 draft for {engine}",
        "",
        provenance(meta),
        "",
        f"- aux layers (HF convention): {meta['aux_layers']}; written as {aux_written} in {where}",
        f"- draft vocabulary: {meta['draft_config']['draft_vocab_size']} of {meta['draft_config']['vocab_size']} "
        f"target tokens; weights in {TORCH_DTYPE_NAMES[dtype]}; `eyas.json` records the rest",
        "",
    ]
    flags = list(layout_flags(meta["draft_config"]))
    if flags:
        lines += [f"EAGLE 3.1 layout: {' and '.join(f'`{f}`' for f in flags)} on. The engine must read "
                  f"{'them' if len(flags) > 1 else 'it'}: vLLM and speculators do; for SGLang use a release whose "
                  f"EAGLE-3 loader names its layers `model.layers` (older ones ignore these flags and skip "
                  f"`fc_norm.*` weights without a word: correct text, acceptance near 1).", ""]
    lines += [
        "## Launch",
        "",
    ]
    if target is None:
        lines += [f"The target `{meta.get('target_model')}` is a test model built in code; no engine can serve it. "
                  f"For a real target the command is:", ""]
        target = "TARGET"
    lines += ["```bash", launch_command(fmt, target, draft_dir), "```", ""]
    return "\n".join(lines)
