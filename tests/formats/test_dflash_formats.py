"""DFlash drafts: checkpoint -> export (sglang, vllm) -> load_draft round trips, the config fields each engine
reads, the refusals, and loading a foreign (z-lab style) DFlash directory. The target is a config and random
embedding and head tensors, so that nothing loads a model."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.common import EyasError
from eyas.draft import DraftConfig, Eagle3Draft
from eyas.draft.dflash import DFlashConfig, DFlashDraft
from eyas.formats import export, load_draft
from eyas.formats.dflash import draft_keys

TARGET_LAYERS = [1, 3]  # HF hidden_states ids on the 4-layer tiny target -> DFlash ids [0, 2]
BLOCK, MASK, NUM_LAYERS = 4, 300, 2
TARGET = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}  # the tiny Llama's shape
IDENTITY = {"name": "tiny", "config_hash": "85d99306749a5813", "tokenizer_hash": "3c706686fd006a66"}


def randomize(model, seed: int = 0):
    """Every parameter random (norms too, so that a swapped norm changes the output)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return model.eval()


def write_step(run, draft, doc: dict, frozen=("embed_tokens.weight", "lm_head.weight")):
    """RUN/step-0000010/{draft.json, model.safetensors} without the target's (`frozen`) tensors, and RUN/latest."""
    step = run / "step-0000010"
    step.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in draft.state_dict().items() if k not in frozen}
    save_file(state, str(step / "model.safetensors"))
    (step / "draft.json").write_text(json.dumps(doc, indent=2))
    os.symlink(step.name, run / "latest")
    return run


@pytest.fixture(scope="module")
def target_head() -> dict:
    """The target's embedding and lm_head, as load_draft takes them."""
    gen = torch.Generator().manual_seed(5)
    return {"embed_tokens": torch.randn(320, 64, generator=gen), "lm_head": torch.randn(320, 64, generator=gen)}


@pytest.fixture()
def dflash_run(target_head, tmp_path):
    """A checkpoint as `eyas train` with train.method=dflash writes it, and its draft (holding the target's
    embedding and head)."""
    cfg = DFlashConfig.from_target_config(TARGET, TARGET_LAYERS, MASK, num_layers=NUM_LAYERS, block_size=BLOCK)
    draft = randomize(DFlashDraft(cfg))
    draft.embed_tokens.weight.data.copy_(target_head["embed_tokens"])
    draft.lm_head.weight.data.copy_(target_head["lm_head"])
    doc = {"method": "dflash", "draft_config": cfg.to_dict(), "aux_layers": TARGET_LAYERS, "target": IDENTITY,
           "target_model": "tiny", "store": None, "target_num_layers": 4, "target_architectures": ["LlamaForCausalLM"],
           "init_from": None, "features": "fused", "ttt": None}
    return write_step(tmp_path / "run", draft, doc), draft


def block_logits(draft: DFlashDraft, seed: int = 1) -> torch.Tensor:
    """The logits of one drafted block after a 6-token context: [1, BLOCK, V]."""
    gen = torch.Generator().manual_seed(seed)
    cfg, s = draft.cfg, 6
    aux = torch.randn(1, s, cfg.num_target_layers * cfg.hidden_size, generator=gen)  # [1, S, A*H]
    kv = draft.context_kv(draft.fuse(aux), torch.arange(s)[None])
    ids = torch.full((1, cfg.block_size), cfg.mask_token_id)
    ids[0, 0] = 7
    with torch.no_grad():
        return draft.lm_head(draft(ids, torch.arange(s, s + cfg.block_size)[None], kv))


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_round_trip_fp32_is_exact(fmt, dflash_run, target_head, tmp_path):
    run, draft = dflash_run
    out = export(run, tmp_path / "out", [fmt], dtype="fp32")[fmt]
    back, meta = load_draft(out, **target_head)
    assert isinstance(back, DFlashDraft) and not back.training
    assert meta["method"] == "dflash" and meta["kind"] == fmt and meta["aux_layers"] == TARGET_LAYERS
    assert meta["target"] == IDENTITY and meta["num_layers"] == 4 and meta["has_embed"]
    assert meta["draft_config"] == draft.cfg.to_dict()
    ref = draft.state_dict()
    assert back.state_dict().keys() == ref.keys()
    for name, value in back.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, ref[name]), name
    torch.testing.assert_close(block_logits(back), block_logits(draft), rtol=0, atol=0)


