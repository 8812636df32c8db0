"""Greedy lossless with a *trained* draft on SmolLM2 (fp32), chain and tree.

The draft is trained by the real trainer (`eyas.train.train`) for a few tens of steps on eight short
conversations whose answers are the target's own greedy continuations, prepared with the target's chat
template (`eyas.data.template.ChatTemplate`, as `eyas prepare` does) and a draft vocabulary built from
them (`eyas.data.vocab`); the features are captured once by `FeatureCapture` (an in-memory store).
The checkpoint is read back with `eyas.formats.load_draft`. Decoding the same prompts with `SpecEngine`
must then (1) give exactly the target's plain greedy tokens and (2) accept clearly more than the same
draft before training, so the test fails if training did nothing.
"""

import time

import pytest
import torch

from eyas.speculative.engine import SpecEngine

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "List three prime numbers.",
    "What color is the sky?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "Say hello in Spanish.",
    "What is two plus two?",
]
NEW = 12  # new tokens decoded per prompt
TRAIN_NEW = NEW + 3  # the training answers run a little further: a cut answer's last word may re-tokenize
SELECT_TREE = (4, 4, 12)  # the tree test_tree_select_bench_simulates_the_engine judges
# the target's greedy continuations are decoded once, as far as that test reads them (a tree drafted after the
# last of NEW tokens reaches SELECT_TREE[1] further); the training answers are their first TRAIN_NEW tokens
LONGER_NEW = NEW + SELECT_TREE[1] + 2
DRAFT_VOCAB = 1024
STEPS = 20
BASELINE_PROMPTS = 2  # the untrained draft (tau about 1, so one target pass per token) decodes only the first few
SETTINGS = {"chain3": dict(steps=3), "tree2x3x6": dict(tree=(2, 3, 6))}


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory):
    """Train a draft on the target's own greedy answers; returns everything the tests compare."""
    from eyas.common import seed_all
    from eyas.config import load_config
    from eyas.data.template import ChatTemplate, stop_token_ids
    from eyas.data.vocab import build_vocab, count_tokens
    from eyas.formats import load_draft
    from eyas.target.capture import FeatureCapture
    from eyas.train import TrainSource, train
    from eyas.train.loop import build_draft

    t0 = time.perf_counter()
    tok = smollm2.tokenizer
    template = ChatTemplate(tok, stop_token_ids(tok, smollm2.model.generation_config))
    eos = template.stop_ids
    plain = SpecEngine(smollm2.model)
    prompts, answers, longer, conversations = [], [], [], []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        prompt = template.prompt_ids(messages)
        greedy = plain.plain_generate(prompt, LONGER_NEW, eos_token_ids=eos).tokens
        answer = greedy[:TRAIN_NEW]  # greedy decoding to TRAIN_NEW tokens (it stops at the same eos)
        prompts.append(prompt)
        answers.append(answer)
        longer.append(greedy)
        text = tok.decode(answer, skip_special_tokens=True)
        conversations.append(messages + [{"role": "assistant", "content": text}])
    # the reference does not rest on the engine alone: transformers' greedy generate agrees on one prompt
    with torch.no_grad():
        hf = smollm2.model.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW, do_sample=False,
                                    eos_token_id=None, pad_token_id=tok.pad_token_id)
    head = answers[0][:NEW]  # ends at the first eos, where HF (told of no eos) goes on
    assert hf[0, len(prompts[0]):len(prompts[0]) + len(head)].tolist() == head
    t_ref = time.perf_counter()

    # the prepare path: (ids, assistant loss mask) from the chat template, then the draft vocabulary
    tokenized = template.tokenize_many(conversations)
    for prompt, answer, t in zip(prompts, answers, tokenized):
        assert not isinstance(t, Exception), t
        # the prepared sample is the prompt the engine is given plus the answer the target writes
        assert t.input_ids[:len(prompt)] == prompt and sum(t.loss_mask[:len(prompt)]) == 0
        head = answer[:NEW]
        assert t.input_ids[len(prompt):len(prompt) + len(head)] == head
    vocab = build_vocab(count_tokens(((t.input_ids, t.loss_mask) for t in tokenized), smollm2.vocab_size),
                        DRAFT_VOCAB)

    capture = FeatureCapture(smollm2)
    samples = []
    for i, t in enumerate(tokenized):
        ids = torch.tensor([t.input_ids])
        aux, final = capture(ids, torch.ones_like(ids, dtype=torch.bool))
        samples.append({"sample_id": str(i), "input_ids": ids[0], "loss_mask": torch.tensor(t.loss_mask),
                        "aux_hidden": aux[0].clone(), "final_hidden": final[0].clone()})
    source = TrainSource(
        samples=samples, lengths=[len(s["input_ids"]) for s in samples],
        embed_weight=smollm2.embed_tokens.weight.detach(), lm_head_weight=smollm2.lm_head.weight.detach(),
        target_config=smollm2.config.to_dict(), target=smollm2.identity, aux_layers=list(capture.aux_layers),
        d2t=vocab["d2t"], t2d=vocab["t2d"], target_model="smollm2")
    t_cap = time.perf_counter()

    longest = max(source.lengths)
    cfg = load_config("demo", [f"train.steps={STEPS}", "train.ttt=3", "train.lr=4e-3", "train.warmup_steps=3",
                               f"train.batch_tokens={longest * len(samples)}", "train.log_every=5",
                               f"train.save_every={STEPS}", "train.keep_last=1", "train.dtype=fp32",
                               "train.seed=0"])
    run_dir = tmp_path_factory.mktemp("trained-draft")
    summary = train(cfg, run_dir, source, device="cpu")
    t_train = time.perf_counter()

    draft, meta = load_draft(run_dir, embed_tokens=smollm2.embed_tokens.weight.detach())
    assert meta["aux_layers"] == list(capture.aux_layers) and meta["ttt"] == 3
    assert draft.cfg.draft_vocab_size == DRAFT_VOCAB and torch.equal(draft.t2d, vocab["t2d"])
    # the untrained baseline: the very draft the trainer started from (same seed, same vocabulary)
    seed_all(cfg.train.seed)
    untrained = build_draft(source, cfg.train.features).eval()
    print(f"\nrefs {t_ref - t0:.1f}s capture {t_cap - t_ref:.1f}s train {t_train - t_cap:.1f}s; "
          f"loss {summary['loss']:.3f} acc {[round(summary[f'acc_{k}'], 2) for k in range(3)]}")
    return dict(prompts=prompts, answers=[a[:NEW] for a in answers], longer=longer, eos=eos, draft=draft.eval(),
                untrained=untrained, aux=meta["aux_layers"], summary=summary, source=source, cfg=cfg)


