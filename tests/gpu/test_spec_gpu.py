"""Speculative decoding on CUDA: lossless in fp32, and an oracle draft beats plain decoding in bf16."""

import pytest
import torch

from eyas.speculative.engine import SpecEngine
from eyas.speculative.oracle import ScriptedDraft, untrained_draft
from eyas.layers import resolve_aux_layers
from eyas.target import load_target

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


def test_cuda_graphs_lossless_and_same_as_eager_static():
    """The static path replayed as CUDA graphs: plain, chains and trees give the target's greedy tokens
    (fp32), the same cycles as the same passes run eagerly, and a longer prompt grows the decoder once."""
    from eyas.speculative.graphs import GraphDecoder

    target = load_target("smollm2", device="cuda", dtype="fp32")
    aux = resolve_aux_layers(None, target.num_layers)
    draft = untrained_draft(target, 8192)[0]
    graphed = SpecEngine(target.model, draft, aux, sync_timing=False, static=True)
    eager = SpecEngine(target.model, draft, aux, static=True)
    for q in QUESTIONS:
        ids = chat_ids(target, q)
        ref = SpecEngine(target.model).plain_generate(ids, 48).tokens
        assert graphed.plain_generate(ids, 48).tokens == ref
        for setting in (dict(steps=3), dict(steps=5), dict(tree=(4, 5, 16))):
            eager._decoder = GraphDecoder(eager.runner, draft, 1024, graphs=False)
            want = eager.generate(ids, 48, **setting)
            got = graphed.generate(ids, 48, **setting)
            assert got.tokens == ref == want.tokens
            assert got.accepted_per_cycle == want.accepted_per_cycle
    assert graphed._decoder.graphs and graphed._decoder.capacity == 1024
    long_ids = chat_ids(target, " ".join(["word"] * 1100))
    ref = SpecEngine(target.model).plain_generate(long_ids, 16).tokens
    assert graphed.generate(long_ids, 16, steps=3).tokens == ref
    assert graphed._decoder.capacity == 2048


def test_cuda_graphs_on_the_tiny_target():
    """Capture and replay on the random tiny Llama (no model file needed): in fp32, plain, chain and tree
    decoding with graphs give the dynamic engine's greedy tokens; in bf16 (near-ties on a random model may flip
    between differently shaped kernels) they give exactly what the same passes give run eagerly."""
    from eyas.speculative.graphs import GraphDecoder

    for dtype in ("fp32", "bf16"):
        target = load_target("tiny", device="cuda", dtype=dtype)
        draft, aux = untrained_draft(target)
        prompt = list(range(1, 40))
        graphed = SpecEngine(target.model, draft, aux, sync_timing=False, static=True)
        eager = SpecEngine(target.model, draft, aux, static=True)
        eager._decoder = GraphDecoder(eager.runner, draft, 1024, graphs=False)
        ref = SpecEngine(target.model).plain_generate(prompt, 64).tokens if dtype == "fp32" else \
            eager.plain_generate(prompt, 64).tokens
        assert graphed.plain_generate(prompt, 64).tokens == ref
        for setting in (dict(steps=1), dict(steps=4), dict(tree=(4, 4, 12)), dict(tree=(3, 1, 3))):
            want = eager.generate(prompt, 64, **setting)
            got = graphed.generate(prompt, 64, **setting)
            assert got.tokens == want.tokens, (dtype, setting)
            assert dtype == "bf16" or got.tokens == ref
            assert got.accepted_per_cycle == want.accepted_per_cycle
        assert graphed._decoder.graphs and not eager._decoder.graphs


def test_a_pass_that_waits_for_the_host_fails_capture_with_the_way_out():
    """A pass that reads a tensor on the host cannot be captured; the error names the pass and the eager
    fallback the user can choose (no silent one)."""
    from eyas.common import EyasError
    from eyas.speculative.graphs import _Step

    x = torch.arange(4, device="cuda")
    out = torch.zeros((), dtype=torch.long, device="cuda")

    def reads_on_the_host():
        out.copy_(x[x.argmax()])  # a 0-dim tensor index: a host read

    with pytest.raises(EyasError, match=r"verify pass .*--no-cuda-graphs"):
        _Step(reads_on_the_host, torch.device("cuda"), True, "verify")


def test_cuda_graphs_over_narrow_attended_widths(monkeypatch):
    """With a width step of 32 slots a generation of 64 tokens after a 39-token prompt replays the graphs of
    four widths, all captured into one shared memory pool: graphed decoding must still give exactly what
    the same passes give eagerly (fp32: the target's greedy tokens)."""
    import eyas.speculative.graphs as graphs

    monkeypatch.setattr(graphs, "WIDTH_STEP", 32)
    target = load_target("tiny", device="cuda", dtype="fp32")
    draft, aux = untrained_draft(target)
    prompt = list(range(1, 40))
    graphed = SpecEngine(target.model, draft, aux, sync_timing=False, static=True)
    eager = SpecEngine(target.model, draft, aux, static=True)
    eager._decoder = graphs.GraphDecoder(eager.runner, draft, 1024, graphs=False)
    ref = SpecEngine(target.model).plain_generate(prompt, 64).tokens
    assert graphed.plain_generate(prompt, 64).tokens == ref
    for setting in (dict(steps=4), dict(tree=(4, 4, 12))):
        want = eager.generate(prompt, 64, **setting)
        got = graphed.generate(prompt, 64, **setting)
        assert got.tokens == want.tokens == ref, setting
        assert got.accepted_per_cycle == want.accepted_per_cycle
    assert graphed._decoder.graphs and graphed._decoder.widths[:2] == [32, 64]


