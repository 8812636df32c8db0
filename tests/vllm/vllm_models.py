"""Tiny random targets saved as HF directories for vLLM: a Llama (head_dim 32: vLLM's CPU attention takes no
smaller head) and a DeepSeek-V3 (MLA + MoE, the architecture of Kimi-K2.5)."""

from pathlib import Path

import torch

from eyas.target.tiny import TINY_VOCAB, make_tiny_tokenizer

_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=258,
               pad_token_id=256, bos_token_id=None)


def _save(config, out: Path, seed: int) -> Path:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for p in model.parameters():  # larger than the default init: peaked, non-trivial states
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.08)
    model.save_pretrained(out)
    make_tiny_tokenizer().save_pretrained(out)
    return out


def tiny_llama_dir(out: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig

    return _save(LlamaConfig(**_COMMON, num_attention_heads=2, num_key_value_heads=1), out, seed)


def tiny_deepseek_v3_dir(out: Path, seed: int = 0) -> Path:
    """MLA needs its real head sizes in vLLM (kv_lora_rank 512, rope 64, nope 128, v 128); vLLM reads the router's
    topk_method and scoring_func, which transformers 5 does not write: both added as DeepSeek-V3's config has them."""
    import json

    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**_COMMON, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                              first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0)
    _save(config, out, seed)
    path = out / "config.json"
    raw = json.loads(path.read_text())
    raw.update(topk_method="noaux_tc", scoring_func="sigmoid")
    path.write_text(json.dumps(raw, indent=2))
    return out


def prepared_dir(path: Path, num_samples: int, vocab: int = 300, max_len: int = 60, seed: int = 0) -> Path:
    """A prepared directory (the prepare stage's layout) of random token ids with a loss mask on the tail."""
    import json

    import datasets
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, max_len + 1, size=num_samples)
    ids = [rng.integers(0, vocab, size=n).astype(np.int32).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    datasets.Dataset.from_dict({"sample_id": [f"s{i:04d}" for i in range(num_samples)], "input_ids": ids,
                                "loss_mask": masks}).save_to_disk(str(path / "dataset"))
    (path / "prepare.json").write_text(json.dumps({"source": "vllm tests", "num_kept": num_samples}))
    return path
