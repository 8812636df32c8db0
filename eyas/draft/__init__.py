"""The EAGLE-3 draft model (docs/ALGORITHM.md section 2) as a plain nn.Module; no training, I/O or devices.

API (stable; the trainer, the speculative-decoding engine and the exporters code against it):

    cfg = DraftConfig.from_target_config(target.config.to_dict(), draft_vocab_size=Vd, num_aux_layers=A)
    draft = Eagle3Draft(cfg)
    draft.embed_tokens.weight.data.copy_(target_embedding)  # frozen (requires_grad False)
    draft.set_vocab(d2t, t2d)                                 # d2t int64 [Vd] offsets, t2d bool [V]

    h0 = draft.fuse(aux_hidden)                               # [B, T, A*H] -> [B, T, H]
    out = draft(hidden, input_ids, position_ids, past_key_values=None, attention_mask=None)
    out.hidden_out       # [B, T, H] the next step's `hidden`: the pre-norm output (normed with cfg.norm_output)
    out.logits           # [B, T, Vd]
    out.past_key_values  # DraftCache: (k, v)-like, each [B, num_key_value_heads, S_past + T, head_dim]
    draft.to_target_ids(draft_ids)                            # draft_ids + d2t[draft_ids]

- `hidden` at position t goes with the token at t+1: feed (fuse(g_t), token_{t+1}) at position t and
  the logits predict token t+2; the next draft step feeds (hidden_out_t, token_{t+2}) at position t+1.
- `past_key_values` holds all keys/values so far (RoPE already applied); the new ones are appended,
  written in place into preallocated storage that grows geometrically (`DraftCache`, cache.py).
  Roll back by length with `cache.crop(S)` (a cache stays valid until something is appended through a
  shorter cache of the same storage). `cache[0]`, `cache[1]`, `k, v = cache` give the valid views, and
  a plain `(k, v)` tuple is still accepted as input (never written into).
- `attention_mask=None` is causal over past + new; otherwise a bool tensor [B, 1, T, S_past + T]
  (True = may attend), e.g. a tree mask. Attention is one `scaled_dot_product_attention` call in the
  model's dtype (its kernels accumulate in fp32; the scores are not materialised in fp32).
- `state_dict()` keys are the export keys: fc.weight, embed_tokens.weight, layers.0.hidden_norm.weight,
  layers.0.input_layernorm.weight, layers.0.self_attn.{q,k,v,o}_proj.weight,
  layers.0.post_attention_layernorm.weight, layers.0.mlp.{gate,up,down}_proj.weight, norm.weight,
  lm_head.weight, and the buffers d2t (int64 [Vd]) and t2d (bool [V]); with `cfg.fc_norm` also
  fc_norm.{0..A-1}.weight (one RMSNorm per aux state, applied in `fuse`). Until `set_vocab` is called the
  draft vocabulary is the first Vd target ids (d2t = 0).
- `rope_cos_sin(cfg, position_ids, dtype, inv_freq=None)` -> cos, sin [B, T, head_dim] and
  `apply_rope(x, cos, sin)` for x [B, heads, T, head_dim]; rope types default, linear and llama3. The
  draft computes `inv_freq` once (`draft.rotary.inv_freq`, a non-persistent fp32 buffer: no state-dict key).
"""

from eyas.draft.cache import DraftCache
from eyas.draft.config import DraftConfig
from eyas.draft.model import DraftOutput, Eagle3Draft, apply_rope, rope_cos_sin, rope_inv_freq

__all__ = ["DraftConfig", "Eagle3Draft", "DraftOutput", "DraftCache", "rope_cos_sin", "apply_rope", "rope_inv_freq"]
