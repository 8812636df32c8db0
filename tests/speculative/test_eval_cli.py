"""`eyas eval` end to end on the tiny target: a checkpoint dir in, RESULT.json and PNG out."""

import json

import pytest
import torch

from eyas.cli import main
from eyas.speculative.bench import load_bench


def save_step_dir(path, target, seed=0):
    """A checkpoint step dir as the trainer writes it (weights without the embedding + draft.json)."""
    from safetensors.torch import save_file

    from eyas.draft import DraftConfig, Eagle3Draft
    from eyas.layers import resolve_aux_layers

    aux = resolve_aux_layers(None, target.num_layers)
    cfg = DraftConfig.from_target_config(target.config.to_dict(), draft_vocab_size=target.vocab_size,
                                         num_aux_layers=len(aux))
    torch.manual_seed(seed)
    state = {k: v.contiguous() for k, v in Eagle3Draft(cfg).state_dict().items() if k != "embed_tokens.weight"}
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "draft.json").write_text(json.dumps({"draft_config": cfg.to_dict(), "aux_layers": aux,
                                                 "features": "fused", "target": target.identity,
                                                 "target_model": "tiny", "store": None, "ttt": 3}))
    return path


def test_eval_cli_on_jsonl(tmp_path, tiny_target, capsys):
    step = save_step_dir(tmp_path / "run" / "step-0000010", tiny_target)
    bench = tmp_path / "prompts.jsonl"
    bench.write_text(json.dumps({"id": "a", "prompt": "hello there"}) + "\n"
                     + json.dumps({"id": "b", "messages": [{"role": "user", "content": "one"},
                                                           {"role": "assistant", "content": "x"},
                                                           {"role": "user", "content": "two"}]}) + "\n")
    out = tmp_path / "res" / "result.json"
    rc = main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(step), "--bench", str(bench),
               "--steps", "2", "--max-new-tokens", "6", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    s = doc["summary"]
    assert s["num_requests"] == 2 and s["plain_mismatches"] == 0
    assert [len(p["turns"]) for p in doc["prompts"]] == [1, 2]
    turn = doc["prompts"][1]["turns"][1]
    assert len(turn["tokens"]) <= 6 and turn["num_cycles"] == len(turn["accepted"])
    assert s["tau_pooled"] == pytest.approx(s["num_tokens"] / s["num_cycles"], rel=0.3)  # first token is prefill's
    assert len(s["accept_at_position"]) == 2 and "speedup_vs_plain" in s and "speedup_vs_hf" in s
    # 6-token answers hold no 8-token context: every cycle is outside repeats
    assert s["repeat_token_share"] == 0 and s["tau_in_repeats"] is None and s["tau_elsewhere"] >= 1
    # n-gram lookup with the setting's 2 tokens over the same contexts and tokens (plain decoding's: no mismatch)
    from eyas.speculative.stats import ngram_accepted

    guessed = [a for p in doc["prompts"] for t in p["turns"] for a in ngram_accepted(t["prompt_ids"], t["tokens"], 2)]
    assert s["ngram_k"] == 2 and s["ngram_tau"] == pytest.approx((sum(guessed) + len(guessed)) / len(guessed))
    printed = capsys.readouterr().out
    assert "tau" in printed and "speedup" in printed and "n-gram lookup alone (2 tokens a cycle" in printed
    # the file alone is enough to check losslessness: its context ids, decoded plainly, give its tokens
    from eyas.speculative.engine import SpecEngine

    plain = SpecEngine(tiny_target.model)
    for t in (t for p in doc["prompts"] for t in p["turns"]):
        assert t["num_prompt_tokens"] == len(t["prompt_ids"])
        assert plain.plain_generate(t["prompt_ids"], 6).tokens[:len(t["tokens"])] == t["tokens"]
    summary = json.loads((out.parent / "summary.json").read_text())
    entry = summary["results"]["result"]
    assert entry["bench"] == str(bench) and entry["setting"] == "chain-2" and entry["file"] == "result.json"
    assert entry["tau_pooled"] == s["tau_pooled"] and entry["speedup_vs_plain"] == s["speedup_vs_plain"]
    assert entry["ngram_tau"] == s["ngram_tau"]
    assert entry["wall_s"] > 0 and summary["wall_s"] == entry["wall_s"] and summary["tokens_per_s"] > 0
    from eyas.ownership import lock_file

    assert not lock_file(out).exists()  # its lock is gone with the eval


