"""`eyas prepare` end to end on the tiny target: formats, bad input, --strict, length policy, outputs."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from eyas.cli import main as cli_main
from eyas.data import load_prepared, load_vocab

GOOD_SHAREGPT = {"id": "g1", "conversations": [{"from": "system", "value": "Be brief."},
                                               {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                                               {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Goodbye."}]}
GOOD_OPENAI = {"id": "g2", "messages": [{"role": "user", "content": "Add 2 and 2."},
                                        {"role": "assistant", "content": "4"}]}
GOOD_PR = {"id": "g3", "prompt": "Name a colour.", "response": "Blue."}

# (line text, reason it must be skipped with)
BAD = [
    ('{"id": "b1", "messages": [', "malformed_json"),
    ('{"id": "b2"}', "unknown_format"),
    ('{"id": "b3", "messages": [{"role": "user"}]}', "missing_field"),
    ('{"id": "b4", "messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}', "unknown_role"),
    ('{"id": "b5", "messages": [{"role": "user", "content": "  \\n "}, {"role": "assistant", "content": "y"}]}', "empty_content"),
    ('{"id": "b6", "messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "y"}]}', "non_string_content"),
    ('{"id": "b7", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, '
     '{"role": "assistant", "content": "c"}]}', "two_user_turns"),
    ('{"id": "b8", "messages": [{"role": "user", "content": "a"}]}', "no_assistant_turn"),
    ('{"id": "g1", "prompt": "again", "response": "dup"}', "duplicate_id"),
    ('[1, 2]', "not_an_object"),
    ('{"id": "b9", "messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}', "bad_turn_order"),
]


def write_corpus(path):
    lines = [json.dumps(GOOD_SHAREGPT).encode(), json.dumps(GOOD_OPENAI).encode(), json.dumps(GOOD_PR).encode()]
    lines += [text.encode() for text, _ in BAD]
    lines.append(b'{"id": "b10", "prompt": "caf\xe9", "response": "x"}')  # latin-1 byte: invalid UTF-8
    path.write_bytes(b"\n".join(lines) + b"\n")
    return 3  # good records


def test_bad_input_corpus_is_reported_per_reason(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    out = tmp_path / "out"
    rc = cli_main(["prepare", "--config", "tiny", "--data", str(corpus), "--out", str(out),
                   "--regenerate", "none", "--max-length", "512"])
    assert rc == 0
    summary = json.loads((out / "prepare.json").read_text())
    expected = {reason: 1 for _, reason in BAD} | {"invalid_utf8": 1}
    assert summary["dropped"] == expected
    assert summary["num_kept"] == 3 and summary["num_read"] == 3 + len(expected)
    for k, (_, reason) in enumerate(BAD):
        assert summary["first_at"][reason] == f"{corpus}:{k + 4}"
    assert summary["first_at"]["invalid_utf8"] == f"{corpus}:{len(BAD) + 4}"
    ds = load_prepared(out)
    assert ds["sample_id"] == ["g1", "g2", "g3"]
    assert "skipped:" in capsys.readouterr().out

    # --strict turns the same input into a one-line error, exit 2
    rc = cli_main(["prepare", "--config", "tiny", "--data", str(corpus), "--out", str(tmp_path / "strict"),
                   "--regenerate", "none", "--strict"])
    err = capsys.readouterr().err
    assert rc == 2 and "--strict" in err and "malformed_json: 1" in err and len(err.strip().splitlines()) == 1


def test_unusable_input_never_ends_in_a_traceback(tmp_path):
    files = []
    for k, content in enumerate([b"", b"\xff\xfe garbage\n", b'{"not": "a conversation"}\n', b"[not json"]):
        files += ["--data", str(tmp_path / f"bad{k}.jsonl")]
        (tmp_path / f"bad{k}.jsonl").write_bytes(content)
    (tmp_path / "bad.json").write_bytes(b"[not json")
    proc = subprocess.run([sys.executable, "-m", "eyas", "prepare", "--config", "tiny", *files,
                           "--data", str(tmp_path / "bad.json"), "--data", str(tmp_path / "missing.parquet"),
                           "--out", str(tmp_path / "o"), "--regenerate", "none"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "no usable conversation" in proc.stderr
    for reason in ("unreadable_file: 2", "invalid_utf8: 1", "unknown_format: 1", "malformed_json: 1"):
        assert reason in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_formats_files_and_outputs(tmp_path):
    rows = [GOOD_SHAREGPT, GOOD_OPENAI]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    table = pa.table({"id": ["p1", "p2"], "prompt": ["Say hi.", "Say bye."], "response": ["Hi!", "Bye!"]})
    pq.write_table(table, tmp_path / "b.parquet")
    out = tmp_path / "out"
    rc = cli_main(["prepare", "--config", "tiny", "--data", str(tmp_path / "a.json"), "--data",
                   str(tmp_path / "b.parquet"), "--out", str(out),  # --data: no regeneration by default
                   "--draft-vocab", "40", "--set", "data.max_length=512"])
    assert rc == 0
    ds = load_prepared(out)
    assert ds["sample_id"] == ["g1", "g2", "p1", "p2"]
    assert str(ds.features["input_ids"].feature.dtype) == "int32"
    assert str(ds.features["loss_mask"].feature.dtype) == "int8"
    for row in ds:
        assert len(row["input_ids"]) == len(row["loss_mask"]) and 0 < sum(row["loss_mask"]) < len(row["loss_mask"])
    vocab = load_vocab(out / "vocab.safetensors")
    assert vocab["d2t"].shape == (40,) and vocab["t2d"].shape == (320,) and int(vocab["t2d"].sum()) == 40
    summary = json.loads((out / "prepare.json").read_text())
    assert summary["num_loss_tokens"] == int(vocab["token_counts"].sum())
    masked = torch.cat([torch.tensor(r["input_ids"])[torch.tensor(r["loss_mask"]).bool()] for r in ds])
    assert torch.equal(torch.bincount(masked, minlength=320), vocab["token_counts"])
    assert summary["vocab"]["coverage"] <= 1.0 and (out / "config.yaml").is_file()
    assert summary["regeneration"] is None


def test_builtin_corpus_needs_regeneration(tmp_path, capsys):
    rc = cli_main(["prepare", "--config", "tiny", "--out", str(tmp_path / "o"), "--regenerate", "none"])
    assert rc == 2 and "--regenerate local" in capsys.readouterr().err


def test_length_policy_drop_and_truncate(tmp_path):
    long = {"id": "long", "prompt": "q" * 20, "response": "a" * 300}
    short = {"id": "short", "prompt": "q", "response": "a"}
    too_late = {"id": "late", "prompt": "q" * 400, "response": "a"}
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in (long, short, too_late)) + "\n")
    base = ["prepare", "--config", "tiny", "--data", str(src), "--regenerate", "none", "--max-length", "128"]
    assert cli_main(base + ["--out", str(tmp_path / "drop")]) == 0
    s = json.loads((tmp_path / "drop" / "prepare.json").read_text())
    assert s["dropped"] == {"too_long": 2} and s["length_policy"]["num_truncated"] == 0
    assert cli_main(base + ["--out", str(tmp_path / "cut"), "--on-long", "truncate"]) == 0
    s = json.loads((tmp_path / "cut" / "prepare.json").read_text())
    assert s["dropped"] == {"no_assistant_tokens": 1} and s["length_policy"]["num_truncated"] == 1
    ds = load_prepared(tmp_path / "cut")
    assert ds["sample_id"] == ["long", "short"] and len(ds[0]["input_ids"]) == 128 and ds[0]["loss_mask"][-1] == 1


def test_builtin_corpus_with_local_regeneration(tmp_path):
    out = tmp_path / "out"
    rc = cli_main(["prepare", "--config", "tiny", "--out", str(out), "--num-prompts", "12", "--max-length", "2048",
                   "--set", "data.regen_max_new_tokens=6"])
    assert rc == 0
    s = json.loads((out / "prepare.json").read_text())
    assert s["source"]["kind"] == "builtin-corpus" and s["num_kept"] == 12
    assert s["regeneration"]["num_responses"] == 12 and s["regeneration"]["mode"] == "local"
    results = [json.loads(line) for line in (out / s["regeneration"]["results"]).read_text().splitlines()]
    assert sorted(r["id"] for r in results) == sorted(load_prepared(out)["sample_id"])
    from eyas.data.regenerate import repeated_tail

    loops = s["regeneration"]["repetition_loops"]  # reported for the kept responses
    assert loops["responses"] == sum(repeated_tail(r["response"]) > 0 for r in results)
    assert 0 <= loops["token_share"] <= 1


def test_regen_loops_mask_and_drop_act_on_answers_that_end_in_a_loop(tmp_path):
    out = tmp_path / "out"
    base = ["prepare", "--config", "tiny", "--out", str(out), "--num-prompts", "4", "--max-length", "2048",
            "--set", "data.regen_max_new_tokens=6"]
    assert cli_main(base) == 0
    results_file = out / json.loads((out / "prepare.json").read_text())["regeneration"]["results"]
    results = [json.loads(line) for line in results_file.read_text().splitlines()]
    # the first answer is made to end in a loop, the second to hold none (the prompts' hashes stay as they were)
    looping, plain = results[0]["id"], results[1]["id"]
    results[0]["response"] = "Intro text. " + "I like cats. " * 8
    results[1].update(response="A plain answer, no loop in it.", finish="stop")
    capped = results[2]["id"]  # stopped by the token cap (as all tiny answers of 6 tokens): no end of turn to learn
    assert results[2]["finish"] == "length"
    results_file.write_text("".join(json.dumps(r) + "\n" for r in results))

    assert cli_main(base) == 0  # keep: trained on as written
    loss_tokens_kept = json.loads((out / "prepare.json").read_text())["num_loss_tokens"]

    assert cli_main(base + ["--set", "data.regen_loops=drop"]) == 0
    s = json.loads((out / "prepare.json").read_text())
    assert s["dropped"] == {"repetition_loop": 1} and s["first_at"]["repetition_loop"].endswith(looping)
    assert s["regeneration"]["repetition_loops"]["dropped_responses"] == 1
    assert looping not in load_prepared(out)["sample_id"] and plain in load_prepared(out)["sample_id"]

    assert cli_main(base + ["--set", "data.regen_loops=mask"]) == 0
    s = json.loads((out / "prepare.json").read_text())
    assert s["num_kept"] == 4 and s["regeneration"]["repetition_loops"]["masked_responses"] == 1
    # the looping answer was cut by the cap too, so its end of turn is out of the loss with keep as well
    assert s["num_loop_masked_tokens"] == loss_tokens_kept - s["num_loss_tokens"] + 1 > 1
    assert s["num_cut_turn_ends"] == 2  # the two answers that end neither in a loop nor by themselves
    from eyas.target import load_target

    tok = load_target("tiny").tokenizer
    rows = {r["sample_id"]: r for r in load_prepared(out)}
    masked = tok.decode([i for i, m in zip(rows[looping]["input_ids"], rows[looping]["loss_mask"]) if m])
    # what precedes the loop and its first copy stay under the loss (less a token or two where the tokens of
    # the prefix alone and in the sample part); the repeats and the end of the turn are context only
    first_copy = "Intro text. I like cats. "
    assert first_copy.startswith(masked) and len(masked) >= len(first_copy) - 4  # cut within a token or two
    assert tok.decode(rows[looping]["input_ids"]).count("I like cats.") == 8
    whole = tok.decode([i for i, m in zip(rows[plain]["input_ids"], rows[plain]["loss_mask"]) if m])
    assert whole.startswith("A plain answer, no loop in it.") and len(whole) > len("A plain answer, no loop in it.")
    row = rows[capped]
    under_loss = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert tok.decode(under_loss) == results[2]["response"] and under_loss[-1] not in tok.all_special_ids

    rc = cli_main(["prepare", "--config", "tiny", "--regenerate", "none", "--set", "data.regen_loops=mask",
                   "--out", str(tmp_path / "x")])
    assert rc != 0 and not (tmp_path / "x" / "dataset").exists()


def test_summary_json_reports_the_stage(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    out = tmp_path / "out"
    assert cli_main(["prepare", "--config", "tiny", "--data", str(corpus), "--out", str(out),
                     "--max-length", "512"]) == 0
    prep = json.loads((out / "prepare.json").read_text())
    s = json.loads((out / "summary.json").read_text())
    assert s["stage"] == "prepare" and s["samples"] == 3 == prep["num_kept"]
    assert s["tokens"] == prep["num_tokens"] == sum(len(r) for r in load_prepared(out)["input_ids"])
    assert s["skipped"] == prep["dropped"] and s["skipped_total"] == len(BAD) + 1
    assert 0 < s["target_load_s"] < s["wall_s"]
    # wall_s is written rounded to 1 ms (a tiny prepare takes ~30 ms), so the rate it implies is only that close
    assert s["samples_per_s"] == pytest.approx(3 / s["wall_s"], rel=1e-2 + 0.0006 / s["wall_s"])
    assert s["regenerated"] == 0 and s["regen_tokens_per_s"] is None
    assert not list(out.glob(".*.tmp"))  # written through a temporary file and renamed


def test_summary_json_counts_this_runs_regeneration_only(tmp_path):
    out = tmp_path / "out"
    args = ["prepare", "--config", "tiny", "--out", str(out), "--num-prompts", "6", "--max-length", "2048",
            "--set", "data.regen_max_new_tokens=5"]
    assert cli_main(args) == 0
    s = json.loads((out / "summary.json").read_text())
    prep = json.loads((out / "prepare.json").read_text())
    assert s["regenerated"] == 6 and s["regen_tokens"] == prep["regeneration"]["num_tokens"] > 0
    assert s["regen_tokens_per_s"] > 0
    assert cli_main(args) == 0  # a rerun finds every response in the results file
    s = json.loads((out / "summary.json").read_text())
    assert s["samples"] == 6 and s["regenerated"] == 0 and s["regen_tokens"] == 0


def test_more_bad_input_kinds(tmp_path):
    # a non-string system prompt is a skip, not silently dropped; a .json file that is not UTF-8
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "s", "prompt": "q", "response": "r", "system": 5}) + "\n"
                                      + json.dumps({"id": "ok", "prompt": "q", "response": "r", "system": "Hi."}) + "\n")
    (tmp_path / "b.json").write_bytes(b'[{"prompt": "caf\xe9", "response": "x"}]')
    out = tmp_path / "out"
    assert cli_main(["prepare", "--config", "tiny", "--data", str(tmp_path / "a.jsonl"), "--data",
                     str(tmp_path / "b.json"), "--out", str(out)]) == 0
    s = json.loads((out / "prepare.json").read_text())
    assert s["dropped"] == {"non_string_content": 1, "invalid_utf8": 1}
    assert s["first_at"]["non_string_content"] == f"{tmp_path / 'a.jsonl'}:1"
    assert s["first_at"]["invalid_utf8"].startswith(f"{tmp_path / 'b.json'}:byte ")
    ds = load_prepared(out)
    from eyas.target.tiny import make_tiny_tokenizer

    assert ds["sample_id"] == ["ok"]
    assert make_tiny_tokenizer().decode(ds[0]["input_ids"]).startswith("<|im_start|>system\nHi.<|im_end|>")


def test_repaired_records_are_counted_in_prepare_json(tmp_path):
    records = [{"id": "e", "conversations": [{"from": "system", "value": ""}, {"from": "human", "value": "Hi"},
                                             {"from": "gpt", "value": "Hello!"}]},
               {"id": "t", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                                        {"role": "user", "content": "and?"}]}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    assert cli_main(["prepare", "--config", "tiny", "--data", str(tmp_path / "a.jsonl"), "--out", str(out)]) == 0
    s = json.loads((out / "prepare.json").read_text())
    assert s["num_kept"] == 2 and s["dropped"] == {}
    assert s["source"]["repaired"] == {"empty system message dropped": 1, "last user turn without an answer cut": 1}


def test_records_without_ids_in_same_named_files_do_not_collide(tmp_path):
    for d, text in (("x", "first"), ("y", "second")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "train.jsonl").write_text(json.dumps({"prompt": text, "response": "ok"}) + "\n")
    out = tmp_path / "out"
    assert cli_main(["prepare", "--config", "tiny", "--data", str(tmp_path / "x" / "train.jsonl"), "--data",
                     str(tmp_path / "y" / "train.jsonl"), "--out", str(out)]) == 0
    s = json.loads((out / "prepare.json").read_text())
    assert s["dropped"] == {} and s["num_kept"] == 2
    assert load_prepared(out)["sample_id"] == ["train.jsonl:1", "train.jsonl#1:1"]


def test_extra_stop_tokens(tmp_path, capsys):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "q", "response": "r"}) + "\n")
    out = tmp_path / "out"
    assert cli_main(["prepare", "--config", "tiny", "--data", str(src), "--out", str(out),
                     "--set", "data.stop_tokens=<|endoftext|>"]) == 0
    s = json.loads((out / "prepare.json").read_text())
    assert s["stop_token_ids"] == [258, 256]  # the tokenizer's eos (<|im_end|>), then the extra one
    capsys.readouterr()
    rc = cli_main(["prepare", "--config", "tiny", "--data", str(src), "--out", str(tmp_path / "bad"),
                   "--set", "data.stop_tokens=<|eot_id|>"])
    err = capsys.readouterr().err
    assert rc == 2 and "data.stop_tokens" in err and "<|eot_id|>" in err and len(err.strip().splitlines()) == 1


def test_saved_dataset_directory_and_offline_hub_name(tmp_path, monkeypatch, capsys):
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([GOOD_OPENAI, {"id": "h2", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]).save_to_disk(str(saved))
    out = tmp_path / "out"
    assert cli_main(["prepare", "--config", "tiny", "--data", str(saved), "--out", str(out)]) == 0
    assert load_prepared(out)["sample_id"] == ["g2", "h2"]

    # offline (as here, without network): both libraries read the flag at import, so set it where they keep it
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    capsys.readouterr()
    rc = cli_main(["prepare", "--config", "tiny", "--data", "someorg/no-such-dataset", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err.startswith("eyas prepare: error: no usable conversation")
    assert "unreadable_file: 1 (first at someorg/no-such-dataset: " in err and "save_to_disk directory" in err
