"""A target's head alone: input embeddings, final norm and lm_head, read from its safetensors.

Capture through vLLM needs the target's identity, config, tokenizer, final norm and the embed/lm_head
weights the store records, never the decoder layers; for a 1 T-parameter target those could not be held
on the CPU at all. The model is built from its config on the meta device, only the head tensors are read
(safe_open reads a tensor's bytes and nothing else) and materialised; the decoder layers stay on meta.
"""

from __future__ import annotations

import copy
from pathlib import Path

from eyas.common import EyasError, read_json
from eyas.target.load import Target, config_hash, explained_errors, tokenizer_hash

INDEX = "model.safetensors.index.json"


def load_head(path: Path, name: str, what: str, device, dtype, trust_remote_code: bool, *, fetch=None) -> Target:
    """The Target of the checkpoint in `path` with only its head materialised (on `device`, in `dtype`).

    `fetch(filename) -> Path` brings a weight file that is not in `path` yet (a hub snapshot holds only the
    small files until then); for a local directory every file is already there."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with explained_errors(what, trust_remote_code=trust_remote_code):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        model_config = _config_to_build(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config, dtype=dtype, attn_implementation="sdpa",
                                                     trust_remote_code=trust_remote_code)
    quantization = getattr(config.get_text_config(), "quantization_config", None)
    if quantization is not None:  # a full load's config records it (the store keeps the target's config)
        model.config.quantization_config = quantization
    model.eval().requires_grad_(False)
    _read_head(model, path, fetch, device, dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    identity = {"name": name, "config_hash": config_hash(config), "tokenizer_hash": tokenizer_hash(tokenizer)}
    return Target(model=model, tokenizer=tokenizer, name=name, path=str(path), identity=identity)


def _config_to_build(config):
    """The causal LM's config to build on meta: a multimodal checkpoint's text_config (whose lm_head is tied
    or not as the checkpoint's top-level config says), without quantization_config, so that building needs no
    quantizer (the head tensors of quantized checkpoints are stored unquantized)."""
    text = copy.deepcopy(config.get_text_config())
    if config.get_text_config() is not config:
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    if hasattr(text, "quantization_config"):
        del text.quantization_config
    return text


def head_keys(model) -> dict[str, list[tuple[str, object, str]]]:
    """{name: [(name, module, parameter name), ...]} of the head's parameters, a tied embedding once under each
    of its names, e.g. {'model.embed_tokens.weight': [(.., embed, 'weight'), ('lm_head.weight', lm_head, 'weight')]}."""
    names = {module: name for name, module in model.named_modules()}
    by_param: dict[int, list] = {}
    for module in (model.get_input_embeddings(), model.model.norm, model.get_output_embeddings()):
        for pname, param in module.named_parameters(recurse=False):
            by_param.setdefault(id(param), []).append((f"{names[module]}.{pname}", module, pname))
    return {entries[0][0]: entries for entries in by_param.values()}


def _candidates(name: str) -> list[str]:
    """Where a checkpoint may keep a causal LM's tensor `name`: as is, or inside a multimodal model
    (Kimi-K2.5 and llava-style checkpoints: language_model.<name>; transformers >= 5: model.language_model.*)."""
    out = [name, f"language_model.{name}"]
    if name.startswith("model."):
        out.append(f"model.language_model.{name.removeprefix('model.')}")
    return out


def _read_head(model, path: Path, fetch, device, dtype) -> None:
    import torch
    from safetensors import safe_open

    where = weight_map(path, fetch)
    fetch = fetch or (lambda filename: path / filename)
    plan: dict[str, list] = {}  # weight file -> [(checkpoint key, entries)]
    for name, entries in head_keys(model).items():
        tried = [c for n, _, _ in entries for c in _candidates(n)]
        key = next((c for c in tried if c in where), None)
        if key is None:
            raise EyasError(f"{path}'s safetensors hold none of {', '.join(tried)}; eyas reads a causal LM's head "
                            f"under these names (plain or under language_model.)")
        plan.setdefault(where[key], []).append((key, entries))
    for filename, reads in plan.items():
        with safe_open(str(fetch(filename)), framework="pt") as f:
            for key, entries in reads:
                tensor = f.get_tensor(key)
                module, pname = entries[0][1], entries[0][2]
                want = tuple(getattr(module, pname).shape)
                if tuple(tensor.shape) != want:
                    raise EyasError(f"{path}: {key} has shape {tuple(tensor.shape)} but the config makes it {want}")
                param = torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
                for _, module, pname in entries:
                    setattr(module, pname, param)


def weight_map(path: Path, fetch=None) -> dict[str, str]:
    """{tensor name: safetensors file name} of the checkpoint in `path`: its index, or the files' headers.
    With `fetch` (a hub snapshot), an unsharded checkpoint's model.safetensors is fetched when absent."""
    from safetensors import safe_open

    if (path / INDEX).is_file():
        return dict(read_json(path / INDEX)["weight_map"])
    files = sorted(path.glob("*.safetensors"))
    if not files and any(path.glob("*.bin")):
        raise EyasError(f"{path} holds its weights only as PyTorch .bin files (pickles), which eyas does not load; "
                        f"convert them to safetensors or use a checkpoint that ships them")
    if not files and fetch is not None:
        files = [fetch("model.safetensors")]
    if not files:
        raise EyasError(f"{path} holds no .safetensors weights; eyas reads a target's weights from safetensors")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file.name))
    return out