def test_a_second_eval_into_the_same_out_is_refused_naming_the_holder(tmp_path, tiny_target, capsys):
    """--out FILE (not --out-dir) resumes from FILE's requests: two evals into one FILE would interleave them."""
    import subprocess
    import sys
    from pathlib import Path

    from eyas.ownership import lock_file

    step = save_step_dir(tmp_path / "run" / "step-0000010", tiny_target)
    out = tmp_path / "res" / "result.json"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom eyas.ownership import exclusive\n"
                               "with exclusive(sys.argv[1], 'held'):\n    print('held', flush=True)\n"
                               "    time.sleep(60)", str(lock_file(out))], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    try:
        assert holder.stdout.readline().strip() == "held"
        rc = main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(step), "--steps", "2",
                   "--max-new-tokens", "4", "--limit", "1", "--out", str(out)])
        assert rc == 2
        assert f"{out} is in use by another process (pid {holder.pid})" in capsys.readouterr().err
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()


def test_eval_cli_tree_and_chain_on_mtbench(tmp_path, tiny_target):
    from eyas.common import EyasError

    try:
        load_bench("mt-bench", 1)
    except EyasError as e:
        pytest.skip(str(e))
    step = save_step_dir(tmp_path / "step", tiny_target)
    out = tmp_path / "r.json"
    rc = main(["eval", "--config", "tiny", "--draft", str(step), "--bench", "mt-bench", "--limit", "1",
               "--steps", "2", "--tree", "2,2,4", "--max-new-tokens", "5", "--no-hf-baseline", "--out", str(out)])
    assert rc == 0
    for name in ("chain-2", "tree-2x2x4"):
        doc = json.loads((tmp_path / f"r-mt-bench-{name}.json").read_text())
        assert len(doc["prompts"][0]["turns"]) == 2  # the second turn follows the model's own first answer
        assert doc["summary"]["plain_mismatches"] == 0


def test_mtbench_1_is_the_first_turns_alone():
    from eyas.common import EyasError
    from eyas.data.benchmarks import check_benches

    try:
        both = load_bench("mt-bench")
    except EyasError as e:
        pytest.skip(str(e))
    check_benches(["mt-bench-1"])
    first = load_bench("mt-bench-1")
    assert len(first) == len(both) == 80 and all(len(q["turns"]) == 2 for q in both)
    assert first == [{"id": q["id"], "turns": q["turns"][:1]} for q in both]
    assert load_bench("mt-bench-1", 3) == first[:3]


def test_bad_jsonl_names_the_line(tmp_path):
    from eyas.common import EyasError

    bad = tmp_path / "b.jsonl"
    bad.write_text('{"id": 1, "prompt": "ok"}\n{"id": 2}\n')
    with pytest.raises(EyasError, match="b.jsonl:2"):
        load_bench(str(bad))


def test_compile_draft_without_the_static_path_is_refused(tmp_path, tiny_target, capsys):
    """Only the CUDA-graph path compiles the draft's passes: on a CPU target, or with graphs off, eval stops
    with the key and the fix when --compile-draft asked for it; a config's value (the full preset's) has no
    effect there, with a warning, as eval.cuda_graphs has none on a CPU."""
    from eyas.speculative.build import build_engine
    from eyas.common import EyasError

    step = save_step_dir(tmp_path / "step", tiny_target)
    rc = main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(step), "--steps", "2",
               "--compile-draft", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "eval.compile_draft needs a CUDA target with eval.cuda_graphs=true" in err
    assert "drop --compile-draft (or --set eval.compile_draft=false)" in err and not (tmp_path / "r.json").exists()
    with pytest.raises(EyasError, match="eval.cuda_graphs=false"):
        build_engine(tiny_target, step, cuda_graphs=False, compile_draft=True, require_compile=True)
    engine, _ = build_engine(tiny_target, step, cuda_graphs=True, compile_draft=True)
    assert engine.compile_draft is None and not engine.static
    assert "the draft's passes run uncompiled here" in capsys.readouterr().err
    bench = tmp_path / "prompts.jsonl"
    bench.write_text(json.dumps({"id": "a", "prompt": "hello there"}) + "\n")
    rc = main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(step), "--steps", "2",
               "--set", "eval.compile_draft=true", "--max-new-tokens", "4", "--no-hf-baseline",
               "--bench", str(bench), "--out", str(tmp_path / "r.json")])
    assert rc == 0 and json.loads((tmp_path / "r.json").read_text())["settings"]["compile_draft"] is None


