"""Greedy speculative decoding on SmolLM2 (fp32) equals the target's plain greedy output, token for token."""

import pytest
import torch

from eyas.speculative.engine import SpecEngine
from eyas.layers import resolve_aux_layers
from eyas.speculative.oracle import ScriptedDraft, untrained_draft

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers."]
NEW = 12


def chat_ids(target, text):
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.fixture(scope="module")
def references(smollm2):
    """Plain greedy continuations by the engine, checked once against transformers' generate."""
    engine = SpecEngine(smollm2.model)
    refs = {q: engine.plain_generate(chat_ids(smollm2, q), NEW + 8).tokens for q in QUESTIONS}
    ids = chat_ids(smollm2, QUESTIONS[0])
    with torch.no_grad():
        hf = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=NEW + 8, do_sample=False,
                                    eos_token_id=None, pad_token_id=smollm2.tokenizer.pad_token_id)
    assert hf[0, len(ids):].tolist() == refs[QUESTIONS[0]]
    return refs


@pytest.fixture(scope="module")
def random_draft(smollm2):
    # a non-identity vocabulary: every fourth target id (d2t offsets), as a trained draft would have
    return untrained_draft(smollm2, 4096, target_ids=torch.arange(4096) * 4)


@pytest.mark.parametrize("setting", [dict(steps=3), dict(tree=(3, 3, 8))], ids=["chain3", "tree3x3x8"])
def test_untrained_draft_is_lossless(smollm2, references, random_draft, setting):
    draft, aux = random_draft
    engine = SpecEngine(smollm2.model, draft, aux)
    for q in QUESTIONS:
        res = engine.generate(chat_ids(smollm2, q), NEW, **setting)
        assert res.tokens == references[q][:NEW], q


@pytest.mark.parametrize("setting", [dict(steps=4), dict(tree=(2, 4, 8))], ids=["chain4", "tree2x4x8"])
def test_mostly_right_draft_is_lossless(smollm2, references, setting):
    """An oracle that errs at every third position: long accepted runs, broken chains, second branches."""
    for q in QUESTIONS[:2]:
        prompt = chat_ids(smollm2, q)
        draft = ScriptedDraft(prompt + references[q], smollm2.vocab_size, wrong_at=lambda p: p % 3 == 0)
        res = SpecEngine(smollm2.model, draft, resolve_aux_layers(None, smollm2.num_layers)).generate(
            prompt, NEW, **setting)
        assert res.tokens == references[q][:NEW], q
        assert res.tau > 1.5