def test_graphed_padded_prefills_equal_the_eager_prefill(monkeypatch):
    """Prompts of 5 to 130 tokens prefilled by graphs of 64, 128 and 192 tokens (padding after the prompt)
    on the SmolLM2 target in fp32: tokens and acceptance equal the eager prefill at the prompt's own
    length, and one graph serves every prompt of its padded length."""
    import eyas.speculative.graphs as graphs

    target = load_target("smollm2", device="cuda", dtype="fp32")
    aux = resolve_aux_layers(None, target.num_layers)
    draft = untrained_draft(target, 8192)[0]
    graphed = SpecEngine(target.model, draft, aux, sync_timing=False, static=True)
    ids = chat_ids(target, " ".join(["Tell me about the sea and the sky."] * 12))
    prompts = [ids[:5], ids[:63], ids[:64], ids[:65], ids[:100], ids[:130]]
    got = [(graphed.generate(p, 24, steps=3).tokens, graphed.generate(p, 24, tree=(4, 4, 12)).accepted_per_cycle,
            graphed.plain_generate(p, 24).tokens) for p in prompts]
    lengths = sorted({k[1] for k in graphed._decoder.steps if k[0] == "prefill"})
    assert lengths == [64, 128, 192] and graphed._decoder.graphs
    monkeypatch.setattr(graphs, "PREFILL_STEP", 0)
    eager = SpecEngine(target.model, draft, aux, sync_timing=False, static=True)
    want = [(eager.generate(p, 24, steps=3).tokens, eager.generate(p, 24, tree=(4, 4, 12)).accepted_per_cycle,
             eager.plain_generate(p, 24).tokens) for p in prompts]
    assert got == want


def test_graphed_cycles_with_the_draft_pass_compiled(monkeypatch):
    """compile_draft="inductor" (eyas eval --compile-draft): the draft-side passes compiled whole before capture
    give, in fp32 on the tiny target, the target's greedy tokens and the uncompiled graphs' acceptance per cycle,
    over several attended widths (passed on an H200, thirteenth session)."""
    import torch._dynamo as dynamo

    import eyas.speculative.graphs as graphs

    monkeypatch.setattr(graphs, "WIDTH_STEP", 32)
    target = load_target("tiny", device="cuda", dtype="fp32")
    draft, aux = untrained_draft(target)
    prompt = list(range(1, 40))
    ref = SpecEngine(target.model).plain_generate(prompt, 64).tokens
    runs = {}
    for backend in (None, "inductor"):
        dynamo.reset()
        engine = SpecEngine(target.model, draft, aux, sync_timing=False, static=True, compile_draft=backend)
        runs[backend] = [engine.generate(prompt, 64, **s) for s in (dict(steps=3), dict(tree=(4, 4, 12)))]
        assert all(r.tokens == ref for r in runs[backend])
        assert engine._decoder.draft_full_width == (backend is not None) and engine._decoder.graphs
    dynamo.reset()
    for got, want in zip(runs["inductor"], runs[None]):
        assert got.accepted_per_cycle == want.accepted_per_cycle


def test_compiled_draft_side_passes_keep_smollm2_lossless_fp32():
    """The full preset's eval compiles the draft-side passes: on SmolLM2 in fp32 chains and the tree through them
    give plain greedy decoding's tokens and the uncompiled graphs' acceptance per cycle (added in the thirteenth
    session, after its device time was spent: first run in the next one)."""
    import torch._dynamo as dynamo

    target = load_target("smollm2", device="cuda", dtype="fp32")
    aux = resolve_aux_layers(None, target.num_layers)
    draft = untrained_draft(target, 8192)[0]
    runs = {}
    for backend in (None, "inductor"):
        dynamo.reset()
        engine = SpecEngine(target.model, draft, aux, sync_timing=False, static=True, compile_draft=backend)
        runs[backend] = []
        for q in QUESTIONS[:2]:
            ids = chat_ids(target, q)
            ref = SpecEngine(target.model).plain_generate(ids, 48).tokens
            for setting in (dict(steps=3), dict(tree=(16, 5, 64))):
                res = engine.generate(ids, 48, **setting)
                assert res.tokens == ref
                runs[backend].append(res.accepted_per_cycle)
    dynamo.reset()
    assert runs["inductor"] == runs[None]