def test_evaluate_entry_for_the_pipeline(tmp_path, tiny_target):
    from eyas.stages.eval import Inputs, run as evaluate
    from eyas.config import load_config

    step = save_step_dir(tmp_path / "step", tiny_target)
    bench = tmp_path / "p.jsonl"
    bench.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    cfg = load_config("tiny", [f"eval.benches={bench}", "eval.steps=2", "eval.tree=2,2,3", "eval.max_new_tokens=4",
                               "eval.hf_baseline=false"])
    res = evaluate(cfg, Inputs(step), tmp_path / "eval", target=tiny_target)
    assert set(res["p"]) == {"chain-2", "tree-2x2x3"}
    assert (tmp_path / "eval" / "p-tree-2x2x3.json").is_file() and (tmp_path / "eval" / "p-chain-2.png").is_file()


def test_summary_merges_one_process_per_setting(tmp_path, tiny_target):
    """The pipeline's layout: one `eyas eval` per benchmark x setting into RUN/eval/; summary.json gathers
    them all (atomically rewritten), with the stage's wall_s and tokens_per_s at the top."""
    step = save_step_dir(tmp_path / "step", tiny_target)
    bench = tmp_path / "p.jsonl"
    bench.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    ev = tmp_path / "run" / "eval"
    for flags, name in ((["--steps", "2"], "p-chain-2"), (["--steps", "3"], "p-chain-3")):
        assert main(["eval", "--config", "tiny", "--draft", str(step), "--bench", str(bench), *flags,
                     "--max-new-tokens", "4", "--no-hf-baseline", "--out", str(ev / f"{name}.json")]) == 0
    summary = json.loads((ev / "summary.json").read_text())
    assert sorted(summary["results"]) == ["p-chain-2", "p-chain-3"] and summary["num_results"] == 2
    for name, entry in summary["results"].items():
        result = json.loads((ev / entry["file"]).read_text())["summary"]
        assert entry["tau_pooled"] == result["tau_pooled"] and entry["speedup_vs_plain"] == result["speedup_vs_plain"]
        assert entry["setting"] == name.removeprefix("p-") and entry["wall_s"] >= result["wall_s"] > 0
    assert summary["wall_s"] == pytest.approx(sum(e["wall_s"] for e in summary["results"].values()), abs=2e-3)
    tokens = sum(e["num_tokens"] for e in summary["results"].values())
    assert summary["tokens_per_s"] == pytest.approx(tokens / sum(e["total_s"] for e in summary["results"].values()))
    assert not list(ev.glob(".*"))  # nothing temporary left behind
    before = (ev / "summary.json").read_text()
    assert main(["eval", "--config", "tiny", "--draft", str(step), "--bench", str(bench), "--steps", "2",
                 "--out", str(ev / "summary.json")]) == 2  # a result must not overwrite the summary
    assert (ev / "summary.json").read_text() == before


