"""Capture through vLLM equals capture through transformers on a tiny random Llama (fp32, one engine: the
session's, conftest.tiny_llama_features)."""

import pytest
import torch
from conftest import TINY_LLAMA_AUX as AUX
from conftest import rel_err, require_vllm

from eyas.common import EyasError
from eyas.target.capture import FeatureCapture

require_vllm()


@pytest.fixture(scope="module")
def target(tiny_llama_target):
    return tiny_llama_target


@pytest.fixture(scope="module")
def features(tiny_llama_features):
    return tiny_llama_features


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]


def test_every_layer_and_final_match_transformers(target, features):
    prompts = _prompts([9, 40, 17, 1, 130])
    got = features.capture(prompts)
    assert not got.refused and sorted(got.states) == list(range(len(prompts)))
    reference, h = FeatureCapture(target, AUX), target.hidden_size
    for i, ids in enumerate(prompts):
        aux, final = got.states[i]
        want_aux, want_final = (x[0] for x in reference(torch.tensor([ids])))
        assert aux.shape == (len(ids), len(AUX) * h) and final.shape == (len(ids), h)
        for j in range(len(AUX)):
            assert rel_err(aux[:, j * h:(j + 1) * h], want_aux[:, j * h:(j + 1) * h]) < 1e-5
        assert rel_err(final, want_final) < 1e-5  # post-norm: the lm_head's input
    assert list(features.engine.states_dir.iterdir()) == []  # every file read and deleted


def test_padded_batch_call_matches_feature_capture(target, features):
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 256, 256]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    aux, final = features(ids, mask)
    want_aux, want_final = FeatureCapture(target, AUX)(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(aux[real], want_aux[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final[real], want_final[real], rtol=1e-4, atol=1e-5)
    assert not aux[~real].any() and not final[~real].any()


def test_a_prompt_the_engine_refuses_is_reported_not_lost(features):
    too_long = features.engine.max_model_len
    got = features.capture(_prompts([12, too_long, 7]))
    assert sorted(got.states) == [0, 2] and list(got.refused) == [1]
    assert f"{too_long} tokens" in got.refused[1]
    ids = torch.zeros(1, too_long, dtype=torch.long)
    with pytest.raises(EyasError, match="refused 1 of 1 prompts.*max_model_len"):
        features(ids, torch.ones_like(ids))
