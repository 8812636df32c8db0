"""DraftConfig: the shape of an EAGLE-3 draft, derived from the target's Hugging Face config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from eyas.config import ROPES

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")  # of the target's rope scaling, with train.rope=target


@dataclass
class DraftConfig:
    hidden_size: int  # H, the target's hidden size
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "linear"|"llama3", ...} as in HF configs
    max_position_embeddings: int
    vocab_size: int  # V, the target's vocabulary
    draft_vocab_size: int  # Vd <= V
    num_aux_layers: int = 3  # A: fc maps A*H -> H
    hidden_act: str = "silu"
    # EAGLE 3.1 layout switches, read by vLLM, SGLang and speculators under these names (docs/ALGORITHM.md
    # section 2). fc_norm: an RMSNorm of its own on each aux state before fc; norm_output: the next step's
    # hidden input is the normed output (the lm_head's input) instead of the pre-norm one
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must lie in 1..vocab_size={self.vocab_size}")
        if self.num_aux_layers < 1:
            raise ValueError(f"num_aux_layers={self.num_aux_layers} must be >= 1")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("fc_norm", "norm_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (silu, gelu, gelu_pytorch_tanh)")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling type {kind!r} is not supported by the draft; "
                                 f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_target_config(cls, hf: dict[str, Any], draft_vocab_size: int | None = None,
                           num_aux_layers: int = 3, fc_norm: bool = False,
                           norm_output: bool = False, rope: str = "target") -> "DraftConfig":
        """Build from a target's HF config dict (`model.config.to_dict()` or config.json).

        Reads rope settings from both the transformers<5 layout (`rope_theta`, `rope_scaling`) and the
        transformers>=5 layout (`rope_parameters`). Multimodal configs use their `text_config`. `rope`
        (train.rope): "target" takes the target's scaling, "plain" none (plain RoPE at the target's theta).
        """
        if rope not in ROPES:
            raise ValueError(f"train.rope={rope!r} must be one of {', '.join(ROPES)}")
        if "text_config" in hf and "hidden_size" not in hf:
            hf = hf["text_config"]
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        params = dict(hf.get("rope_parameters") or {})
        theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
        scaling = hf.get("rope_scaling") or params or None
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default" or rope == "plain":
                scaling = None
            elif kind not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"the target's rope_scaling type {kind!r} is not one the draft implements "
                                 f"({', '.join(SUPPORTED_ROPE_TYPES)}); set train.rope=plain: the draft then uses "
                                 f"plain RoPE at the target's rope_theta {theta:g}, with no scaling, like peers' "
                                 f"drafts for YaRN targets (its exported config says rope_scaling null)")
        vocab = int(hf["vocab_size"])
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            vocab_size=vocab,
            draft_vocab_size=int(draft_vocab_size or vocab),
            num_aux_layers=num_aux_layers,
            hidden_act=str(hf.get("hidden_act", "silu")),
            fc_norm=fc_norm,
            norm_output=norm_output,
        )