def test_tree_alone_as_the_pipeline_runs_it(tmp_path, tiny_target):
    """eyas/pipeline/table.py runs the tree setting as its own process: `--tree` without `--steps`."""
    step = save_step_dir(tmp_path / "step", tiny_target)
    bench = tmp_path / "p.jsonl"
    bench.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    out = tmp_path / "eval" / "p-tree-2x2x3.json"
    assert main(["eval", "--config", "tiny", "--draft", str(step), "--bench", str(bench), "--tree", "2,2,3",
                 "--max-new-tokens", "4", "--no-hf-baseline", "--out", str(out)]) == 0
    settings = json.loads(out.read_text())["settings"]
    assert settings["setting"] == "tree-2x2x3"
    assert settings["decoding"] == "eager"  # CUDA graphs only on a GPU


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators", "research"])
def test_eval_reads_exports_and_research_checkpoints(fmt, tmp_path, tiny_target):
    """Issue 7, reading back: every export kind and an EAGLE/SpecForge checkpoint (midlayer.* names, no aux
    ids) load into the engine with the same draft logits as the checkpoint and decode losslessly."""
    from safetensors.torch import load_file

    from eyas.speculative.build import build_engine
    from eyas.formats import export
    from eyas.formats.keys import to_midlayer

    step = save_step_dir(tmp_path / "step", tiny_target, seed=3)
    if fmt == "research":
        d = tmp_path / "research"
        d.mkdir()
        torch.save(to_midlayer(load_file(step / "model.safetensors")), d / "pytorch_model.bin")
        cfg = tiny_target.config.to_dict()
        cfg.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1, draft_vocab_size=tiny_target.vocab_size)
        (d / "config.json").write_text(json.dumps(cfg))
    else:
        d = export(step, tmp_path / fmt, [fmt], dtype="fp32")[fmt]
    ref_engine, _ = build_engine(tiny_target, step)
    engine, info = build_engine(tiny_target, d)
    assert info["aux"] == [1, 2, 3]  # research: nothing recorded, the target's default ids
    gen = torch.Generator().manual_seed(0)
    aux = torch.randn(1, 5, 3 * tiny_target.hidden_size, generator=gen)
    ids, pos = torch.randint(0, tiny_target.vocab_size, (1, 5), generator=gen), torch.arange(5)[None]
    with torch.no_grad():
        ours = engine.draft(engine.draft.fuse(aux), ids, pos).logits
        ref = ref_engine.draft(ref_engine.draft.fuse(aux), ids, pos).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    prompt = [1, 72, 101, 108, 108, 111, 2]
    assert engine.generate(prompt, 10, steps=3).tokens == engine.plain_generate(prompt, 10).tokens


def test_an_interrupted_eval_keeps_its_requests_and_a_rerun_decodes_only_the_rest(tmp_path, tiny_target, monkeypatch,
                                                                                  capsys):
    from eyas.stages.eval import Inputs, run as evaluate
    from eyas.config import load_config
    from eyas.speculative.engine import SpecEngine

    step = save_step_dir(tmp_path / "step", tiny_target)
    bench = tmp_path / "p.jsonl"
    bench.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i} " * (i + 1)}) + "\n" for i in range(4)))
    sets = [f"eval.benches={bench}", "eval.steps=2", "eval.tree=null", "eval.limit=0", "eval.hf_baseline=false"]
    cfg = load_config("tiny", sets + ["eval.max_new_tokens=5"])
    whole = evaluate(cfg, Inputs(step), tmp_path / "whole", target=tiny_target)["p"]["chain-2"]
    reference = json.loads((tmp_path / "whole" / "p-chain-2.json").read_text())["prompts"]
    assert not (tmp_path / "whole" / "p-chain-2.requests.jsonl").exists()  # removed once the result is written

    calls = []
    real = SpecEngine.generate

    def dies_on_the_third_request(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3 + 1:  # the warm-up's call, then two requests, then the end of the device time
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SpecEngine, "generate", dies_on_the_third_request)
    with pytest.raises(KeyboardInterrupt):
        evaluate(cfg, Inputs(step), tmp_path / "eval", target=tiny_target)
    journal = tmp_path / "eval" / "p-chain-2.requests.jsonl"
    kept = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [k["id"] for k in kept] == ["0:q0", "1:q1"] and not (tmp_path / "eval" / "p-chain-2.json").exists()

    calls.clear()
    monkeypatch.setattr(SpecEngine, "generate", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    resumed = evaluate(cfg, Inputs(step), tmp_path / "eval", target=tiny_target)["p"]["chain-2"]
    assert len(calls) == 1 + 2  # the warm-up and the two requests the first run did not finish
    assert "2 of 4 requests taken from p-chain-2.requests.jsonl" in capsys.readouterr().out
    doc = json.loads((tmp_path / "eval" / "p-chain-2.json").read_text())
    assert [[t["tokens"] for t in p["turns"]] for p in doc["prompts"]] == \
        [[t["tokens"] for t in p["turns"]] for p in reference]
    assert resumed["tau_pooled"] == whole["tau_pooled"] and resumed["plain_mismatches"] == 0
    assert not journal.exists()

    # another setting (here the token limit) does not reuse the lines of an interrupted run
    journal.write_text("".join(json.dumps(k) + "\n" for k in kept))
    calls.clear()
    evaluate(load_config("tiny", sets + ["eval.max_new_tokens=4"]), Inputs(step), tmp_path / "eval", target=tiny_target)
    assert len(calls) == 1 + 4


def test_eval_prompts_take_the_data_template_variables():
    """data.chat_template_kwargs (e.g. enable_thinking false for Qwen3) reach the eval's prompts too, so that the
    draft is measured on the prompts it was trained for."""
    from eyas.speculative.bench import encode_turn
    from eyas.target.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'assistant:' }}"
                         "{% if enable_thinking is defined and not enable_thinking %}{{ ' quiet' }}{% endif %}{% endif %}")
    history = [{"role": "user", "content": "hi"}]
    plain, quiet = encode_turn(tok, history), encode_turn(tok, history, {"enable_thinking": False})
    assert tok.decode(quiet).endswith("quiet") and not tok.decode(plain).endswith("quiet")


