"""DFlash chain decoding in SpecEngine on the tiny random target (fp32): lossless greedy output, an oracle
draft accepts every guess, seeded sampling repeats, no trees, and the draft's context after decoding."""

import pytest
import torch

from eyas.draft.dflash import DFlashConfig, DFlashDraft
from eyas.speculative.engine import SpecEngine

PROMPT = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 2]
BLOCK = 6
LAYERS = [1, 2, 3]  # HF hidden_states ids of the 4-layer tiny target


def dflash_draft(target, cls=DFlashDraft, seed: int = 0, **kwargs) -> DFlashDraft:
    """A random (seeded) DFlash draft with the target's embedding and lm_head."""
    cfg = DFlashConfig.from_target_config(target.config.to_dict(), target_layers=LAYERS,
                                          mask_token_id=target.vocab_size - 1, block_size=BLOCK)
    torch.manual_seed(seed)
    draft = cls(cfg, **kwargs).eval()
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.detach())
    if isinstance(draft.lm_head, torch.nn.Linear):  # the oracle has none
        draft.lm_head.weight.data.copy_(target.lm_head.weight.detach())
    return draft


class OracleDFlash(DFlashDraft):
    """Knows the sequence (prompt + the target's greedy output): block slot i at position p scores the token at
    p, so every guess is right. Its context is the real one (fuse and context_kv are DFlashDraft's)."""

    def __init__(self, cfg, sequence: list[int]):
        super().__init__(cfg)
        self.sequence = sequence
        self.lm_head = torch.nn.Identity()  # forward returns logits directly

    def forward(self, block_ids, positions, ctx_kv, attention_mask=None):
        rows = [self.sequence[p] if p < len(self.sequence) else 0 for p in positions[0].tolist()]
        return torch.nn.functional.one_hot(torch.tensor(rows), self.cfg.vocab_size).float()[None]  # [1, B, V]


def plain(target, n):
    return SpecEngine(target.model).plain_generate(PROMPT, n).tokens


@pytest.mark.parametrize("k", [1, 3, BLOCK - 1])
def test_random_draft_is_lossless(tiny_target, k):
    n = 24
    res = SpecEngine(tiny_target.model, dflash_draft(tiny_target)).generate(PROMPT, n, steps=k)
    assert res.tokens == plain(tiny_target, n)
    assert res.num_cycles == len(res.accepted_per_cycle) == len(res.draft_tokens_per_cycle)
    assert res.target_tokens_per_cycle == [k + 1] * res.num_cycles and res.accepted_depths == [k] * res.num_cycles
    assert res.draft_s > 0 and res.verify_s > 0 and res.total_s >= res.draft_s + res.verify_s


@pytest.mark.parametrize("k", [1, 3, BLOCK - 1])
def test_oracle_accepts_every_guess(tiny_target, k):
    cycles = 4
    n = 1 + cycles * (k + 1)
    ref = plain(tiny_target, n + BLOCK)
    draft = dflash_draft(tiny_target, OracleDFlash, sequence=PROMPT + ref)
    res = SpecEngine(tiny_target.model, draft).generate(PROMPT, n, steps=k)
    assert res.tokens == ref[:n]
    assert res.accepted_per_cycle == [k] * cycles and res.tau == k + 1
    assert res.draft_tokens_per_cycle == [BLOCK + k + 1] * (cycles - 1) + [BLOCK]  # block queries + context rows


def test_sampling_repeats_with_the_seed(tiny_target):
    engine = SpecEngine(tiny_target.model, dflash_draft(tiny_target))
    runs = [engine.generate(PROMPT, 20, steps=3, temperature=1.0, generator=torch.Generator().manual_seed(s)).tokens
            for s in (7, 7, 8)]
    assert len(runs[0]) == 20 and runs[0] == runs[1]
    assert runs[0] != runs[2]  # 20 tokens at temperature 1 from 320: another seed cannot repeat them


def test_tree_and_bad_steps_are_refused(tiny_target):
    engine = SpecEngine(tiny_target.model, dflash_draft(tiny_target))
    with pytest.raises(ValueError, match="DFlash defines no tree"):
        engine.generate(PROMPT, 8, tree=(2, 3, 6))
    with pytest.raises(ValueError, match=f"guesses 1..{BLOCK - 1} tokens"):
        engine.generate(PROMPT, 8, steps=BLOCK)
    with pytest.raises(ValueError, match="fuses the target layers"):
        SpecEngine(tiny_target.model, dflash_draft(tiny_target), aux_layers=[1, 2])