@pytest.fixture(scope="module")
def dynamic(smollm2, trained):
    """The trained draft's generations on the dynamic engine (one engine for the module), each prompt and setting
    decoded once: several tests compare the fixed-shape path against the same dynamic generations.
    dynamic(i, **setting) -> the result for trained["prompts"][i]."""
    engine, done = SpecEngine(smollm2.model, trained["draft"], trained["aux"]), {}

    def generate(i, **setting):
        key = (i, tuple(sorted(setting.items())))
        if key not in done:
            done[key] = engine.generate(trained["prompts"][i], NEW, eos_token_ids=trained["eos"], **setting)
        return done[key]

    return generate


def pooled_tau(results) -> float:
    """Tokens per cycle over several generations (accepted draft tokens + the bonus, per cycle)."""
    cycles = sum(r.num_cycles for r in results)
    return (sum(sum(r.accepted_per_cycle) for r in results) + cycles) / cycles


@pytest.mark.parametrize("name", list(SETTINGS))
def test_trained_draft_is_lossless_and_accepts_more(smollm2, trained, dynamic, name):
    setting = SETTINGS[name]
    prompts, answers = trained["prompts"], trained["answers"]
    results = {}
    for which, count in (("draft", len(prompts)), ("untrained", BASELINE_PROMPTS)):
        t0 = time.perf_counter()
        engine = SpecEngine(smollm2.model, trained[which], trained["aux"])
        results[which] = []
        for i, (prompt, answer) in enumerate(zip(prompts[:count], answers[:count])):
            res = (dynamic(i, **setting) if which == "draft" else
                   engine.generate(prompt, NEW, eos_token_ids=trained["eos"], **setting))
            assert res.tokens == answer, (which, name, prompt)  # token for token the target's greedy output
            results[which].append(res)
        print(f"\n{name} {which}: tau {pooled_tau(results[which]):.2f} ({time.perf_counter() - t0:.1f}s)")
    trained_tau = pooled_tau(results["draft"])
    same_prompts = pooled_tau(results["draft"][:BASELINE_PROMPTS])
    untrained_tau = pooled_tau(results["untrained"])
    assert trained_tau >= 2.0, (trained_tau, untrained_tau)
    assert same_prompts > untrained_tau + 0.5, (same_prompts, untrained_tau)