def test_checkpoint_loads_and_missing_target_tensors_are_nan(dflash_run, target_head):
    run, draft = dflash_run
    back, meta = load_draft(run)
    assert meta["method"] == "dflash" and meta["kind"] == "checkpoint" and meta["aux_layers"] == TARGET_LAYERS
    assert not meta["has_embed"] and not meta["has_lm_head"]
    assert back.embed_tokens.weight.isnan().all() and back.lm_head.weight.isnan().all()
    assert torch.equal(back.fc.weight, draft.fc.weight)
    back, meta = load_draft(run, **target_head)
    assert meta["has_embed"] and meta["has_lm_head"]
    torch.testing.assert_close(block_logits(back), block_logits(draft), rtol=0, atol=0)


def test_engine_config_fields_and_layout(dflash_run, tmp_path, capsys):
    """What vLLM and SGLang read (docs/FORMATS.md "DFlash drafts"), in one bf16 layout for both; speculators
    is not written and says so."""
    run, _ = dflash_run
    paths = export(run, tmp_path / "out", "all")
    assert sorted(paths) == ["sglang", "vllm"] and {p.name for p in paths.values()} == {"sglang", "vllm"}
    assert "export speculators -> not written" in capsys.readouterr().out
    assert not (tmp_path / "out" / "speculators").exists()
    for fmt, path in paths.items():
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
        assert cfg["block_size"] == BLOCK and cfg["dflash_config"]["block_size"] == BLOCK
        assert cfg["dflash_config"]["mask_token_id"] == MASK
        assert cfg["dflash_config"]["target_layer_ids"] == [i - 1 for i in TARGET_LAYERS] == [0, 2]
        assert cfg["num_target_layers"] == 4 and cfg["num_hidden_layers"] == NUM_LAYERS
        assert cfg["layer_types"] == ["full_attention"] * NUM_LAYERS
        assert cfg["attention_bias"] is False and cfg["tie_word_embeddings"] is False
        assert cfg["hidden_act"] == "silu" and cfg["vocab_size"] == 320 and cfg["torch_dtype"] == "bfloat16"
        shape = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
        assert [cfg[k] for k in shape] == [64, 4, 2, 16, 128]
        # vLLM captures dflash_config.target_layer_ids + 1 (HF index); SGLang requires every id < num_target_layers
        assert [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]] == TARGET_LAYERS
        assert all(i < cfg["num_target_layers"] for i in cfg["dflash_config"]["target_layer_ids"])
        weights = load_file(path / "model.safetensors")
        assert sorted(weights) == sorted(draft_keys(NUM_LAYERS))  # unprefixed, no embed_tokens, no lm_head
        assert {v.dtype for v in weights.values()} == {torch.bfloat16}
        ej = json.loads((path / "eyas.json").read_text())
        assert ej["method"] == "dflash" and ej["aux_layers"] == TARGET_LAYERS and ej["aux_layers_written"] == [0, 2]
        readme = (path / "README.md").read_text()
        assert str(path) in readme
    assert "--speculative-algorithm DFLASH" in (paths["sglang"] / "README.md").read_text()
    assert "--speculative-num-draft-tokens 4" in (paths["sglang"] / "README.md").read_text()
    assert '"method": "dflash"' in (paths["vllm"] / "README.md").read_text()
    assert '"num_speculative_tokens": 3' in (paths["vllm"] / "README.md").read_text()


def test_bf16_export_equals_bf16_rounded_weights(dflash_run, target_head, tmp_path):
    run, draft = dflash_run
    back, _ = load_draft(export(run, tmp_path / "out", ["vllm"])["vllm"], **target_head)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name not in ("embed_tokens.weight", "lm_head.weight"):
                p.copy_(p.to(torch.bfloat16).float())
    torch.testing.assert_close(block_logits(back), block_logits(draft), rtol=0, atol=0)


def test_speculators_alone_is_refused(dflash_run, tmp_path):
    run, _ = dflash_run
    with pytest.raises(EyasError, match="exports to sglang and vllm only"):
        export(run, tmp_path / "out", ["speculators"])
    assert not (tmp_path / "out").exists()


def _rewrite(path, change):
    weights = load_file(path / "model.safetensors")
    change(weights)
    save_file(weights, str(path / "model.safetensors"))


