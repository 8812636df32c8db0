"""Speculative decoding on CUDA: lossless in fp32, and an oracle draft beats plain decoding in bf16."""

import pytest
import torch

from eyas.spec.engine import SpecEngine
from eyas.spec.oracle import ScriptedDraft, untrained_draft
from eyas.target import load_target, resolve_aux_layers

pytestmark = pytest.mark.gpu
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly."]


def chat_ids(target, text):
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.mark.parametrize("setting", [dict(steps=5), dict(tree=(4, 5, 16))])
def test_lossless_fp32_cuda(setting):
    target = load_target("smollm2", device="cuda", dtype="fp32")
    aux = resolve_aux_layers(None, target.num_layers)
    engine = SpecEngine(target.model, untrained_draft(target, 8192)[0], aux)
    for q in QUESTIONS:
        ids = chat_ids(target, q)
        ref = engine.plain_generate(ids, 48).tokens
        assert engine.generate(ids, 48, **setting).tokens == ref


def test_oracle_speedup_bf16_cuda():
    target = load_target("smollm2", device="cuda", dtype="bf16")
    aux = resolve_aux_layers(None, target.num_layers)
    ids = chat_ids(target, QUESTIONS[1])
    plain = SpecEngine(target.model)
    plain.plain_generate(ids, 16)
    ref = plain.plain_generate(ids, 128)
    engine = SpecEngine(target.model, ScriptedDraft(ids + ref.tokens, target.vocab_size), aux)
    engine.generate(ids, 16, steps=5)
    res = engine.generate(ids, 128, steps=5)
    assert res.tokens == ref.tokens
    assert res.total_s < ref.total_s  # ~6 tokens per target pass must beat 1


def test_no_sync_timing_is_lossless_and_plain_matches_generate_cuda():
    """sync_timing=False drops the per-phase synchronisations; plain decoding reads each token while the
    next forward is queued. Neither may change a token (fp32, so no near-tie flips)."""
    target = load_target("smollm2", device="cuda", dtype="fp32")
    aux = resolve_aux_layers(None, target.num_layers)
    engine = SpecEngine(target.model, untrained_draft(target, 8192)[0], aux, sync_timing=False)
    ids = chat_ids(target, QUESTIONS[0])
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        hf = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False,
                                   eos_token_id=None, pad_token_id=target.tokenizer.pad_token_id)[0, len(ids):].tolist()
    assert engine.plain_generate(ids, 40).tokens == hf
    for setting in (dict(steps=5), dict(tree=(4, 5, 16))):
        assert engine.generate(ids, 40, **setting).tokens == hf
