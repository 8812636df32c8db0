"""load_target(..., weights="head"): only embed_tokens, the final norm and lm_head are read; the rest stays on meta."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.common import EyasError
from eyas.target import load_target
from eyas.target.load import config_hash

HEAD_KEYS = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


def _save_tiny(out: Path, *, tied: bool, shard: str | None) -> Path:
    from transformers import AutoModelForCausalLM

    from eyas.target.tiny import make_tiny_model, make_tiny_tokenizer

    config = make_tiny_model("tiny").config
    config.tie_word_embeddings = tied
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    make_tiny_tokenizer().save_pretrained(out)
    return out


def _tensor_ranges(file: Path) -> dict[str, tuple[int, int]]:
    """{name: (start, end)} of each tensor's bytes in a safetensors file (8-byte header size, JSON header, data)."""
    raw = file.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    return {k: (8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def _corrupt_all_but_the_head(directory: Path) -> int:
    """Overwrite every non-head tensor's bytes with 0xff (NaN in fp32); returns how many tensors were hit."""
    hit = 0
    for file in directory.glob("*.safetensors"):
        with open(file, "r+b") as f:
            for name, (start, end) in _tensor_ranges(file).items():
                if name not in HEAD_KEYS:
                    f.seek(start)
                    f.write(b"\xff" * (end - start))
                    hit += 1
    return hit


def _assert_same_head(head, full):
    assert head.identity == full.identity
    assert (head.num_layers, head.hidden_size, head.vocab_size) == (full.num_layers, full.hidden_size, full.vocab_size)
    assert (head.device, head.dtype) == (full.device, full.dtype)
    assert head.config.to_json_string(use_diff=False) == full.config.to_json_string(use_diff=False)
    for part in ("embed_tokens", "norm", "lm_head"):
        torch.testing.assert_close(getattr(head, part).weight, getattr(full, part).weight, rtol=0, atol=0)
    assert not any(p.is_meta for m in (head.embed_tokens, head.norm, head.lm_head) for p in m.parameters())
    assert all(p.is_meta for p in head.layers.parameters())  # no decoder-layer weight was read
    assert not any(p.requires_grad for p in head.model.parameters())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("shard", [None, "40KB"], ids=["one-file", "sharded"])
def test_head_equals_a_full_load(tmp_path, tied, shard):
    directory = _save_tiny(tmp_path / "tiny", tied=tied, shard=shard)
    assert (directory / "model.safetensors.index.json").is_file() == bool(shard)
    head = load_target(str(directory), device="cpu", dtype="fp32", weights="head")
    _assert_same_head(head, load_target(str(directory), device="cpu", dtype="fp32"))
    assert (head.lm_head.weight is head.embed_tokens.weight) == tied
    bf16 = load_target(str(directory), device="cpu", dtype="bf16", weights="head")
    assert bf16.dtype == torch.bfloat16 and bf16.lm_head.weight.dtype == torch.bfloat16
    assert bf16.identity == head.identity


@pytest.mark.parametrize("shard", [None, "40KB"], ids=["one-file", "sharded"])
def test_head_reads_only_the_head_tensors(tmp_path, shard):
    directory = _save_tiny(tmp_path / "tiny", tied=False, shard=shard)
    before = load_target(str(directory), device="cpu", dtype="fp32")
    assert _corrupt_all_but_the_head(directory) >= 4 * 9  # every decoder layer's tensors
    assert torch.isnan(load_target(str(directory), device="cpu", dtype="fp32").layers[0].mlp.up_proj.weight).all()
    _assert_same_head(load_target(str(directory), device="cpu", dtype="fp32", weights="head"), before)


def test_head_of_the_default_target(smollm2):
    head = load_target("smollm2", device="cpu", dtype="fp32", weights="head")
    _assert_same_head(head, smollm2)
    assert head.lm_head.weight is head.embed_tokens.weight  # SmolLM2 ties them; its converted file holds one
    assert head.path == smollm2.path


def test_builtin_tiny_targets_are_built_whole(tiny_target):
    head = load_target("tiny", device="cpu", dtype="fp32", weights="head")
    assert head.identity == tiny_target.identity
    assert not any(p.is_meta for p in head.model.parameters())


def test_bin_only_checkpoint_is_a_one_line_error(tmp_path):
    directory = _save_tiny(tmp_path / "tiny", tied=False, shard=None)
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    with pytest.raises(EyasError) as e:
        load_target(str(directory), device="cpu", dtype="fp32", weights="head")
    msg = str(e.value)
    assert "\n" not in msg and ".bin" in msg and "safetensors" in msg and "pickle" in msg


def test_missing_head_tensor_is_a_one_line_error(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _save_tiny(tmp_path / "tiny", tied=False, shard=None)
    state = load_file(directory / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, directory / "model.safetensors")
    with pytest.raises(EyasError) as e:
        load_target(str(directory), device="cpu", dtype="fp32", weights="head")
    assert "\n" not in str(e.value) and "model.norm.weight" in str(e.value)


def test_quantized_checkpoint_builds_without_its_quantizer(tmp_path):
    """quantization_config names a method no installed package provides: the head load does not need it."""
    from transformers import AutoConfig

    directory = _save_tiny(tmp_path / "tiny", tied=False, shard=None)
    plain = load_target(str(directory), device="cpu", dtype="fp32", weights="head")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "no-such-quantizer", "bits": 4}
    (directory / "config.json").write_text(json.dumps(config))
    head = load_target(str(directory), device="cpu", dtype="fp32", weights="head")
    torch.testing.assert_close(head.lm_head.weight, plain.lm_head.weight, rtol=0, atol=0)
    assert head.identity["config_hash"] == config_hash(AutoConfig.from_pretrained(directory))
    assert head.identity["config_hash"] != plain.identity["config_hash"]
    assert head.config.quantization_config["quant_method"] == "no-such-quantizer"


def test_weights_must_be_all_or_head():
    with pytest.raises(ValueError, match="weights"):
        load_target("tiny", weights="layers")


# ---------------------------------------------------------------- a multimodal, quantized checkpoint (Kimi-K2.5's layout)

def _save_kimi_like(out: Path, *, quantized: bool) -> dict:
    """A tiny checkpoint laid out as Kimi-K2.5's: a kimi_k25 config with a DeepSeek-V3 text_config (and, when
    quantized, a compressed-tensors quantization_config), the language model's tensors under language_model.,
    a vision tower beside them, in two shards with an index. Returns the text model's state."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Kimi_K25Config

    from eyas.target.tiny import make_tiny_tokenizer

    text = DeepseekV3Config(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                            n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                            eos_token_id=258, pad_token_id=256, bos_token_id=None)
    torch.manual_seed(2)
    state = {k: v.contiguous() for k, v in AutoModelForCausalLM.from_config(text).state_dict().items()}
    text_dict = text.to_dict()
    if quantized:
        text_dict["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32,
                                                                              "type": "int", "symmetric": True}}}}
    Kimi_K25Config(text_config=text_dict, tie_word_embeddings=False,
                   vision_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "intermediate_size": 32}).save_pretrained(out)
    make_tiny_tokenizer().save_pretrained(out)
    first = {f"language_model.{k}": v for k, v in state.items() if "layers." not in k}
    rest = {f"language_model.{k}": v for k, v in state.items() if "layers." in k}
    rest["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2)
    weight_map = {}
    for name, part in (("model-00001-of-00002.safetensors", first), ("model-00002-of-00002.safetensors", rest)):
        save_file(part, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return state


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "compressed-tensors"])
def test_head_of_a_multimodal_checkpoint(tmp_path, quantized):
    from transformers import AutoConfig

    state = _save_kimi_like(tmp_path / "kimi", quantized=quantized)
    head = load_target(str(tmp_path / "kimi"), device="cpu", dtype="fp32", weights="head")
    assert head.config.model_type == "deepseek_v3"
    assert (head.num_layers, head.hidden_size, head.vocab_size) == (2, 64, 320)
    assert head.lm_head.weight is not head.embed_tokens.weight  # the top-level config unties them
    for part, key in (("embed_tokens", "model.embed_tokens.weight"), ("norm", "model.norm.weight"),
                      ("lm_head", "lm_head.weight")):
        torch.testing.assert_close(getattr(head, part).weight, state[key], rtol=0, atol=0)
    assert all(p.is_meta for p in head.layers.parameters())
    # the identity hashes the checkpoint's whole config, quantization included
    assert head.identity["config_hash"] == config_hash(AutoConfig.from_pretrained(tmp_path / "kimi"))
    assert hasattr(head.config, "quantization_config") == quantized


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "compressed-tensors"])
def test_multimodal_head_matches_transformers_full_load(tmp_path, quantized):
    """transformers reads the whole multimodal model (its own key renames, its quantizer): same head, same hash."""
    from transformers import AutoModelForImageTextToText

    if quantized:
        pytest.importorskip("compressed_tensors")
    _save_kimi_like(tmp_path / "kimi", quantized=quantized)
    head = load_target(str(tmp_path / "kimi"), device="cpu", dtype="fp32", weights="head")
    # the made-up vision tower does not fit the vision config, and is beside the point here
    full = AutoModelForImageTextToText.from_pretrained(tmp_path / "kimi", dtype=torch.float32,
                                                       ignore_mismatched_sizes=True)
    assert head.identity["config_hash"] == config_hash(full.config)
    torch.testing.assert_close(head.embed_tokens.weight, full.get_input_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(head.lm_head.weight, full.get_output_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(head.norm.weight, full.model.language_model.norm.weight, rtol=0, atol=0)


def test_multimodal_quantization_changes_the_identity(tmp_path):
    _save_kimi_like(tmp_path / "plain", quantized=False)
    _save_kimi_like(tmp_path / "int4", quantized=True)
    plain, int4 = (load_target(str(tmp_path / d), device="cpu", dtype="fp32", weights="head") for d in ("plain", "int4"))
    assert plain.identity["config_hash"] != int4.identity["config_hash"]
    assert plain.identity["tokenizer_hash"] == int4.identity["tokenizer_hash"]


# ---------------------------------------------------------------- a hub id already in the local HF cache

def test_hub_id_from_the_local_cache_offline(tmp_path):
    directory = _save_tiny(tmp_path / "tiny", tied=False, shard="40KB")
    want = load_target(str(directory), device="cpu", dtype="fp32", weights="head")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--eyas-test--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    directory.rename(repo / "snapshots" / commit)
    code = ("import json, sys; from eyas.target import load_target; "
            "t = load_target('eyas-test/tiny', device='cpu', dtype='fp32', weights='head'); "
            "print(json.dumps({'identity': t.identity, 'meta': all(p.is_meta for p in t.layers.parameters()), "
            "'norm': t.norm.weight.tolist()}))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["identity"] == {**want.identity, "name": "eyas-test/tiny"} and got["meta"]
    assert got["norm"] == want.norm.weight.tolist()
