"""Losslessness evidence in eval: a turn whose speculative tokens differ from plain decoding's records where
they first differ and the plain path's top-2 logit margin there, checked against a direct computation on a
divergence forced by perturbing one verification."""

import json

import pytest
import torch

import eyas.speculative.bench as bench
import eyas.speculative.engine as engine_mod
from eyas.cli import main
from eyas.speculative.stats import first_difference, is_near_tie, logit_steps, margin_summary
from test_eval_cli import save_step_dir

PERTURBED_CYCLE = 2  # the second verification after the warm-up


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 4], [1, 2, 3]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1]) == 1
    assert first_difference([], [5]) == 0


def test_margin_summary_and_near_ties():
    assert is_near_tie(0.05, 3.0) and not is_near_tie(0.2, 3.0) and is_near_tie(0.2, 50.0)  # 0.5 % of 50 = 0.25
    s = margin_summary([{"margin": 0.3, "near_tie": False}, {"margin": 0.01, "near_tie": True},
                        {"margin": 2.0, "near_tie": False}, {"margin": None}])
    assert (s["count"], s["measured"], s["min"], s["median"], s["max"], s["near_ties"]) == (4, 3, 0.01, 0.3, 2.0, 1)
    assert margin_summary([])["median"] is None and margin_summary([])["count"] == 0
    assert s["max_steps"] is None and s["within_2_steps"] == 0  # no divergence says its steps


def test_margins_in_steps_of_the_logits_format():
    bf16 = torch.finfo(torch.bfloat16).eps
    assert logit_steps(0.25, 32.25, bf16) == 1.0 and logit_steps(0.5, 32.25, bf16) == 2.0  # 0.25 apart above 32
    assert logit_steps(0.125, 31.0, bf16) == 1.0 and logit_steps(0.0, 5.0, bf16) == 0.0  # 0.125 apart below 32
    assert logit_steps(0.25, -20.0, bf16) == 2.0
    # every bf16 number between 16 and 32 is a multiple of that step: the count is exact
    a, b = torch.tensor([27.375, 26.875], dtype=torch.bfloat16).tolist()
    assert logit_steps(a - b, a, bf16) == 4.0
    s = margin_summary([{"margin": 0.25, "margin_steps": 1.0}, {"margin": 1.0, "margin_steps": 4.0}])
    assert s["max_steps"] == 4.0 and s["within_2_steps"] == 1


def test_eval_records_the_first_differing_token_and_its_margin(tmp_path, tiny_target, monkeypatch, capsys):
    """One verification of the first turn is perturbed after the warm-up: its first row's top-1 and top-2
    logits swap, so the speculative path takes the target's second choice there, as a precision flip
    would. eval must count the turn, and record that position and the plain path's top-2 margin, equal to
    a teacher-forced forward of the target done here."""
    state = {"armed": False, "calls": 0, "swapped": None}
    accept, warm = engine_mod._accept, bench.warm_up

    def perturbed_accept(logits, *args):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == PERTURBED_CYCLE:
                top = logits[0].topk(2)
                logits = logits.clone()
                logits[0, top.indices[0]], logits[0, top.indices[1]] = top.values[1], top.values[0]
                state["swapped"] = top.indices.tolist()
        return accept(logits, *args)

    def armed_warm_up(*args, **kwargs):
        warm(*args, **kwargs)
        state["armed"] = True

    monkeypatch.setattr(engine_mod, "_accept", perturbed_accept)
    monkeypatch.setattr(bench, "warm_up", armed_warm_up)
    step = save_step_dir(tmp_path / "run" / "step-0000010", tiny_target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hello there"}) + "\n"
                       + json.dumps({"id": "b", "prompt": "one two"}) + "\n")
    out = tmp_path / "res.json"
    rc = main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(step), "--bench", str(prompts),
               "--steps", "2", "--max-new-tokens", "8", "--no-hf-baseline", "--out", str(out)])
    assert rc == 0 and state["swapped"] is not None
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["plain_mismatches"] == 1
    first, second = doc["prompts"][0]["turns"][0], doc["prompts"][1]["turns"][0]
    assert "divergence" not in second  # the untouched turn equals plain decoding
    d = first["divergence"]

    # the direct computation: plain decoding of the same context, then one forward over its prefix
    from eyas.speculative.engine import SpecEngine

    plain = SpecEngine(tiny_target.model).plain_generate(first["prompt_ids"], 8).tokens
    i = next(j for j, (a, b) in enumerate(zip(first["tokens"], plain)) if a != b)
    with torch.no_grad():
        logits = tiny_target.model(torch.tensor([first["prompt_ids"] + plain[:i]])).logits[0, -1].float()
    top = logits.topk(2)
    assert d["position"] == i > 0  # the second cycle: after the prefill's token and the first cycle's
    assert d["plain_token"] == plain[i] == int(top.indices[0]) and d["plain_is_top1"]
    assert d["spec_token"] == first["tokens"][i] == int(top.indices[1]) == state["swapped"][1]
    assert d["spec_token_rank"] == 2
    assert d["margin"] == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-5)
    assert d["top_logit"] == pytest.approx(float(top.values[0]), abs=1e-5)
    assert d["near_tie"] == is_near_tie(d["margin"], d["top_logit"])
    assert d["margin_steps"] == pytest.approx(logit_steps(d["margin"], d["top_logit"], torch.finfo(torch.float32).eps))

    m = s["plain_mismatch_margins"]
    assert m["count"] == m["measured"] == 1 and m["min"] == m["median"] == m["max"] == d["margin"]
    assert m["near_ties"] == int(d["near_tie"]) and "0.005" in m["near_tie_rule"]
    printed = capsys.readouterr().out
    assert "warning: 1 turns differ from plain greedy decoding" in printed
    assert f"plain top-2 logit margin min {d['margin']:.4g}" in printed and "near ties" in printed
    assert m["max_steps"] == d["margin_steps"] and f"largest {d['margin_steps']:.3g})" in printed