@pytest.fixture(scope="module")
def trained_eagle31(smollm2, trained, tmp_path_factory):
    """The same training with EAGLE 3.1's fc_norm and norm_output on (train.fc_norm, train.norm_output),
    read back from its checkpoint."""
    from eyas.config import load_config
    from eyas.formats import load_draft
    from eyas.train import train

    overrides = [f"train.{k}={v}" for k, v in vars(trained["cfg"].train).items()
                 if k in ("steps", "ttt", "lr", "warmup_steps", "batch_tokens", "log_every", "save_every",
                          "keep_last", "dtype", "seed")]
    cfg = load_config("demo", overrides + ["train.fc_norm=true", "train.norm_output=true"])
    run_dir = tmp_path_factory.mktemp("trained-eagle31")
    summary = train(cfg, run_dir, trained["source"], device="cpu")
    draft, meta = load_draft(run_dir, embed_tokens=smollm2.embed_tokens.weight.detach())
    assert draft.cfg.fc_norm and draft.cfg.norm_output and meta["draft_config"]["fc_norm"]
    assert any(k.startswith("fc_norm.") for k in draft.state_dict())
    return dict(draft=draft.eval(), summary=summary)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_eagle31_draft_is_lossless(smollm2, trained, trained_eagle31, name):
    """Speculative decoding with a trained draft that has fc_norm and norm_output on gives exactly the target's
    greedy tokens, on the dynamic and the fixed-shape path alike, and accepts drafts (it learned)."""
    dynamic = SpecEngine(smollm2.model, trained_eagle31["draft"], trained["aux"])
    static = SpecEngine(smollm2.model, trained_eagle31["draft"], trained["aux"], static=True)
    results = []
    for prompt, answer in zip(trained["prompts"], trained["answers"]):
        res = dynamic.generate(prompt, NEW, eos_token_ids=trained["eos"], **SETTINGS[name])
        assert res.tokens == answer, (name, prompt)
        got = static.generate(prompt, NEW, eos_token_ids=trained["eos"], **SETTINGS[name])
        assert got.tokens == answer and got.accepted_per_cycle == res.accepted_per_cycle, (name, prompt)
        results.append(res)
    tau = pooled_tau(results)
    print(f"\n{name} eagle3.1: tau {tau:.2f}, train loss {trained_eagle31['summary']['loss']:.3f}")
    assert tau >= 1.5, tau


@pytest.mark.parametrize("setting", [dict(steps=1), dict(steps=5), dict(tree=(4, 4, 12))],
                         ids=["chain1", "chain5", "tree4x4x12"])
