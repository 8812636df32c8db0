"""The draft module: export keys, RoPE parity with transformers, KV cache and tree mask consistency,
and the per-step host work of a draft step (inv_freq once per model, an in-place KV cache)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close

from eyas.draft import DraftCache, DraftConfig, Eagle3Draft, apply_rope, rope_cos_sin, rope_inv_freq

EXPORT_KEYS = {
    "fc.weight", "embed_tokens.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def small_cfg(rope: str = "target", **kw) -> DraftConfig:
    hf = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              vocab_size=320, rms_norm_eps=1e-5, max_position_embeddings=512, head_dim=16,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf.update(kw)
    return DraftConfig.from_target_config(hf, draft_vocab_size=200, num_aux_layers=3, rope=rope)


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
    with pytest.raises(ValueError, match=r"'yarn' is not one the draft implements.*set train.rope=plain"):
        small_cfg(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})


def test_plain_rope_drops_the_targets_scaling_and_keeps_its_theta():
    """train.rope=plain: a YaRN target (Kimi K2, DeepSeek V3) gets a draft with plain RoPE at its rope_theta,
    which rotates exactly as a default-rope draft of that theta; the target's rope is the default."""
    yarn = {"rope_type": "yarn", "rope_theta": 5e4, "factor": 32.0, "original_max_position_embeddings": 4096,
            "beta_fast": 1.0, "beta_slow": 1.0}
    hf = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=320,
              rms_norm_eps=1e-5, max_position_embeddings=131072, head_dim=16, rope_parameters=yarn)
    plain = DraftConfig.from_target_config(hf, draft_vocab_size=200, rope="plain")
    assert plain.rope_scaling is None and plain.rope_theta == 5e4
    default = DraftConfig.from_target_config({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 5e4}},
                                             draft_vocab_size=200)
    assert plain == default
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    assert small_cfg(rope="plain", rope_parameters=llama3).rope_scaling is None
    # the default, train.rope=target, keeps a scaling the draft implements
    assert small_cfg(rope_parameters=llama3).rope_scaling is not None
    with pytest.raises(ValueError, match="train.rope='other'"):
        DraftConfig.from_target_config(hf, rope="other")


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
    gen = torch.Generator().manual_seed(0)  # seeded: with unseeded inputs the 1e-5 tolerance failed now and then
    q, k = torch.randn(2, 4, 150, 16, generator=gen), torch.randn(2, 2, 150, 16, generator=gen)
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


# ---------------------------------------------------------------- per-step host work of the draft

class CatCounter(TorchFunctionMode):
    """Counts torch.cat calls that build a [B, heads, S, d] tensor longer than `new` along S: a copy of
    the whole KV cache (apply_rope's own cat stays at the new tokens' length)."""

    def __init__(self, new: int):
        super().__init__()
        self.new, self.full_copies = new, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("cat", "concat", "concatenate") and isinstance(out, torch.Tensor):
            self.full_copies += out.dim() == 4 and out.shape[2] > self.new
        return out


def test_inv_freq_is_computed_once_per_model(monkeypatch):
    import eyas.draft.model as model

    draft = _draft()
    assert "rotary.inv_freq" not in draft.state_dict() and set(draft.state_dict()) == EXPORT_KEYS
    assert torch.equal(draft.rotary.inv_freq, model.rope_inv_freq(draft.cfg))
    calls = []
    real = model.rope_inv_freq
    monkeypatch.setattr(model, "rope_inv_freq", lambda cfg: calls.append(1) or real(cfg))
    hidden, ids = torch.randn(1, 6, 64), torch.randint(0, 320, (1, 6))
    with torch.no_grad():
        out = draft(hidden[:, :3], ids[:, :3], torch.arange(3)[None])
        for i in range(3, 6):
            out = draft(hidden[:, i:i + 1], ids[:, i:i + 1], torch.tensor([[i]]), past_key_values=out.past_key_values)
    assert calls == []  # not once per forward
    # the cached frequencies give bit-identical cos/sin to computing them (the training path's call)
    pos = torch.arange(40).view(2, 20)
    for got, ref in zip(draft.rotary.cos_sin(pos), rope_cos_sin(draft.cfg, pos)):
        assert torch.equal(got, ref)


def test_inv_freq_stays_exact_fp32_when_the_model_is_cast():
    draft = _draft().to(torch.bfloat16)
    assert draft.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(draft.rotary.inv_freq, rope_inv_freq(draft.cfg))
    assert draft.fc.weight.dtype == torch.bfloat16 and set(draft.state_dict()) == EXPORT_KEYS


def _step(draft, cache, hidden, ids, pos, mask=None):
    return draft(hidden, ids, pos, past_key_values=cache, attention_mask=mask)


