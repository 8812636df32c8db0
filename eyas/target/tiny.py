"""Tiny random targets built in code (no files, no network): Llama, Qwen2 and a Qwen3-MoE.

They carry a byte-level tokenizer with a ChatML template, so every stage (templates, capture,
training, speculative decoding) runs on them exactly as on a real target, in seconds.
"""

from __future__ import annotations

from eyas.config import TINY_TARGETS

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 320  # 256 bytes + 3 specials, padded like real models pad their embedding tables

TINY_KINDS = TINY_TARGETS  # named in eyas.config, which the runner reads without importing model code


def _byte_chars() -> list[str]:
    """The GPT-2 byte-to-unicode table: 256 printable characters, one per byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def make_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def make_tiny_model(kind: str = "tiny", seed: int = 0):
    """A random model of the given family; same seed, same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=258, pad_token_id=256,
        bos_token_id=None,
    )
    if kind in ("tiny", "tiny-llama"):
        from transformers import LlamaConfig

        config = LlamaConfig(**common)
    elif kind == "tiny-qwen2":
        from transformers import Qwen2Config

        config = Qwen2Config(**common)
    elif kind == "tiny-moe":
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True)
    else:
        raise ValueError(f"unknown tiny target {kind!r}; choose one of: {', '.join(TINY_KINDS)}")
    config._attn_implementation = "sdpa"
    fork = torch.random.fork_rng(devices=[])
    with fork:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # larger-than-default init so that random models have peaked, non-trivial distributions
        for p in model.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.08)
    return model.eval()
