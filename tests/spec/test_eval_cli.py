"""`eyas eval` end to end on the tiny target: a checkpoint dir in, RESULT.json and PNG out."""

import json

import pytest
import torch

from eyas.cli import main
from eyas.spec.bench import load_bench


def save_step_dir(path, target, seed=0):
    """A checkpoint step dir as the trainer writes it (weights without the embedding + draft.json)."""
    from safetensors.torch import save_file

    from eyas.draft import DraftConfig, Eagle3Draft
    from eyas.target import resolve_aux_layers

    aux = resolve_aux_layers(None, target.num_layers)
    cfg = DraftConfig.from_target_config(target.config.to_dict(), draft_vocab_size=target.vocab_size,
                                         num_aux_layers=len(aux))
    torch.manual_seed(seed)
    state = {k: v.contiguous() for k, v in Eagle3Draft(cfg).state_dict().items() if k != "embed_tokens.weight"}
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "draft.json").write_text(json.dumps({"draft_config": cfg.to_dict(), "aux_layers": aux,
                                                 "features": "fused", "target": target.identity,
                                                 "target_spec": "tiny", "store": None, "ttt": 3}))
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
    printed = capsys.readouterr().out
    assert "tau" in printed and "speedup" in printed


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


def test_bad_jsonl_names_the_line(tmp_path):
    from eyas.common import EyasError

    bad = tmp_path / "b.jsonl"
    bad.write_text('{"id": 1, "prompt": "ok"}\n{"id": 2}\n')
    with pytest.raises(EyasError, match="b.jsonl:2"):
        load_bench(str(bad))


def test_evaluate_entry_for_the_pipeline(tmp_path, tiny_target):
    from eyas.commands.eval import evaluate
    from eyas.config import load_config

    step = save_step_dir(tmp_path / "step", tiny_target)
    bench = tmp_path / "p.jsonl"
    bench.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    cfg = load_config("tiny", [f"eval.benches={bench}", "eval.steps=2", "eval.tree=2,2,3", "eval.max_new_tokens=4",
                               "eval.hf_baseline=false"])
    res = evaluate(cfg, step, tmp_path / "eval", target=tiny_target)
    assert set(res["p"]) == {"chain-2", "tree-2x2x3"}
    assert (tmp_path / "eval" / "p-tree-2x2x3.json").is_file() and (tmp_path / "eval" / "p-chain-2.png").is_file()