@pytest.mark.parametrize("k", [1, 3, BLOCK - 1])
def test_static_path_is_lossless_and_matches_the_dynamic_one(tiny_target, k):
    """The static path (its passes run eagerly on the CPU, as they are captured on a GPU) gives plain greedy
    decoding's tokens and the dynamic path's cycles, over prompts of several lengths on one engine (its
    buffers and context stores reused)."""
    draft = dflash_draft(tiny_target)
    static, dynamic = SpecEngine(tiny_target.model, draft, static=True), SpecEngine(tiny_target.model, draft)
    for prompt in (PROMPT, PROMPT[:4], PROMPT * 3):
        got, want = static.generate(prompt, 30, steps=k), dynamic.generate(prompt, 30, steps=k)
        assert got.tokens == want.tokens == SpecEngine(tiny_target.model).plain_generate(prompt, 30).tokens
        assert got.accepted_per_cycle == want.accepted_per_cycle
        assert got.target_tokens_per_cycle == [k + 1] * got.num_cycles
        assert got.draft_tokens_per_cycle == [BLOCK + k + 1] * got.num_cycles


def test_static_path_with_an_eager_prefill(tiny_target, monkeypatch):
    """PREFILL_STEP = 0: the prompt's features are written at its own length, without padding rows."""
    from eyas.speculative import graphs

    monkeypatch.setattr(graphs, "PREFILL_STEP", 0)
    draft = dflash_draft(tiny_target)
    res = SpecEngine(tiny_target.model, draft, static=True).generate(PROMPT, 24, steps=3)
    assert res.tokens == plain(tiny_target, 24)
    assert res.accepted_per_cycle == SpecEngine(tiny_target.model, draft).generate(PROMPT, 24, steps=3).accepted_per_cycle


@pytest.mark.parametrize("k", [1, BLOCK - 1])
def test_static_oracle_accepts_every_guess(tiny_target, k):
    """A draft that is always right: every cycle accepts all k guesses on the static path too, so its context
    rows and the pending token move exactly as the verified tokens do."""
    cycles = 5
    n = 1 + cycles * (k + 1)
    ref = plain(tiny_target, n + BLOCK)
    draft = dflash_draft(tiny_target, OracleDFlash, sequence=PROMPT + ref)
    res = SpecEngine(tiny_target.model, draft, static=True).generate(PROMPT, n, steps=k)
    assert res.tokens == ref[:n] and res.accepted_per_cycle == [k] * cycles


def test_static_context_holds_the_committed_features(tiny_target):
    """After a static generation the context stores hold, at slots 0..n-1, the features of the prompt and of
    every committed token, as one full forward of the target gives them."""
    from eyas.speculative import graphs

    k, n = 3, 20
    ref = plain(tiny_target, n + BLOCK)
    draft = dflash_draft(tiny_target, OracleDFlash, sequence=PROMPT + ref[:9] + [0] * 50)  # right, then wrong
    engine = SpecEngine(tiny_target.model, draft, static=True)
    res = engine.generate(PROMPT, n, steps=k)
    assert res.tokens == ref[:n] and 0 in res.accepted_per_cycle and k in res.accepted_per_cycle
    dec = engine._decoder
    assert isinstance(dec, graphs.GraphDecoder)
    length = len(PROMPT) + sum(a + 1 for a in res.accepted_per_cycle)  # the static path also appends the last cycle's
    assert int(dec.n) == length
    seq = torch.tensor([PROMPT + ref[:length - len(PROMPT)]])
    with torch.no_grad():
        states = tiny_target.model(input_ids=seq, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in LAYERS], dim=-1)
        want = draft.context_kv(draft.fuse(aux)[None], torch.arange(length)[None])
    for (k_store, v_store), (k_want, v_want) in zip(dec.dctx, want):
        torch.testing.assert_close(k_store[:, :, :length], k_want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v_store[:, :, :length], v_want, atol=1e-4, rtol=1e-4)


def test_compiled_draft_is_dropped_and_said(tiny_target, capsys):
    engine = SpecEngine(tiny_target.model, dflash_draft(tiny_target), static=True, compile_draft="inductor")
    assert engine.static and engine.compile_draft is None
    assert "the compiled draft is EAGLE-3 only" in capsys.readouterr().out
    assert engine.generate(PROMPT, 10, steps=2).tokens == plain(tiny_target, 10)


def test_sampling_keeps_the_dynamic_path(tiny_target):
    engine = SpecEngine(tiny_target.model, dflash_draft(tiny_target), static=True)
    gen = torch.Generator().manual_seed(3)
    res = engine.generate(PROMPT, 12, steps=3, temperature=1.0, generator=gen)
    assert len(res.tokens) == 12 and engine._decoder is None and engine.context is not None


