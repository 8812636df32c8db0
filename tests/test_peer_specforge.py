"""bench/peer_specforge.py's conversions, without SpecForge: the offline records it writes, the draft config
for the same target, and SpecForge's exported draft read back by eyas exactly."""

import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.formats import load_draft
from eyas.formats.keys import to_midlayer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("peer_specforge", ROOT / "bench" / "peer_specforge.py")
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)

TARGET = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "vocab_size": 320,
          "num_hidden_layers": 30, "model_type": "llama", "pad_token_id": 256}
MANIFEST = {"target_config": TARGET, "vocab_size": 320, "hidden_size": 64, "aux_layers": [2, 15, 27]}


def test_features_are_specforge_offline_records(tmp_path):
    torch.manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 320, (t,)), "loss_mask": (torch.arange(t) > 2).long(),
                "aux_hidden": torch.randn(t, 3 * 64, dtype=torch.bfloat16),
                "final_hidden": torch.randn(t, 64, dtype=torch.bfloat16)} for t in (5, 9, 12)]
    stats = peer.write_features(samples, tmp_path, max_len=10, indices=[0, 1, 2])
    assert stats == {"num_samples": 3, "num_tokens": 5 + 9 + 10, "longest": 10, "lengths": [5, 9, 10]}
    files = sorted(tmp_path.glob("*.ckpt"))
    assert [f.name for f in files] == ["00000000.ckpt", "00000001.ckpt", "00000002.ckpt"]
    for f, s in zip(files, samples):
        rec = torch.load(f, weights_only=True)  # tensors only: SpecForge's reader unpickles it
        t = min(10, len(s["input_ids"]))
        assert set(rec) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert torch.equal(rec["input_ids"], s["input_ids"][:t]) and rec["input_ids"].shape == (t,)
        assert torch.equal(rec["loss_mask"], s["loss_mask"][:t])
        assert rec["hidden_state"].shape == (1, t, 64) and rec["aux_hidden_state"].shape == (1, t, 192)
        assert torch.equal(rec["hidden_state"][0], s["final_hidden"][:t])
        assert torch.equal(rec["aux_hidden_state"][0], s["aux_hidden"][:t])
    plan = peer.plan_batches(stats["lengths"], batch_tokens=20, grad_accum=1, epochs=2.0, steps=0, seed=0)
    assert plan["tokens_per_epoch"] == 24 and plan["steps"] == 2 * plan["batches_per_epoch"]
    # a second conversion into the same folder leaves no file of the first behind, and writes only the
    # samples asked for (eyas's held-out ones stay out of SpecForge's training set)
    assert peer.write_features(samples, tmp_path, max_len=10, indices=[2, 0])["num_samples"] == 2
    assert sorted(f.name for f in tmp_path.glob("*.ckpt")) == ["00000000.ckpt", "00000002.ckpt"]


def test_draft_config_is_the_targets_shape_with_sglang_aux_ids():
    cfg = peer.draft_config(MANIFEST, draft_vocab_size=256)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["hidden_size"], cfg["target_hidden_size"], cfg["head_dim"]) == (64, 64, 16)
    assert (cfg["vocab_size"], cfg["draft_vocab_size"]) == (320, 256)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]  # HF - 1
    assert "norm_output" not in cfg and "fc_norm" not in cfg  # SpecForge's defaults: plain EAGLE-3


def test_specforge_export_reads_back_exactly(tmp_path):
    torch.manual_seed(0)
    dc = DraftConfig.from_target_config(TARGET, draft_vocab_size=256)
    draft = Eagle3Draft(dc)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p).to(torch.bfloat16).float())  # bf16-exact, as the export stores them
    chosen = torch.sort(torch.randperm(320)[:256]).values
    t2d = torch.zeros(320, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_vocab(chosen - torch.arange(256), t2d)
    # SpecForge's `export --to hf`: save_pretrained of its model, midlayer.* names, the embedding included
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({k: v.contiguous() for k, v in to_midlayer(draft.state_dict()).items()}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(peer.draft_config(MANIFEST, 256)))

    out = peer.to_vllm_layout(hf, tmp_path / "draft", [2, 15, 27])
    loaded, meta = load_draft(out, embed_tokens=draft.embed_tokens.weight)
    assert meta["aux_layers"] == [2, 15, 27] and meta["kind"] == "flat"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert "norm_output" not in cfg and cfg["norm_before_residual"] is False
    want, got = draft.state_dict(), loaded.state_dict()
    assert set(want) == set(got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_specforge_steps_hold_as_many_samples_as_eyas_steps(tmp_path):
    """SpecForge counts a step in samples and pads each micro-batch to its longest: its micro-batch may hold at
    most batch_tokens // longest samples, and accumulation makes up the rest of eyas's samples per step."""
    from eyas.config import load_config

    cfg = load_config("tiny", ["train.batch_tokens=4096"])
    stats = {"num_samples": 360, "num_tokens": 55767, "longest": 272}  # 4096 // 272 = 15 a micro-batch
    for per_step, want in ((22.5, (11, 2)), (12.0, (12, 1)), (31.0, (10, 3)), (0.4, (1, 1))):
        plan = {"steps": 64, "samples_per_batch": per_step, "batches_per_epoch": 16, "tokens_per_epoch": 55767}
        doc, _ = peer.run_config(cfg, tmp_path, plan, stats, "cpu")
        got = (doc["training"]["batch_size"], doc["training"]["accumulation_steps"])
        assert got == want, per_step
        assert got[0] <= 15 and abs(got[0] * got[1] - max(1, round(per_step))) <= got[1] // 2
