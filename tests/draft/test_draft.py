"""The draft module: export keys, RoPE parity with transformers, KV cache and tree mask consistency."""

import pytest
import torch
from torch.testing import assert_close

from eyas.draft import DraftConfig, Eagle3Draft, apply_rope, rope_cos_sin

EXPORT_KEYS = {
    "fc.weight", "embed_tokens.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def small_cfg(**kw) -> DraftConfig:
    hf = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              vocab_size=320, rms_norm_eps=1e-5, max_position_embeddings=512, head_dim=16,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf.update(kw)
    return DraftConfig.from_target_config(hf, draft_vocab_size=200, num_aux_layers=3)


def test_state_dict_keys_and_shapes():
    cfg = small_cfg()
    draft = Eagle3Draft(cfg)
    sd = draft.state_dict()
    assert set(sd) == EXPORT_KEYS
    assert sd["fc.weight"].shape == (64, 192)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (64, 128)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (32, 128)
    assert sd["lm_head.weight"].shape == (200, 64)
    assert sd["d2t"].dtype == torch.long and sd["d2t"].shape == (200,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (320,)
    assert not draft.embed_tokens.weight.requires_grad
    assert draft.num_trainable_params() == sum(v.numel() for k, v in sd.items()
                                               if k not in ("embed_tokens.weight", "d2t", "t2d"))


def test_from_target_config_reads_both_rope_layouts():
    old = small_cfg(rope_parameters=None, rope_theta=5e5,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    new = small_cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling["rope_type"] == "llama3"
    assert small_cfg().rope_scaling is None
    with pytest.raises(ValueError, match="not supported"):
        small_cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
])
def test_rope_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=320, max_position_embeddings=512, rope_parameters=dict(rope))
    cfg = DraftConfig.from_target_config(hf.to_dict(), draft_vocab_size=320)
    pos = torch.arange(300).view(2, 150)
    cos, sin = rope_cos_sin(cfg, pos)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), pos)
    assert_close(cos, ref_cos)
    assert_close(sin, ref_sin)
    q, k = torch.randn(2, 4, 150, 16), torch.randn(2, 2, 150, 16)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    assert_close(apply_rope(q, cos, sin), ref_q)
    assert_close(apply_rope(k, cos, sin), ref_k)


def _draft(seed=0):
    torch.manual_seed(seed)
    draft = Eagle3Draft(small_cfg()).eval()
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.1) if p.dim() > 1 else torch.nn.init.normal_(p, 1.0, 0.1)
    return draft


def test_kv_cache_incremental_equals_full():
    draft = _draft()
    b, t = 2, 9
    hidden, ids = torch.randn(b, t, 64), torch.randint(0, 320, (b, t))
    pos = torch.arange(t).expand(b, t)
    full = draft(hidden, ids, pos)
    out = draft(hidden[:, :4], ids[:, :4], pos[:, :4])
    past, logits = out.past_key_values, [out.logits]
    for i in range(4, t):
        out = draft(hidden[:, i:i + 1], ids[:, i:i + 1], pos[:, i:i + 1], past_key_values=past)
        past = out.past_key_values
        logits.append(out.logits)
    assert past[0].shape == (b, 2, t, 16)
    assert_close(torch.cat(logits, 1), full.logits)


def test_tree_mask_causal_equals_default_and_masks_siblings():
    draft = _draft()
    b, t = 1, 6
    hidden, ids = torch.randn(b, t, 64), torch.randint(0, 320, (b, t))
    pos = torch.arange(t).expand(b, t)
    prefix = draft(hidden[:, :3], ids[:, :3], pos[:, :3])
    causal = torch.ones(3, 6, dtype=torch.bool).tril(3).view(1, 1, 3, 6)
    a = draft(hidden[:, 3:], ids[:, 3:], pos[:, 3:], past_key_values=prefix.past_key_values)
    m = draft(hidden[:, 3:], ids[:, 3:], pos[:, 3:], past_key_values=prefix.past_key_values, attention_mask=causal)
    assert_close(a.logits, m.logits)
    # two siblings at the same depth that see only the prefix and themselves: each equals a chain of one
    tree = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=torch.bool).view(1, 1, 2, 5)
    sib_pos = torch.tensor([[3, 3]])
    s = draft(hidden[:, 3:5], ids[:, 3:5], sib_pos, past_key_values=prefix.past_key_values, attention_mask=tree)
    for j in range(2):
        one = draft(hidden[:, 3 + j:4 + j], ids[:, 3 + j:4 + j], sib_pos[:, :1], past_key_values=prefix.past_key_values)
        assert_close(s.logits[:, j], one.logits[:, 0])


def test_vocab_mapping():
    draft = _draft()
    d2t = torch.zeros(200, dtype=torch.long)
    d2t[100:] = 120  # draft ids 100..199 -> target ids 220..319
    t2d = torch.zeros(320, dtype=torch.bool)
    t2d[:100] = True
    t2d[220:] = True
    draft.set_vocab(d2t, t2d)
    assert draft.to_target_ids(torch.tensor([0, 99, 100, 199])).tolist() == [0, 99, 220, 319]
    with pytest.raises(ValueError, match="disagree"):
        draft.set_vocab(d2t, torch.ones(320, dtype=torch.bool))