@pytest.mark.parametrize("change, message", [
    (lambda w: w.update({"fc.weight": torch.zeros(64, 64)}),
     r"fc.weight has shape \[64, 64\], the config implies \[64, 128\]"),
    (lambda w: w.pop("layers.1.mlp.up_proj.weight"), r"missing draft weights \['layers.1.mlp.up_proj.weight'\]"),
    (lambda w: w["norm.weight"].__setitem__(3, float("inf")), r"tensor norm.weight holds 1 value\(s\) that are NaN"),
    (lambda w: w.update({"layers.2.input_layernorm.weight": torch.ones(64)}), r"belong to no 2-layer DFlash draft"),
])
@pytest.mark.parametrize("where", ["checkpoint", "export"])
def test_bad_weights_are_refused(where, change, message, dflash_run, tmp_path):
    run, _ = dflash_run
    path = (run / "latest").resolve() if where == "checkpoint" else export(run, tmp_path / "out", ["vllm"])["vllm"]
    _rewrite(path, change)
    with pytest.raises(EyasError, match=message) as err:
        load_draft(path)
    assert "model.safetensors" in str(err.value)


def test_wrong_target_tensors_are_refused(dflash_run):
    run, _ = dflash_run
    with pytest.raises(EyasError, match=r"embed_tokens of shape \[320, 64\].*has shape \[100, 64\]"):
        load_draft(run, embed_tokens=torch.zeros(100, 64))
    with pytest.raises(EyasError, match=r"lm_head of shape \[320, 64\].*has shape \[320, 32\]"):
        load_draft(run, lm_head=torch.zeros(320, 32))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 2]),
     r"target_layer_ids is \[1, 2\], but eyas.json says \[0, 2\]"),
    (lambda c: c["dflash_config"].update(block_size=8), r"block_size 4 at the top level but 8 in dflash_config"),
    (lambda c: c.update(block_size=8, dflash_config={**c["dflash_config"], "block_size": 8}),
     r"block_size=8 there, but eyas.json's draft has block_size=4"),
    (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), r"layer_types \['sliding_attention'\]"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), r"no dflash_config.mask_token_id"),
])
def test_edited_config_is_refused(edit, message, dflash_run, tmp_path):
    run, _ = dflash_run
    out = export(run, tmp_path / "out", ["sglang"])["sglang"]
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EyasError, match=message):
        load_draft(out)


def test_foreign_dflash_directory_loads(dflash_run, target_head, tmp_path):
    """A z-lab style directory: no eyas.json, block_size at the top level only, `model.`-prefixed weights."""
    run, draft = dflash_run
    out = export(run, tmp_path / "out", ["vllm"], dtype="fp32")["vllm"]
    (out / "eyas.json").unlink()
    cfg = json.loads((out / "config.json").read_text())
    del cfg["dflash_config"]["block_size"]
    (out / "config.json").write_text(json.dumps(cfg))
    _rewrite(out, lambda w: w.update({f"model.{k}": w.pop(k) for k in list(w)}))
    back, meta = load_draft(out, **target_head)
    assert meta["method"] == "dflash" and meta["kind"] == "dflash" and meta["target"] is None
    assert meta["aux_layers"] == TARGET_LAYERS and meta["num_layers"] == 4
    assert back.cfg.to_dict() == draft.cfg.to_dict()
    torch.testing.assert_close(block_logits(back), block_logits(draft), rtol=0, atol=0)


def test_eagle3_checkpoint_still_loads_as_eagle3(target_head, tmp_path):
    """A draft.json without `method` (every EAGLE-3 checkpoint) is EAGLE-3's; lm_head is ignored (it has its own)."""
    draft = randomize(Eagle3Draft(DraftConfig.from_target_config(TARGET, num_aux_layers=3)))
    run = write_step(tmp_path / "run", draft, {"draft_config": draft.cfg.to_dict(), "aux_layers": [1, 2, 3],
                                                "features": "fused", "target": IDENTITY, "target_model": "tiny"},
                     frozen=("embed_tokens.weight",))
    back, meta = load_draft(run, **target_head)
    assert isinstance(back, Eagle3Draft) and meta["method"] == "eagle3" and meta["kind"] == "checkpoint"
    assert torch.equal(back.lm_head.weight, draft.lm_head.weight)