def test_several_drafts_share_the_target_and_the_plain_baseline(tmp_path, tiny_target, capsys, monkeypatch):
    """`--draft A --draft B --out-dir DIR`: an EAGLE-3 and a DFlash draft of one target, each into DIR/<name>/, both
    lossless; each context is decoded plainly once (by the first draft's engine), and both speedups are over those
    same timings."""
    from eyas.speculative.engine import SpecEngine
    from test_dflash_decode import save_dflash_step

    eagle = save_step_dir(tmp_path / "eagle3", tiny_target)
    dflash = save_dflash_step(tmp_path / "dflash", tiny_target, block_size=4)
    bench = tmp_path / "p.jsonl"
    bench.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n" + json.dumps({"id": "b", "prompt": "one two"}) + "\n")
    calls = []
    plain_generate = SpecEngine.plain_generate

    def counted(self, ids, *args, **kwargs):
        calls.append((type(self).__name__, tuple(ids)))
        return plain_generate(self, ids, *args, **kwargs)

    monkeypatch.setattr(SpecEngine, "plain_generate", counted)
    out = tmp_path / "cmp"
    assert main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(eagle), "--draft", str(dflash),
                 "--bench", str(bench), "--steps", "2", "--max-new-tokens", "6", "--no-hf-baseline",
                 "--out-dir", str(out)]) == 0
    a = json.loads((out / "eagle3" / "p-chain-2.json").read_text())
    b2, b3 = (json.loads((out / "dflash" / f"p-chain-{k}.json").read_text()) for k in (2, 3))  # 3: its block's
    assert a["method"] == "eagle3" and b2["method"] == b3["method"] == "dflash"
    for doc in (a, b2, b3):
        assert doc["summary"]["plain_mismatches"] == 0 and doc["summary"]["num_requests"] == 2
        assert doc["summary"]["plain_tokens_per_s"] == a["summary"]["plain_tokens_per_s"]  # the same plain runs
    assert a["baseline"]["plain_contexts_decoded"] == 2
    assert b2["baseline"]["plain_contexts_decoded"] == b3["baseline"]["plain_contexts_decoded"] == 0
    contexts = {tuple(t["prompt_ids"]) for p in a["prompts"] for t in p["turns"]}
    timed = [ids for _, ids in calls if ids in contexts]  # the warm-ups decode another prompt
    assert sorted(timed) == sorted(contexts)  # once each, for both drafts
    for d in ("eagle3", "dflash"):
        assert (out / d / "summary.json").is_file()
    table = capsys.readouterr().out
    assert "| p | eagle3 | eagle3 | chain-2 |" in table and "| p | dflash | dflash | chain-3 |" in table

    # refused before anything is loaded: two drafts into one name, no --out-dir, vLLM's engine
    (tmp_path / "other").mkdir()
    twin = save_step_dir(tmp_path / "other" / "eagle3", tiny_target)
    for extra, says in ((["--draft", str(twin), "--out-dir", str(tmp_path / "x")], "share the directory name"),
                        ([], "need --out-dir"),
                        (["--out-dir", str(tmp_path / "y"), "--engine", "vllm"], "one draft per call")):
        assert main(["eval", "--config", "tiny", "--target", "tiny", "--draft", str(eagle), "--draft", str(dflash),
                     "--bench", str(bench), "--steps", "2", *extra]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
