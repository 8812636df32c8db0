"""Speculative decoding on the tiny random target: classic cases, caches, sampling distribution."""

import pytest

from eyas.speculative.engine import SpecEngine
from eyas.layers import resolve_aux_layers
from eyas.speculative.oracle import ScriptedDraft, always_wrong, untrained_draft

PROMPT = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 2]


def greedy_reference(target, prompt, n):
    return SpecEngine(target.model).plain_generate(prompt, n).tokens


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_oracle_gives_k_plus_one(tiny_target, kind):
    k, cycles = 4, 5
    n = 1 + cycles * (k + 1)
    ref = greedy_reference(tiny_target, PROMPT, n + 8)
    draft = ScriptedDraft(PROMPT + ref, tiny_target.vocab_size)
    engine = SpecEngine(tiny_target.model, draft, [1, 2, 3])
    setting = dict(steps=k) if kind == "chain" else dict(tree=(2, k, 8))
    res = engine.generate(PROMPT, n, **setting)
    assert res.tokens == ref[:n]
    assert res.num_cycles == cycles
    assert res.accepted_per_cycle == [k] * cycles
    assert res.tau == k + 1


@pytest.mark.parametrize("setting", [dict(steps=3), dict(tree=(3, 3, 8))])
def test_always_wrong_gives_tau_one(tiny_target, setting):
    n = 12
    ref = greedy_reference(tiny_target, PROMPT, n + 8)
    engine = SpecEngine(tiny_target.model, always_wrong(PROMPT + ref, tiny_target.vocab_size), [1, 2, 3])
    res = engine.generate(PROMPT, n, **setting)
    assert res.tokens == ref[:n]
    assert res.accepted_per_cycle == [0] * (n - 1)
    assert res.tau == 1.0


@pytest.mark.parametrize("setting", [dict(steps=3), dict(tree=(3, 4, 10))])
def test_partially_right_draft_is_lossless(tiny_target, setting):
    """Breaks at every third position: chains stop early, trees take second branches (cache.keep moves)."""
    n = 30
    ref = greedy_reference(tiny_target, PROMPT, n + 8)
    draft = ScriptedDraft(PROMPT + ref, tiny_target.vocab_size, wrong_at=lambda p: p % 3 == 0)
    res = SpecEngine(tiny_target.model, draft, [1, 2, 3]).generate(PROMPT, n, **setting)
    assert res.tokens == ref[:n]
    assert 1 < res.tau
    if "tree" in setting:
        assert res.tau > 3  # the second-choice branch is in the tree


@pytest.mark.parametrize("setting", [dict(steps=2), dict(steps=5), dict(tree=(4, 3, 12))])
def test_random_draft_is_lossless(tiny_target, setting):
    draft, aux = untrained_draft(tiny_target)
    n = 24
    res = SpecEngine(tiny_target.model, draft, aux).generate(PROMPT, n, **setting)
    assert res.tokens == greedy_reference(tiny_target, PROMPT, n)


def test_eos_and_max_new_tokens(tiny_target):
    ref = greedy_reference(tiny_target, PROMPT, 20)
    stop = ref[6]
    first = ref.index(stop)
    draft = ScriptedDraft(PROMPT + ref, tiny_target.vocab_size)
    res = SpecEngine(tiny_target.model, draft, [1, 2, 3]).generate(PROMPT, 20, steps=4, eos_token_ids=[stop])
    assert res.tokens == ref[: first + 1]
    res = SpecEngine(tiny_target.model, draft, [1, 2, 3]).generate(PROMPT, 7, steps=4)
    assert res.tokens == ref[:7]


def count_tokens(module):
    """Counts tokens entering `module` (an embedding) via a forward pre-hook."""
    counts = []
    handle = module.register_forward_pre_hook(lambda m, args: counts.append(args[0].numel()))
    return counts, handle