def test_cache_is_written_in_place_without_copying_the_whole_cache():
    draft = _draft()
    hidden, ids = torch.randn(1, 80, 64), torch.randint(0, 320, (1, 80))
    with torch.no_grad():
        out = draft(hidden[:, :4], ids[:, :4], torch.arange(4)[None])
        cache = out.past_key_values
        assert isinstance(cache, DraftCache) and cache.length == 4
        stores, copies = [], 0
        for i in range(4, 80):
            with CatCounter(new=1) as c:
                out = _step(draft, cache, hidden[:, i:i + 1], ids[:, i:i + 1], torch.tensor([[i]]))
            copies += c.full_copies
            cache = out.past_key_values
            stores.append(cache.k_store.data_ptr())
            if i == 40:  # a rollback by length keeps the storage
                cache = cache.crop(30)
                assert cache.k_store.data_ptr() == stores[-1] and cache.length == 30
    assert copies == 0
    # 76 steps (lengths 5..69 with a rollback), storage replaced only when full: 4 -> 64 -> 128 slots
    switches = [j for j in range(1, len(stores)) if stores[j] != stores[j - 1]]
    assert len(set(stores)) == 2 and switches == [len(stores) - 5]  # the step to length 65


def test_cache_path_equals_concatenation_semantics():
    """In-place cache vs the old (k, v) concatenation, over chain steps, a rollback, a tree-style step
    (siblings under a mask) and its rollback, and storage growth: logits and caches bit-identical."""
    draft = _draft()
    torch.manual_seed(3)
    hidden, ids = torch.randn(1, 400, 64), torch.randint(0, 320, (1, 400))

    def concat(past, out, t):  # the old semantics: a fresh [B, nkv, S + T, d] tensor
        k, v = out.past_key_values
        return (torch.cat([past[0], k[:, :, -t:]], dim=2), torch.cat([past[1], v[:, :, -t:]], dim=2))

    with torch.no_grad():
        first = draft(hidden[:, :5], ids[:, :5], torch.arange(5)[None])
        cache, ref = first.past_key_values, tuple(t.clone() for t in first.past_key_values)
        n, i = 5, 5
        while n < 100:
            if i % 7 == 0:  # tree-style: 3 siblings at position n see the past and themselves, then roll back
                f = 3
                mask = torch.cat([torch.ones(f, n, dtype=torch.bool), torch.eye(f, dtype=torch.bool)], 1)[None, None]
                args = (hidden[:, i:i + f], ids[:, i:i + f], torch.full((1, f), n), mask)
                a, b = _step(draft, cache, *args), _step(draft, tuple(t.clone() for t in ref), *args)
                assert torch.equal(a.logits, b.logits)
                ref_grown = concat(ref, a, f)
                assert all(torch.equal(x, y) for x, y in zip(a.past_key_values, ref_grown))
                cache = a.past_key_values.crop(n)  # by length; the next step overwrites the siblings
            elif i % 5 == 0:  # rollback of two entries
                n -= 2
                cache, ref = cache.crop(n), (ref[0][:, :, :n], ref[1][:, :, :n])
            else:
                t = 1 if i % 3 else 2
                args = (hidden[:, i:i + t], ids[:, i:i + t], torch.arange(n, n + t)[None])
                a, b = _step(draft, cache, *args), _step(draft, tuple(x.clone() for x in ref), *args)
                assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden_out, b.hidden_out)
                cache, ref = a.past_key_values, concat(ref, a, t)
                n += t
                assert cache.length == n and all(torch.equal(x, y) for x, y in zip(cache, ref))
            i += 1
    assert cache.capacity >= 100 and cache.capacity < 400


def test_tuple_caches_are_never_written_into():
    draft = _draft()
    hidden, ids = torch.randn(1, 8, 64), torch.randint(0, 320, (1, 8))
    with torch.no_grad():
        full = draft(hidden, ids, torch.arange(8)[None]).past_key_values
        k, v = full
        snapshot = (k.clone(), v.clone())
        past = (k[:, :, :3], v[:, :, :3])  # a prefix view of a longer cache, as the training tests use
        out = draft(hidden[:, 5:7], ids[:, 5:7], torch.arange(3, 5)[None], past_key_values=past)
    assert torch.equal(k, snapshot[0]) and torch.equal(v, snapshot[1])
    assert out.past_key_values.length == 5


def test_cache_under_autograd_stays_out_of_place():
    draft = _draft()
    hidden, ids = torch.randn(1, 6, 64), torch.randint(0, 320, (1, 6))
    out = draft(hidden[:, :3], ids[:, :3], torch.arange(3)[None])
    loss = out.logits.sum()
    for i in range(3, 6):
        out = draft(out.hidden_out[:, -1:], ids[:, i:i + 1], torch.tensor([[i]]), past_key_values=out.past_key_values)
        loss = loss + out.logits.sum()
    loss.backward()  # no "modified by an inplace operation"
    assert draft.fc.weight.grad is None and draft.layers[0].self_attn.k_proj.weight.grad is not None