def test_static_path_matches_dynamic_engine(smollm2, trained, dynamic, setting):
    """The fixed-shape path (what runs as CUDA graphs on a GPU; eagerly here) against the dynamic engine,
    with the trained draft: the same tokens (the target's greedy answer), the same acceptance cycle by
    cycle (so the draft's cache and state after each rebuild are right; for a tree, also the same tree
    depth, i.e. the same nodes ranked the same way), and plain decoding the same."""
    static = SpecEngine(smollm2.model, trained["draft"], trained["aux"], static=True)
    accepted = deep = 0
    for i, (prompt, answer) in enumerate(zip(trained["prompts"], trained["answers"])):
        want = dynamic(i, **setting)
        got = static.generate(prompt, NEW, eos_token_ids=trained["eos"], **setting)
        assert got.tokens == answer == want.tokens
        assert got.accepted_per_cycle == want.accepted_per_cycle, prompt
        assert got.accepted_depths == want.accepted_depths, prompt
        assert got.target_tokens_per_cycle == want.target_tokens_per_cycle
        accepted += sum(got.accepted_per_cycle)
        deep += sum(a >= 2 for a in got.accepted_per_cycle)
        if "steps" in setting:
            assert static.plain_generate(prompt, NEW, eos_token_ids=trained["eos"]).tokens == answer
    assert accepted > 0  # the comparison saw real acceptances, not only rejections
    assert "steps" in setting or deep > 0  # and for the tree, paths beyond its first level
    assert static._decoder.capacity == 1024 and not static._decoder.graphs  # one decoder; no graphs on a CPU