def test_equal_turns_record_no_divergence(tmp_path, tiny_target):
    step = save_step_dir(tmp_path / "step", tiny_target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    out = tmp_path / "r.json"
    assert main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(step), "--bench", str(prompts),
                 "--steps", "2", "--max-new-tokens", "5", "--no-hf-baseline", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["plain_mismatches"] == 0
    assert doc["summary"]["plain_mismatch_margins"]["count"] == 0
    assert all("divergence" not in t for p in doc["prompts"] for t in p["turns"])


def test_each_setting_is_compared_with_plain_decoding_of_its_own_contexts(tmp_path, tiny_target, monkeypatch):
    """A two-turn conversation under two chain lengths. One verification of the second setting's first turn is
    perturbed, so that setting's first answer differs from the first setting's and its second turn has another
    context (the conversation so far). Its second turn must be compared with plain decoding of that context, which it
    equals: only the perturbed turn differs. Compared with the first setting's plain decoding, it would count as a
    difference with a margin measured on a context plain decoding never saw."""
    state = {"settings": 0, "calls": 0}
    accept, run_spec = engine_mod._accept, bench.run_spec

    def perturbed_accept(logits, *args):
        if state["settings"] == 2:
            state["calls"] += 1
            if state["calls"] == PERTURBED_CYCLE:
                top = logits[0].topk(2)
                logits = logits.clone()
                logits[0, top.indices[0]], logits[0, top.indices[1]] = top.values[1], top.values[0]
        return accept(logits, *args)

    def counted_run_spec(*args, **kwargs):
        state["settings"] += 1
        return run_spec(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "_accept", perturbed_accept)
    monkeypatch.setattr(bench, "run_spec", counted_run_spec)
    step = save_step_dir(tmp_path / "step", tiny_target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hello there"},
                                                                {"from": "gpt", "value": "hi"},
                                                                {"from": "human", "value": "one two"}]}) + "\n")
    rc = main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(step), "--bench", str(prompts),
               "--set", "eval.steps=[2,3]", "--set", "eval.tree=null", "--max-new-tokens", "10",
               "--no-hf-baseline", "--out-dir", str(tmp_path / "res")])
    assert rc == 0 and state["settings"] == 2 and state["calls"] >= PERTURBED_CYCLE
    first, second = (json.loads((tmp_path / "res" / f"p-chain-{k}.json").read_text()) for k in (2, 3))
    assert first["summary"]["plain_mismatches"] == 0
    turns = second["prompts"][0]["turns"]
    assert turns[0]["tokens"] != first["prompts"][0]["turns"][0]["tokens"]  # the perturbed first answer
    assert turns[1]["prompt_ids"] != first["prompts"][0]["turns"][1]["prompt_ids"]  # so another second context
    from eyas.speculative.engine import SpecEngine

    assert turns[1]["tokens"] == SpecEngine(tiny_target.model).plain_generate(turns[1]["prompt_ids"], 10).tokens
    assert second["summary"]["plain_mismatches"] == 1 and "divergence" in turns[0] and "divergence" not in turns[1]
    assert second["baseline"]["plain_contexts_decoded"] == 1  # the new second turn; the first turn's was decoded
    assert first["baseline"]["plain_contexts_decoded"] == 2


def test_vllm_plain_replay_decodes_each_settings_own_batches_once():
    """eval --engine vllm's baseline: a setting whose second-turn batch has another context (its own first answer)
    gets that batch decoded by the plain engine; a batch an earlier setting had is taken from it, timing included."""
    from eyas.stages.eval_vllm import replay

    class Plain:
        def __init__(self):
            self.batches = []

        def generate(self, prompts, params):
            self.batches.append(prompts)
            return [{"tokens": [sum(p) % 97, len(p)]} for p in prompts], 0.5 * len(prompts), {}

    def setting(second_context):
        records = [{"turns": [{"prompt_ids": [1, 2]}, {"prompt_ids": second_context}]},
                   {"turns": [{"prompt_ids": [3]}]}]
        return records, [{"turns": [(0, 0), (1, 0)]}, {"turns": [(0, 1)]}]

    engine, done = Plain(), {}
    a = replay(engine, *setting([1, 2, 7]), None, done)
    b = replay(engine, *setting([1, 2, 8]), None, done)
    assert engine.batches == [[[1, 2], [3]], [[1, 2, 7]], [[1, 2, 8]]]
    assert (a["calls_decoded"], b["calls_decoded"]) == (2, 1)
    assert a["tokens"][(0, 1)] == [10, 3] and b["tokens"][(0, 1)] == [11, 3] and b["tokens"][(1, 0)] == [3, 1]
    assert a["seconds"] == b["seconds"] == 1.5 and a["num_tokens"] == b["num_tokens"] == 6
