"""SmolLM2 (the default target, from its cached HF conversion) captured through vLLM equals transformers per
layer, fp32, at the EAGLE-3 default layers."""

import torch
from conftest import rel_err, require_vllm

from eyas.target.capture import FeatureCapture

require_vllm()


def test_smollm2_default_layers_match_transformers(smollm2, smollm2_features):
    """The session's SmolLM2 engine (conftest.smollm2_features: start_features(smollm2, None, engine=ENGINE))."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, smollm2.vocab_size, (n,), generator=g).tolist() for n in (23, 64, 5)]
    features = smollm2_features
    got = features.capture(prompts)
    assert features.aux_layers == [2, 15, 27] and not got.refused
    reference, h = FeatureCapture(smollm2, None), smollm2.hidden_size
    errors = []
    for i, ids in enumerate(prompts):
        aux, final = got.states[i]
        want_aux, want_final = (x[0] for x in reference(torch.tensor([ids])))
        errors.append([rel_err(aux[:, j * h:(j + 1) * h], want_aux[:, j * h:(j + 1) * h]) for j in range(3)]
                      + [rel_err(final, want_final)])
    worst = [max(e[j] for e in errors) for j in range(4)]
    print("relative error per layer (2, 15, 27, final):", [f"{x:.1e}" for x in worst])
    assert max(worst) < 1e-4, worst