@pytest.mark.parametrize("setting", [dict(steps=3), dict(tree=(3, 3, 8))])
def test_per_cycle_cost_does_not_grow_with_context(tiny_target, setting):
    """Tokens fed to target and draft per cycle are the same after an 8- and a 400-token prompt:
    neither cache is ever recomputed from the start."""
    draft, aux = untrained_draft(tiny_target)
    per_cycle = {}
    for length in (8, 400):
        prompt = (PROMPT * 40)[:length]
        target_counts, h1 = count_tokens(tiny_target.model.model.embed_tokens)
        draft_counts, h2 = count_tokens(draft.embed_tokens)
        try:
            res = SpecEngine(tiny_target.model, draft, aux).generate(prompt, 20, **setting)
        finally:
            h1.remove()
            h2.remove()
        assert target_counts[0] == length  # prefill, once
        assert draft_counts[0] == length  # the draft's prefill: (g_t, token_{t+1}) for t < length
        assert sum(target_counts[1:]) == sum(res.target_tokens_per_cycle)
        assert sum(draft_counts[1:]) == sum(res.draft_tokens_per_cycle)
        per_cycle[length] = (target_counts[1:], draft_counts[1:])
        width = setting.get("steps") or setting["tree"][2]
        assert max(target_counts[1:]) == width + 1
    assert per_cycle[8] == per_cycle[400]


@pytest.mark.parametrize("kind", ["tiny-qwen2", "tiny-moe"])
def test_other_families_are_lossless(kind):
    from eyas.target import load_target

    target = load_target(kind, device="cpu", dtype="fp32")
    ref = greedy_reference(target, PROMPT, 16)
    draft = ScriptedDraft(PROMPT + ref + [0] * 8, target.vocab_size, wrong_at=lambda p: p % 3 == 0)
    aux = resolve_aux_layers(None, target.num_layers)
    for setting in (dict(steps=3), dict(tree=(2, 3, 6))):
        res = SpecEngine(target.model, draft, aux).generate(PROMPT, 16, **setting)
        assert res.tokens == ref and res.tau > 1.5


def test_static_path_grows_its_capacity_and_stays_lossless(tiny_target):
    """The fixed-shape path (eager on a CPU) sizes its caches in steps of 1,024 tokens: a prompt longer
    than the current capacity makes a larger decoder once, and the tokens stay the target's greedy ones
    for chains, trees, plain decoding and a short prompt after the long one (buffers reused across
    generations)."""
    draft, aux = untrained_draft(tiny_target)
    engine = SpecEngine(tiny_target.model, draft, aux, static=True)
    short = PROMPT
    long = (PROMPT * 90)[:1050]
    for prompt, capacity in ((short, 1024), (long, 2048), (short, 2048)):
        ref = greedy_reference(tiny_target, prompt, 20)
        assert engine.generate(prompt, 20, steps=3).tokens == ref
        assert engine.plain_generate(prompt, 20).tokens == ref
        # trees: the usual shape, one level only, and more nodes asked for than a tree of 2x3 can draft
        for tree in ((4, 4, 12), (3, 1, 8), (2, 3, 50)):
            res = engine.generate(prompt, 20, tree=tree)
            assert res.tokens == ref
            assert res.target_tokens_per_cycle[0] == min(tree[2], tree[0] + (tree[1] - 1) * tree[0] ** 2) + 1
        assert engine._decoder.capacity == capacity
    with pytest.raises(ValueError, match="Eagle3Draft"):
        SpecEngine(tiny_target.model, ScriptedDraft(PROMPT, tiny_target.vocab_size), aux, static=True).generate(
            PROMPT, 8, steps=2)


def test_compile_draft_needs_the_static_path(tiny_target):
    """The dynamic path has no compiled draft pass: asking for one there is an error, not a no-op."""
    draft, aux = untrained_draft(tiny_target)
    with pytest.raises(ValueError, match="needs static=True"):
        SpecEngine(tiny_target.model, draft, aux, static=False, compile_draft="aot_eager")


