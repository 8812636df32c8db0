"""The EAGLE-3 draft as a plain nn.Module (docs/ALGORITHM.md section 2), and its rotary embedding.

Parameter names are the export keys; nothing here knows about training, devices or files.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from eyas.draft.cache import DraftCache
from eyas.draft.config import DraftConfig


# ---------------------------------------------------------------- rotary embedding

def rope_inv_freq(cfg: DraftConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, with "linear" or "llama3" scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq.float()


def rope_cos_sin(cfg: DraftConfig, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32,
                 inv_freq: torch.Tensor | None = None):
    """cos, sin [B, T, head_dim] for integer positions [B, T] (computed in fp32, then cast).
    `inv_freq`: `rope_inv_freq(cfg)` computed beforehand (e.g. a draft's `rotary.inv_freq`, already on
    the device), so that no call builds it on the host and copies it over; None computes it here."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(cfg)
    inv_freq = inv_freq.to(position_ids.device)  # [d/2]; a no-op when it is there already
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, d] by cos/sin [B, T, d] (the rotate-half layout of HF Llama)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RotaryEmbedding(nn.Module):
    """`rope_inv_freq(cfg)` computed once per model: a non-persistent buffer (not in the state dict, so
    the export keys are unchanged) that follows the model's device and stays exact fp32 whatever the
    model's dtype (a cast to bf16 would round the frequencies, so they are recomputed instead)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        device = self.inv_freq.device
        if device.type != "meta":  # .to(dtype), .half(), to_empty(): recompute, exact, where it now lives
            self.inv_freq = rope_inv_freq(self.cfg).to(device)
        return self

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32):
        return rope_cos_sin(self.cfg, position_ids, dtype, inv_freq=self.inv_freq)


# ---------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in fp32, rounded to x's dtype, then scaled (HF Llama's order); F.rms_norm is one kernel
        # on CUDA where the spelled-out formula is five, and the draft runs four norms per step
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    """GQA attention whose input is the 2H-wide concatenation [embedding, hidden]."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected, rotated q [B, nh, T, d] and k, v [B, nkv, T, d] for x [B, T, 2H]."""
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, past_key_values=None, attention_mask=None):
        """past_key_values: None, a DraftCache or a (k, v) tuple -> (out [B, T, H], DraftCache with the
        new entries appended, written in place into its storage; see eyas/draft/cache.py)."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        if past_key_values is None:
            cache = DraftCache(k, v)
        else:
            cache = DraftCache.wrap(past_key_values).append(k, v)
        k, v = cache.key, cache.value  # [B, nkv, S, d]
        s = k.shape[2]
        if attention_mask is None:  # causal over everything cached plus the new tokens
            attention_mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(s - t)
        groups = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        kr, vr = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # one fused kernel (softmax in fp32 inside) where the spelled-out attention took about ten
        out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=attention_mask)  # [B, nh, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), cache


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh" if "tanh" in self.act else "none")
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, 2H]: the normed embedding first, then the normed hidden state (serving-engine order)."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual over the hidden branch only, then the MLP block."""
        h = hidden + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftOutput(NamedTuple):
    hidden_out: torch.Tensor  # [B, T, H] fed back as the next step's hidden input (pre-norm unless norm_output)
    logits: torch.Tensor  # [B, T, Vd]
    past_key_values: DraftCache  # (k, v)-like, each [B, nkv, S, head_dim], new entries appended


class Eagle3Draft(nn.Module):
    """fc over A aux states, one decoder layer with a 2H attention input, norm, lm_head over Vd.

    With `cfg.fc_norm` each aux state gets its own RMSNorm before fc (`fc_norm.{i}.weight`, the name the
    engines load); with `cfg.norm_output` the normed output, not the pre-norm one, is fed back as the next
    step's hidden input. Without them the module and its state dict are the plain EAGLE-3 ones.
    """

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_aux_layers * h, h, bias=False)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(h, cfg.rms_norm_eps) for _ in range(cfg.num_aux_layers)])
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        # identity mapping until a vocabulary is loaded: draft id i is target id i
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.rotary = RotaryEmbedding(cfg)  # inv_freq once, not per forward; no state-dict key

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary (d2t offsets [Vd], t2d mask [V]) and check they agree."""
        assert d2t.shape == self.d2t.shape and t2d.shape == self.t2d.shape, (d2t.shape, t2d.shape)
        target_ids = torch.arange(len(d2t), device=d2t.device) + d2t
        if not bool(t2d[target_ids].all()) or int(t2d.sum()) != len(d2t):
            raise ValueError("d2t and t2d disagree: t2d must mark exactly the target ids i + d2t[i]")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def num_trainable_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[..., A*H] concatenated aux states -> [..., H]."""
        if self.cfg.fc_norm:
            chunks = aux_hidden.chunk(self.cfg.num_aux_layers, dim=-1)
            aux_hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def step_output(self, pre_norm: torch.Tensor) -> torch.Tensor:
        """The layer's pre-norm output [..., H] -> what the next step takes as its hidden input."""
        return self.norm(pre_norm) if self.cfg.norm_output else pre_norm

    def head_input(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """A step's hidden output (`step_output`) -> the lm_head's input: normed once either way."""
        return hidden_out if self.cfg.norm_output else self.norm(hidden_out)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(self, hidden, input_ids, position_ids, past_key_values=None, attention_mask=None) -> DraftOutput:
        layer = self.layers[0]
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rotary.cos_sin(position_ids, hidden.dtype)
        x = layer.attn_input(embeds, hidden)  # [B, T, 2H]
        attn_out, past = layer.self_attn(x, cos, sin, past_key_values, attention_mask)
        hidden_out = self.step_output(layer.finish(hidden, attn_out))  # [B, T, H]
        return DraftOutput(hidden_out, self.lm_head(self.head_input(hidden_out)), past)
