"""`eyas eval --engine vllm` on the tiny Llama (head_dim 32) with a trained draft: the command starts vLLM with the
draft (exported for it on the fly), then a plain engine, and writes RESULT.json whose tau and acceptance by position
are what eyas's own engine counts on the same prompt ids (vLLM's counters equal eyas's: test_exports_vllm.py),
cycle by cycle per turn; the output equals plain decoding. One run of the command (two engines, batch size 2) for
the module; its engines are the session's (the plain tiny-Llama engine and the one with the draft's vllm export),
which test_exports_vllm.py shares, once the arguments the command asks for are checked to be theirs."""

import json

import pytest
from conftest import DRAFT_K, ENGINE, require_vllm, same_export
from tiny_draft import eos_ids

from eyas.cli import main

require_vllm()

K = DRAFT_K
NEW = 12
BENCH = [{"id": "a", "prompt": "hello there"},
         {"id": "b", "messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "x"},
                                  {"role": "user", "content": "two"}]},
         {"id": "c", "prompt": "count to five"}]


def _argv(tiny_llama_dir, draft, bench, *extra):
    return ["eval", "--config", "tiny", "--target", str(tiny_llama_dir), "--draft", str(draft), "--bench", str(bench),
            "--max-new-tokens", str(NEW), "--limit", "0", "--engine", "vllm", "--set", "target.device=cpu",
            "--set", "target.dtype=fp32", "--set", f"target.engine={json.dumps(ENGINE)}", *extra]


@pytest.fixture(scope="module")
def evaluated(tiny_llama_dir, tiny_llama_draft, tiny_llama_plain, tiny_llama_eagle3, tiny_llama_exports,
              tmp_path_factory):
    """The command's run; its engines are the session's (conftest.tiny_llama_plain, and conftest.tiny_llama_eagle3
    for the draft), once the arguments it asks for are checked to be those engines': the same model, dtype and
    engine arguments, k, and for the draft an export with the same files as the one the session's engine serves."""
    import contextlib

    import eyas.stages.eval_vllm as eval_vllm

    root = tmp_path_factory.mktemp("eval-vllm")
    bench = root / "prompts.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in BENCH))
    out = root / "eval"
    argv = _argv(tiny_llama_dir, tiny_llama_draft, bench, "--steps", str(K), "--batch-size", "2", "--out-dir", str(out))
    started = []

    def serving(model_dir, *, dtype, engine, draft_dir=None, k=0):
        started.append(draft_dir)
        assert (model_dir, dtype, engine) == (str(tiny_llama_dir), "fp32", ENGINE)
        if draft_dir is not None:  # the command's own export of the draft (a temporary directory)
            assert k == K and same_export(draft_dir, tiny_llama_exports["vllm"]), (draft_dir, k)
            return contextlib.nullcontext(tiny_llama_eagle3)  # left running: the session's
        return contextlib.nullcontext(tiny_llama_plain)  # left running: the session's

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eval_vllm, "ServingEngine", serving)
        assert main(argv) == 0
    assert len(started) == 2 and started[0] is not None and started[1] is None  # the draft's engine, then plain
    return out


def test_result_has_the_counts_of_eyas_engine(evaluated, tiny_llama_target, tiny_llama_draft):
    from eyas.speculative.build import build_engine

    path = evaluated / "prompts-vllm-chain-3.json"
    doc = json.loads(path.read_text())
    s = doc["summary"]
    assert doc["engine"] == "vllm" and doc["settings"]["steps"] == K and doc["settings"]["batch_size"] == 2
    # requests a and b in one call, then b's second turn alone, then c
    assert [c["turns"] for c in doc["calls"]] == [[[0, 0], [1, 0]], [[1, 1]], [[2, 0]]]
    assert s["num_requests"] == 3 and [len(p["turns"]) for p in doc["prompts"]] == [1, 2, 1]
    engine, _ = build_engine(tiny_llama_target, tiny_llama_draft)
    cycles = accepted = 0
    per_position = [0] * K
    for record in doc["prompts"]:
        for turn in record["turns"]:
            res = engine.generate(turn["prompt_ids"], NEW, eos_token_ids=eos_ids(tiny_llama_target), steps=K)
            assert res.tokens == turn["tokens"]
            assert turn["accepted"] == res.accepted_per_cycle and turn["num_cycles"] == res.num_cycles
            mine = [sum(a > p for a in res.accepted_per_cycle) for p in range(K)]
            cycles += res.num_cycles
            accepted += sum(res.accepted_per_cycle)
            per_position = [a + b for a, b in zip(per_position, mine)]
    assert accepted > 0
    # the pooled figures come from vLLM's counters, the per-turn ones from its per-request report: they agree
    assert s["num_cycles"] == cycles and s["tau_pooled"] == pytest.approx(1 + accepted / cycles)
    assert sum(c["drafts"] for c in doc["calls"]) == cycles
    assert s["accept_at_position"] == pytest.approx([n / cycles for n in per_position])
    assert s["plain_mismatches"] == 0 and s["plain_mismatched_requests"] == 0
    assert s["tokens_per_s"] > 0 and s["plain_tokens_per_s"] > 0
    assert s["speedup_vs_plain"] == pytest.approx(s["tokens_per_s"] / s["plain_tokens_per_s"])
    # the second turn of b follows vLLM's own first answer, rendered with the chat template as eyas eval does
    from eyas.speculative.bench import encode_turn

    b = doc["prompts"][1]["turns"]
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": b[0]["text"]},
               {"role": "user", "content": "two"}]
    assert b[1]["prompt_ids"] == encode_turn(tiny_llama_target.tokenizer, history)
    taus = [1 + sum(a) / len(a) for a in ([x for t in r["turns"] for x in t["accepted"]] for r in doc["prompts"])]
    assert s["tau_per_request"] == pytest.approx(sum(taus) / len(taus))
    assert path.with_suffix(".png").is_file()
    summary = json.loads((evaluated / "summary.json").read_text())
    assert summary["results"]["prompts-vllm-chain-3"]["tau_pooled"] == s["tau_pooled"]


def test_tree_and_eyas_batches_are_refused_in_one_line(tiny_llama_dir, tmp_path, capsys):
    """Both before any model or draft is read (the draft path does not even exist)."""
    bench = tmp_path / "p.jsonl"
    bench.write_text(json.dumps(BENCH[0]) + "\n")
    assert main(_argv(tiny_llama_dir, tmp_path / "no-draft", bench, "--tree", "2,3,6")) == 2
    err = capsys.readouterr().err.strip()
    assert "trees are eyas-only" in err and "\n" not in err
    eyas = [a for a in _argv(tiny_llama_dir, tmp_path / "no-draft", bench) if a not in ("--engine", "vllm")]
    assert main(eyas + ["--batch-size", "2"]) == 2
    assert "batches need --engine vllm" in capsys.readouterr().err


def test_without_vllm_the_install_line(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    bench = tmp_path / "p.jsonl"
    bench.write_text(json.dumps(BENCH[0]) + "\n")
    assert main(_argv(tiny_llama_dir, tmp_path / "no-draft", bench, "--steps", str(K))) == 2
    err = capsys.readouterr().err.strip()
    assert "needs vLLM, which cannot be imported" in err and "pip install" in err and "\n" not in err