def test_a_draft_compile_that_fails_is_a_clear_error(tiny_target):
    """A compiler failure in the draft's pass (torch 2.11's inductor on an H200 did fail) names the experiment
    and the way out instead of ending in the compiler's own traceback; so does an unknown backend."""
    from eyas.common import EyasError

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no code for you")

    draft, aux = untrained_draft(tiny_target)
    engine = SpecEngine(tiny_target.model, draft, aux, static=True, compile_draft=broken_backend)
    with pytest.raises(EyasError, match="failed on the draft's pass.*no code for you.*without --compile-draft"):
        engine.generate(PROMPT, 8, steps=2)
    engine = SpecEngine(tiny_target.model, draft, aux, static=True, compile_draft="no_such_backend")
    with pytest.raises(EyasError, match="InvalidBackend.*without --compile-draft"):
        engine.generate(PROMPT, 8, steps=2)


def test_a_draft_compile_past_the_recompile_limit_is_a_clear_error(tiny_target, monkeypatch):
    """Every decoder compiles its own entries of the same pass functions; past dynamo's limit a fullgraph compile
    cannot fall back to eager and raises an error that is no TorchDynamoException: it too becomes an EyasError."""
    import torch._dynamo as dynamo

    import eyas.speculative.graphs as graphs
    from eyas.common import EyasError

    dynamo.reset()
    monkeypatch.setattr(graphs, "RECOMPILE_LIMIT", 1)
    draft, aux = untrained_draft(tiny_target)
    with dynamo.config.patch(recompile_limit=1):  # restored after (monkeypatch's undo deletes dynamo's key)
        SpecEngine(tiny_target.model, draft, aux, static=True, compile_draft="eager").generate(PROMPT, 8, steps=2)
        with pytest.raises(EyasError, match=r"failed on the draft's pass \(chain-3\).*without --compile-draft"):
            SpecEngine(tiny_target.model, draft, aux, static=True, compile_draft="eager").generate(PROMPT, 8, steps=3)
    dynamo.reset()
    assert dynamo.config.recompile_limit >= 1


def test_the_static_trees_argsort_is_stable_like_torch_sort():
    """The fixed-shape tree ranks candidates by counting (capturable in a CUDA graph); it must order them as
    a stable sort does, ties (equal scores, repeated depths, -inf log-probs) in index order."""
    import torch

    from eyas.speculative.graphs import _stable_order

    g = torch.Generator().manual_seed(0)
    cases = [torch.randint(0, 5, (40,), generator=g).float(), torch.randn(328, generator=g),
             torch.tensor([0.0, float("-inf"), -1.0, float("-inf"), 0.0, -1.0]), torch.tensor([3, 1, 2, 1, 3, 2, 1])]
    for keys in cases:
        assert torch.equal(_stable_order(keys), torch.sort(keys, stable=True).indices)
        assert torch.equal(_stable_order(-keys), torch.sort(keys, descending=True, stable=True).indices)


def test_eager_passes_of_varying_shape_leave_cudnn_out(tiny_target, monkeypatch):
    """The dynamic engine and the static path's eager prefill (PREFILL_STEP = 0) run under
    `varying_shape_attention` (cuDNN would build a plan for every new length); the static path's
    fixed-shape passes, its padded prefill included, do not."""
    import contextlib

    import torch

    import eyas.speculative.engine as engine_module
    import eyas.speculative.graphs as graphs
    from eyas.speculative.target import varying_shape_attention

    with varying_shape_attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    entered = []

    @contextlib.contextmanager
    def spy():
        entered.append(1)
        yield

    monkeypatch.setattr(graphs, "varying_shape_attention", spy)
    monkeypatch.setattr(engine_module, "varying_shape_attention", spy)
    draft, aux = untrained_draft(tiny_target)

    def static_generations():
        static = SpecEngine(tiny_target.model, draft, aux, static=True)
        static.generate(PROMPT, 12, steps=3)
        static.generate(PROMPT, 12, tree=(3, 3, 8))
        static.plain_generate(PROMPT, 12)

    static_generations()
    assert entered == []  # padded prefills and decoding passes: fixed shapes
    monkeypatch.setattr(graphs, "PREFILL_STEP", 0)
    static_generations()
    assert len(entered) == 3  # one eager prefill each, none of the cycles or steps
    dynamic = SpecEngine(tiny_target.model, draft, aux)
    dynamic.generate(PROMPT, 12, steps=3)
    dynamic.plain_generate(PROMPT, 12)
    assert len(entered) == 5  # the whole generation, once each