def test_context_holds_the_committed_features(tiny_target):
    """After decoding, the context holds the features of the prompt and of every token the cycles before the
    last one committed (the last cycle ends the text, so nothing is added for it), equal to the features
    fused from one full forward of the target over the sequence."""
    k, n = 3, 20
    ref = plain(tiny_target, n + BLOCK)
    draft = dflash_draft(tiny_target, OracleDFlash, sequence=PROMPT + ref[:9] + [0] * 50)  # right, then wrong
    engine = SpecEngine(tiny_target.model, draft)
    res = engine.generate(PROMPT, n, steps=k)
    assert res.tokens == ref[:n] and 0 in res.accepted_per_cycle and k in res.accepted_per_cycle
    ctx = engine.context
    assert ctx.length == len(PROMPT) + sum(a + 1 for a in res.accepted_per_cycle[:-1])
    seq = torch.tensor([PROMPT + ref[:ctx.length - len(PROMPT)]])
    with torch.no_grad():
        states = tiny_target.model(input_ids=seq, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in LAYERS], dim=-1)  # [S, A*H]
        want = draft.context_kv(draft.fuse(aux)[None], torch.arange(ctx.length)[None])
    for (k_got, v_got), (k_want, v_want) in zip(ctx.views(), want):
        torch.testing.assert_close(k_got, k_want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v_got, v_want, atol=1e-4, rtol=1e-4)


def save_dflash_step(path, target, block_size: int = 4):
    """A DFlash checkpoint step dir: draft.json + model.safetensors without embed_tokens/lm_head."""
    import json

    from safetensors.torch import save_file

    cfg = DFlashConfig.from_target_config(target.config.to_dict(), target_layers=LAYERS,
                                          mask_token_id=target.vocab_size - 1, block_size=block_size)
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in DFlashDraft(cfg).state_dict().items()
             if k not in ("embed_tokens.weight", "lm_head.weight") and not k.startswith("rotary.")}
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "draft.json").write_text(json.dumps({"method": "dflash", "draft_config": cfg.to_dict(),
                                                 "aux_layers": cfg.target_layers, "target": target.identity,
                                                 "target_model": "tiny"}))
    return path


def test_eval_with_a_dflash_checkpoint(tmp_path, tiny_target, capsys):
    """eyas eval on a DFlash step dir: chains that fit the block plus the block's own (block_size - 1), the
    tree skipped with a line; each result and summary.json entry says method dflash; lossless in fp32."""
    import json

    from eyas.cli import main

    step = save_dflash_step(tmp_path / "step", tiny_target, block_size=4)
    bench = tmp_path / "p.jsonl"
    bench.write_text(json.dumps({"id": "a", "prompt": "hello there"}) + "\n")
    out = tmp_path / "r.json"
    assert main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(step), "--bench", str(bench),
                 "--steps", "2", "--tree", "2,2,4", "--max-new-tokens", "8", "--no-hf-baseline",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tree-2x2x4: skipped, a DFlash draft proposes one chain per cycle" in printed
    assert "CUDA graphs and the compiled draft are EAGLE-3 only" not in printed  # CPU: no graphs asked for
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(summary["results"]) == ["r-p-chain-2", "r-p-chain-3"]
    for name, k in (("chain-2", 2), ("chain-3", 3)):
        doc = json.loads((tmp_path / f"r-p-{name}.json").read_text())
        s = doc["summary"]
        assert doc["method"] == s["method"] == "dflash" and summary["results"][f"r-p-{name}"]["method"] == "dflash"
        assert doc["settings"]["steps"] == k and len(s["accept_at_position"]) == k and s["ngram_k"] == k
        assert s["plain_mismatches"] == 0 and s["num_cycles"] > 0 and "speedup_vs_plain" in s
    # one setting asked for, two results: the second gets its own file instead of overwriting the first
    one = tmp_path / "one" / "r.json"
    assert main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(step), "--bench", str(bench),
                 "--steps", "2", "--max-new-tokens", "4", "--no-hf-baseline", "--out", str(one)]) == 0
    assert sorted(json.loads((one.parent / "summary.json").read_text())["results"]) == ["r-p-chain-2", "r-p-chain-3"]


def test_block_settings(capsys):
    from eyas.speculative.bench import block_settings, settings_of

    assert block_settings(settings_of([3, 5, 7], "2,3,6"), 6) == settings_of([3, 5], None)
    printed = capsys.readouterr().out
    assert "chain-7: skipped, a DFlash draft of block_size 6 guesses at most 5" in printed and "tree-2x3x6" in printed
    assert block_settings(settings_of([7, 2], None), 16) == settings_of([2, 7, 15], None)
