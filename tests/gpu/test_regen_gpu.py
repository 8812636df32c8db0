"""Regeneration on CUDA: decoding steps replayed as CUDA graphs give what eager decoding gives."""

import pytest
import torch

import eyas.common
from eyas.data.regenerate import generate_stream
from eyas.data.template import ChatTemplate, stop_token_ids
from eyas.target import load_target

pytestmark = pytest.mark.gpu


def _all(model, prompts, **kw):
    got = {}
    for finished in generate_stream(model, prompts, **kw):
        for i, res in finished:
            got[i] = res
    return [got[i] for i in range(len(prompts))]


@pytest.mark.parametrize("spec, dtype", [("tiny", "fp32"), ("smollm2", "fp32")])
def test_graphed_continuous_batching_equals_eager(spec, dtype, monkeypatch):
    target = load_target(spec, device="cuda", dtype=dtype)
    tok = target.tokenizer
    template = ChatTemplate(tok, stop_token_ids(tok, target.model.generation_config))
    prompts = [template.prompt_ids([{"role": "user", "content": "Tell me something about " * (i % 5) + f"number {i}."}])
               for i in range(24)]
    captured = []
    real = eyas.common.capture_cuda_graph
    monkeypatch.setattr(eyas.common, "capture_cuda_graph", lambda *a, **k: captured.append(a[2]) or real(*a, **k))
    pad = tok.pad_token_id if tok.pad_token_id is not None else template.stop_ids[0]
    kw = dict(max_new_tokens=40, stop_ids=template.stop_ids, pad_id=pad, slots=5, check_every=4)
    eager = _all(target.model, prompts, cuda_graphs=False, **kw)
    assert not captured
    graphed = _all(target.model, prompts, cuda_graphs=True, **kw)
    assert captured and all("regeneration step" in what for what in captured)
    assert graphed == eager
    # and eager continuous batching is plain greedy decoding of each prompt on its own
    for p, res in list(zip(prompts, eager))[:4]:
        ref = target.model.generate(torch.tensor([p], device="cuda"), max_new_tokens=40, do_sample=False,
                                    eos_token_id=template.stop_ids, pad_token_id=pad)[0, len(p):].tolist()
        cut = next((j for j, t in enumerate(ref) if t in template.stop_ids), None)
        assert res["tokens"] == (ref if cut is None else ref[:cut])