@pytest.mark.parametrize("setting", [dict(steps=3), dict(tree=(4, 4, 12))], ids=["chain3", "tree4x4x12"])
def test_static_path_with_narrow_attended_widths(smollm2, trained, dynamic, setting, monkeypatch):
    """The fixed-shape passes attend over the narrowest width (a multiple of WIDTH_STEP) that holds every
    slot a pass may touch. With a width step of 4 slots a generation crosses several widths, in the
    target's and the draft's attention alike: tokens, acceptance per cycle and tree depths must stay those
    of the dynamic engine (a width too narrow would hide committed slots from the target or the draft)."""
    import eyas.speculative.graphs as graphs

    monkeypatch.setattr(graphs, "WIDTH_STEP", 4)
    static = SpecEngine(smollm2.model, trained["draft"], trained["aux"], static=True)
    used = []
    at = graphs.GraphDecoder._at
    monkeypatch.setattr(graphs.GraphDecoder, "_at", lambda self, b, need: (used.append(need), at(self, b, need))[1])
    for i, (prompt, answer) in enumerate(list(zip(trained["prompts"], trained["answers"]))[:4]):
        want = dynamic(i, **setting)
        used.clear()
        got = static.generate(prompt, NEW, eos_token_ids=trained["eos"], **setting)
        assert got.tokens == answer == want.tokens
        assert got.accepted_per_cycle == want.accepted_per_cycle, prompt
        assert got.accepted_depths == want.accepted_depths, prompt
        widths = {-(-need // 4) * 4 for need in used}
        assert len(widths) >= 2 and max(widths) < static._decoder.capacity, (used, prompt)
        if "steps" in setting:
            used.clear()
            assert static.plain_generate(prompt, NEW, eos_token_ids=trained["eos"]).tokens == answer
            assert len({-(-need // 4) for need in used}) >= 2
    assert static._decoder.widths[:3] == [4, 8, 12]


@pytest.mark.parametrize("step", [5, 1536], ids=["padded-to-5", "padded-to-the-capacity"])
def test_static_path_with_padded_prefills(smollm2, trained, dynamic, step, monkeypatch):
    """The fixed-shape prefill pads the prompt to a multiple of PREFILL_STEP (at most the capacity): the
    padding's cache entries lie after the committed length, in the target's and the draft's cache, and
    must never be seen. Tokens, acceptance per cycle and the target tokens counted must equal those of
    the eager prefill at the prompt's own length (PREFILL_STEP = 0) and of the dynamic engine."""
    import eyas.speculative.graphs as graphs

    for i, (prompt, answer) in enumerate(list(zip(trained["prompts"], trained["answers"]))[:2 if step < 1024 else 1]):
        runs = {}
        for prefill_step in (0, step):
            monkeypatch.setattr(graphs, "PREFILL_STEP", prefill_step)
            static = SpecEngine(smollm2.model, trained["draft"], trained["aux"], static=True)
            fed = static.runner.forward_tokens
            chain = static.generate(prompt, NEW, eos_token_ids=trained["eos"], steps=3)
            tree = static.generate(prompt, NEW, eos_token_ids=trained["eos"], tree=(4, 4, 12))
            plain = static.plain_generate(prompt, NEW, eos_token_ids=trained["eos"])
            runs[prefill_step] = (chain.tokens, chain.accepted_per_cycle, tree.tokens, tree.accepted_per_cycle,
                                  plain.tokens, static.runner.forward_tokens - fed)
            lengths = [k[1] for k in static._decoder.steps if k[0] == "prefill"]
            assert lengths == ([] if prefill_step == 0 else [min(-(-len(prompt) // step) * step, 1024)] * 2)
        assert runs[step] == runs[0]
        want = dynamic(i, steps=3)
        assert runs[step][0] == answer == want.tokens and runs[step][1] == want.accepted_per_cycle


def test_static_path_with_the_draft_pass_compiled(smollm2, trained, monkeypatch):
    """compile_draft compiles each draft-side pass whole (static sizes, no graph break) before graphs are
    captured: chains and trees through it give the eager draft's tokens and acceptance per cycle over more
    than one attended width, and a pass compiles once whatever the width (the draft attends over the whole
    capacity), so chain-3 and one tree compile 4 graphs (drafting and rebuild each). Dynamo's aot_eager backend
    here: the traced graphs with their in-place cache writes, no code generation."""
    import torch._dynamo as dynamo
    from torch._dynamo.backends.registry import lookup_backend

    import eyas.speculative.graphs as graphs

    monkeypatch.setattr(graphs, "WIDTH_STEP", 4)
    prompt = trained["prompts"][0]
    aot_eager, compiled = lookup_backend("aot_eager"), []

    def counting(gm, example_inputs):
        compiled.append(gm)
        return aot_eager(gm, example_inputs)

    runs = {}
    for backend in (None, counting):
        dynamo.reset()
        static = SpecEngine(smollm2.model, trained["draft"], trained["aux"], static=True, compile_draft=backend)
        chain = static.generate(prompt, NEW, eos_token_ids=trained["eos"], steps=3)
        tree = static.generate(prompt, NEW, eos_token_ids=trained["eos"], tree=(4, 4, 12))
        runs[backend is None] = (chain.tokens, chain.accepted_per_cycle, tree.tokens, tree.accepted_per_cycle)
        assert static._decoder.draft_full_width == (backend is not None)
        assert len(static._decoder.widths) > 1
    dynamo.reset()
    assert len(compiled) == 4
    assert runs[False] == runs[True]
    assert runs[True][0] == trained["answers"][0] and sum(runs[True][1]) > 0


def test_tree_select_bench_simulates_the_engine(smollm2, trained, dynamic):
    """bench/tree_select.py judges a tree drafted after N tokens by the target's greedy tokens after N: with
    EAGLE-2's rule its accepted drafts per cycle must be the engine's, cycle by cycle; with a depth penalty
    or bonus the kept nodes must stay closed under ancestors (select_tree asserts it)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("tree_select", Path(__file__).resolve().parents[2] / "bench"
                                                  / "tree_select.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    engine = SpecEngine(smollm2.model, trained["draft"], trained["aux"])
    d2t, eos, tree = engine._d2t_host(), trained["eos"], SELECT_TREE
    assert d2t is not None  # the draft's own vocabulary: the simulation maps ids as the engine does
    assert LONGER_NEW == NEW + tree[1] + 2
    accepted = 0
    for i, prompt in enumerate(trained["prompts"]):
        want = dynamic(i, tree=tree).accepted_per_cycle  # the engine's (the same dynamic engine and draft)
        longer = trained["longer"][i]  # the target's greedy tokens, NEW + tree[1] + 2 of them (decoded once)
        request = bench.Request(engine, prompt, longer)
        assert request.simulate(engine.draft, d2t, tree, 0.0, NEW, set(eos)) == want, prompt
        accepted += sum(want)
        for penalty in (-2.0, 1.0):
            other = request.simulate(engine.draft, d2t, tree, penalty, NEW, set(eos))
            assert 1 + sum(other) + len(other) >= min(NEW, len(longer))  # the prefill token, then a + 1 a cycle
    assert accepted > 0
