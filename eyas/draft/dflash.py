"""The DFlash block-diffusion draft (docs/ALGORITHM.md section 7) as a plain nn.Module; no training, I/O or devices.

One forward drafts a whole block: the block is [anchor, mask, ..., mask] (block_size tokens, the anchor being
the token the target produced last), and the output at block slot i (1 <= i < block_size) is the draft's guess
of the token AT slot i. Every layer attends, without a causal mask, to the block and to the keys and values of
a context feature: the target's hidden states at `target_layers`, concatenated and fused by `fc` and
`hidden_norm`, projected by that layer's own k_proj / v_proj (plus k_norm and RoPE at the token's position).
Layers are Qwen3-style (q_norm and k_norm per head); the draft has no embedding or lm_head of its own: it uses
the target's (frozen, kept here for training and decoding, never exported).

API:

    cfg = DFlashConfig.from_target_config(target_hf_config, target_layers=[2, 11, 20], num_layers=1,
                                          block_size=16, mask_token_id=M)
    draft = DFlashDraft(cfg)
    draft.embed_tokens.weight.data.copy_(E); draft.lm_head.weight.data.copy_(W)    # the target's, frozen
    ctx = draft.fuse(aux)                          # [B, S, A*H] -> [B, S, H], aux in cfg.target_layers order
    kv = draft.context_kv(ctx, positions)          # per layer (k, v), each [B, kv_heads, S, head_dim]
    hidden = draft(block_ids, block_positions, kv, attention_mask=None)   # [B, Q, H], final norm applied
    logits = draft.lm_head(hidden)                 # [B, Q, V]

`attention_mask=None` lets every block query see every context key and every block key (decoding: the
context holds only committed tokens). Training passes a bool mask [B, 1, Q, S + Q] (True = may attend).

State-dict keys (the export keys, unprefixed as the engines load them): fc.weight [H, A*H], hidden_norm.weight,
layers.N.input_layernorm.weight, layers.N.self_attn.{q,k,v,o}_proj.weight, layers.N.self_attn.{q,k}_norm.weight,
layers.N.post_attention_layernorm.weight, layers.N.mlp.{gate,up,down}_proj.weight, norm.weight; plus the frozen
embed_tokens.weight and lm_head.weight, which exports leave out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.draft.config import DraftConfig
from eyas.draft.model import MLP, RMSNorm, RotaryEmbedding, apply_rope, rope_cos_sin


@dataclass
class DFlashConfig:
    hidden_size: int  # H, the target's
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int  # V, the target's: the draft scores the whole vocabulary with the target's lm_head
    target_layers: list[int]  # HF hidden_states indices (eyas's numbering: 0 = the embeddings), fused in this order
    mask_token_id: int
    num_layers: int = 1
    block_size: int = 16
    hidden_act: str = "silu"

    def __post_init__(self):
        self.target_layers = [int(x) for x in self.target_layers]
        if not self.target_layers:
            raise ValueError("target_layers must name at least one target layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} must be >= 1")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be >= 2 (the anchor and at least one guess)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the target's vocabulary 0..{self.vocab_size - 1}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (silu, gelu, gelu_pytorch_tanh)")

    @property
    def num_target_layers(self) -> int:
        return len(self.target_layers)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_target_config(cls, hf: dict[str, Any], target_layers: list[int], mask_token_id: int,
                           num_layers: int = 1, block_size: int = 16, rope: str = "target") -> "DFlashConfig":
        """The target's shape (read as for EAGLE-3: both transformers rope layouts, text_config; `rope` as
        train.rope) and the block."""
        base = DraftConfig.from_target_config(hf, num_aux_layers=max(1, len(target_layers)), rope=rope)
        keep = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in base.to_dict().items() if k in keep},
                   target_layers=list(target_layers), mask_token_id=int(mask_token_id), num_layers=int(num_layers),
                   block_size=int(block_size))


def auto_target_layers(num_hidden_layers: int, n: int) -> list[int]:
    """DFlash's default target layers in eyas's numbering (HF hidden_states indices): the reference picks n
    decoder layers evenly from layer 1 to layer L-3 (0-based decoder indices round(1 + i (L-4) / (n-1)); the
    middle one when n = 1) and reads each layer's output, hidden_states[id + 1]."""
    L = int(num_hidden_layers)
    if n == 1:
        ids = [L // 2]
    else:
        ids = [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
    return [i + 1 for i in ids]


class _Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, H] -> k, v [B, kv_heads, T, d] (k normed per head and rotated)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, attention_mask):
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k = torch.cat([ctx_k.to(k.dtype), k], dim=2)
        v = torch.cat([ctx_v.to(v.dtype), v], dim=2)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class _Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)  # EAGLE-3's: the same keys and activations

    def forward(self, h, cos, sin, ctx_k, ctx_v, attention_mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    method = "dflash"

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_target_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg)

    def num_trainable_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., A*H] target states (cfg.target_layers order) -> the context feature [..., H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(self.cfg, positions, dtype, self.rotary.inv_freq)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of the context feature ctx [B, S, H] at positions [B, S]."""
        cos, sin = self._cos_sin(positions, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_ids: torch.Tensor, positions: torch.Tensor, ctx_kv: list, attention_mask=None) -> torch.Tensor:
        """block_ids, positions [B, Q] -> the normed hidden states [B, Q, H] (lm_head's input)."""
        h = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = self._cos_sin(positions, h.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, attention_mask)
        return self.norm(h)


class DFlashContext:
    """The decoding-time context of a DFlash draft: each layer's keys and values of the committed tokens'
    features, grown in place (capacity doubles) and cut back by length."""

    def __init__(self, draft: DFlashDraft):
        self.draft = draft
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.length = 0

    def append(self, aux: torch.Tensor, positions: torch.Tensor) -> None:
        """Add the features aux [T, A*H] of the tokens at positions [1, T] (the next T positions)."""
        new = self.draft.context_kv(self.draft.fuse(aux)[None], positions)
        t = aux.shape[0]
        if self.kv is None or self.length + t > self.kv[0][0].shape[2]:
            cap = max(64, 2 * (self.length + t))
            grown = []
            for i, (k, v) in enumerate(new):
                big_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
                big_v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
                if self.kv is not None:
                    big_k[:, :, :self.length] = self.kv[i][0][:, :, :self.length]
                    big_v[:, :, :self.length] = self.kv[i][1][:, :, :self.length]
                grown.append((big_k, big_v))
            self.kv = grown
        for (big_k, big_v), (k, v) in zip(self.kv, new):
            big_k[:, :, self.length:self.length + t] = k
            big_v[:, :, self.length:self.length + t] = v
        self.length += t

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, :self.length], v[:, :, :self.length]) for k, v in self.kv]


@torch.no_grad()
def propose_block(draft: DFlashDraft, context: DFlashContext, anchor: torch.Tensor, start: int, k: int) -> torch.Tensor:
    """The draft's greedy guesses [k] (device, target ids) of the k tokens after `anchor` ([1] device tensor, the
    token at position `start`, not yet in the context), from one forward over [anchor, mask * (block_size - 1)]."""
    cfg = draft.cfg
    if not 1 <= k < cfg.block_size:
        raise ValueError(f"a DFlash draft of block_size {cfg.block_size} guesses 1..{cfg.block_size - 1} tokens, not {k}")
    device = anchor.device
    ids = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = anchor.reshape(())
    positions = torch.arange(start, start + cfg.block_size, device=device)[None]
    hidden = draft(ids, positions, context.views())
    return draft.lm_head(hidden[0, 1:k + 1]).argmax(-1)
