"""Prompts the target writes itself: the template's opening, filtering, resume, and `eyas prepare --self-prompts`."""

import json

import pytest

from eyas.cli import main as cli_main
from eyas.config import ConfigError, load_config
from eyas.data import load_prepared
from eyas.data.self_prompts import Tally, user_turn_opening, write_self_prompts
from eyas.data.template import ChatTemplate, stop_token_ids


def test_opening_is_what_every_rendered_user_turn_starts_with(smollm2):
    tok = smollm2.tokenizer
    template = ChatTemplate(tok, stop_token_ids(tok, smollm2.model.generation_config))
    opening = user_turn_opening(template)
    text = tok.decode(opening)
    # SmolLM2 puts its default system prompt first when none is given
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\n")
    for question in ("What is 2 + 2?", "Write a haiku about rain.\nMake it sad."):
        ids = template.prompt_ids([{"role": "user", "content": question}])
        assert ids[:len(opening)] == opening
        assert tok.decode(ids[len(opening):]).startswith(question)


def test_smollm2_writes_chat_requests(smollm2, tmp_path):
    """The real target continues its user-turn opening with requests, not with its own answers."""
    tok = smollm2.tokenizer
    template = ChatTemplate(tok, stop_token_ids(tok, smollm2.model.generation_config))
    prompts, summary = write_self_prompts(smollm2, template, 8, tmp_path / "p.jsonl", temperature=0.8,
                                          max_new_tokens=64, batch_size=8, seed=0)
    assert summary["num_written"] >= summary["num_kept"] == len(prompts) > 0
    assert len({p["prompt"].lower() for p in prompts}) == len(prompts)
    for p in prompts:
        assert p["prompt"] and "<|im_" not in p["prompt"]
    # most of them ask for something (a question or a request to the assistant)
    asks = sum(("?" in p["prompt"]) or p["prompt"].split()[0].lower() in ("can", "write", "what", "how", "i", "please",
                                                                           "explain", "give", "help", "create")
               for p in prompts)
    assert asks >= len(prompts) // 2, [p["prompt"] for p in prompts]


def test_tally_drops_truncated_empty_and_duplicates_in_id_order():
    recs = [{"id": "self-0", "prompt": "Plan a trip.", "finish": "stop"},
            {"id": "self-1", "prompt": "cut off mid", "finish": "length"},
            {"id": "self-2", "prompt": "  ", "finish": "stop"},
            {"id": "self-3", "prompt": "plan  a TRIP.", "finish": "stop"},
            {"id": "self-4", "prompt": " Name a colour. ", "finish": "stop"},
            {"id": "self-5", "prompt": "Sort a list.", "finish": "stop"}]
    tally = Tally(2).add(recs[:3]).add(recs[3:])  # in batches as they come
    kept, counts = tally.kept, tally.counts
    assert kept == [{"id": "self-0", "prompt": "Plan a trip."}, {"id": "self-4", "prompt": "Name a colour."}]
    assert counts == {"kept": 3, "truncated": 1, "empty": 1, "duplicate": 1}


def _write(target, path, n, batch_size=4, **steer):
    template = ChatTemplate(target.tokenizer)
    return write_self_prompts(target, template, n, path, temperature=1.0, max_new_tokens=6, batch_size=batch_size,
                              seed=3, **steer)


def _recs(spec: str, start: int = 0) -> list[dict]:
    """Written requests from letters: s/S a steered one kept/cut, f/F a free one kept/cut."""
    return [{"id": f"self-{start + i:07d}", "prompt": f"{'Do' if c in 'sS' else 'Ask'} thing {start + i}.",
             "finish": "stop" if c.islower() else "length", **({"opener": "Do"} if c in "sS" else {})}
            for i, c in enumerate(spec)]


def _plan(records: list[dict], rows: int, num_prompts: int, openers: list[str], share: float) -> list:
    return Tally(num_prompts, round(num_prompts * share) if openers else 0).add(records).plan(rows, openers)


def test_openers_steer_an_even_share_in_turn():
    """Nothing written yet: a share of the rows, spread evenly, take the openers in turn."""
    assert _plan([], 8, 100, ["A", "B"], 0.25) == [None, None, None, "A", None, None, None, "B"]
    assert _plan([], 4, 6, ["A", "B"], 0.5) == [None, "A", None, "B"]
    assert _plan([], 5, 10, ["A"], 1.0) == ["A"] * 5 and _plan([], 3, 10, [], 0.5) == [None] * 3
    # the openers go on in turn after the steered requests already written
    assert _plan(_recs("ss"), 2, 10, ["A", "B", "C"], 1.0) == ["C", "A"]


def test_the_share_is_of_the_kept_requests():
    """A group that is dropped more often gets more rows; a full group gets none; each is kept to its quota."""
    # 4 of 8 steered requests were cut, none of 4 free ones: both groups lack 2 of their 6, and steered rows
    # were kept (4 + 1) / (8 + 1) as often as free ones (5 / 5): 3.6 against 2 rows wanted, 6 of 9 rows
    recs = _recs("sSsSsSsSffff")
    assert sum(o is not None for o in _plan(recs, 9, 12, ["A"], 0.5)) == 6
    assert sum(o is not None for o in _plan(_recs("ssssffff"), 9, 12, ["A"], 0.5)) == 4  # alike: half
    full = _recs("ssssss") + _recs("ff", 6)
    assert _plan(full, 4, 12, ["A"], 0.5) == [None] * 4
    tally = Tally(6, num_steered=3).add(_recs("ssssffff") + _recs("sf", 8))
    assert [k["id"] for k in tally.kept] == ["self-0000000", "self-0000001", "self-0000002", "self-0000004",
                                             "self-0000005", "self-0000006"]
    assert tally.counts == {"kept": 10, "truncated": 0, "empty": 0, "duplicate": 0}
    assert tally.written == {True: 5, False: 5} and tally.usable == {True: 5, False: 5}


def test_steered_requests_start_with_their_opener_and_resume_alike(tiny_target, tmp_path):
    """The target continues opening + opener; the request is the opener and what follows. A resumed run
    steers the same indices (the opener depends on the index alone)."""
    steer = {"openers": ["Write a Python function that", "Fix this code:"], "opener_share": 0.5}
    whole, summary = _write(tiny_target, tmp_path / "a.jsonl", 6, **steer)
    written = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r.get("opener") for r in written[:4]] == [None, "Write a Python function that", None, "Fix this code:"]
    for r in written:
        if r.get("opener"):
            assert r["prompt"].startswith(r["opener"]) and len(r["prompt"]) > len(r["opener"])
    assert summary["num_kept_with_opener"] == sum(p["id"] in {r["id"] for r in written if r.get("opener")}
                                                  for p in whole)
    lines = (tmp_path / "a.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "b.jsonl").write_bytes(b"".join(lines[:4]))
    resumed, _ = _write(tiny_target, tmp_path / "b.jsonl", 6, **steer)
    assert resumed == whole


def test_a_resumed_run_writes_what_an_uninterrupted_one_does(tiny_target, tmp_path):
    whole, _ = _write(tiny_target, tmp_path / "a.jsonl", 6)
    lines = (tmp_path / "a.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) >= 6 and len(lines) % 4 == 0  # whole batches of 4
    # a crash after the first batch, in the middle of writing the second
    (tmp_path / "b.jsonl").write_bytes(b"".join(lines[:4]) + lines[4][:10])
    resumed, summary = _write(tiny_target, tmp_path / "b.jsonl", 6)
    assert resumed == whole and (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()
    assert summary["num_written"] == len(lines)
    again, summary = _write(tiny_target, tmp_path / "b.jsonl", 6)  # complete: nothing more is generated
    assert again == whole and summary["num_tokens_this_run"] == 0


def test_gives_up_at_twice_the_number_asked(tiny_target, tmp_path, capsys):
    """The random tiny model rarely says its stop token within 6 tokens: most requests are cut off."""
    prompts, summary = _write(tiny_target, tmp_path / "p.jsonl", 10, batch_size=8)
    assert summary["num_written"] == 20 and len(prompts) < 10
    assert summary["dropped"]["truncated"] == 20 - len(prompts) - summary["dropped"]["duplicate"] - summary["dropped"]["empty"]
    assert "usable prompts of the 10 asked" in capsys.readouterr().out


def test_prepare_adds_them_to_the_corpus(tmp_path):
    out = tmp_path / "out"
    rc = cli_main(["prepare", "--config", "tiny", "--out", str(out), "--num-prompts", "3", "--self-prompts", "4",
                   "--max-length", "2048", "--set", "data.regen_max_new_tokens=4",
                   "--set", "data.self_prompt_max_tokens=40",
                   # the random tiny model seldom says <|im_end|>: twenty more stop tokens end most requests early
                   "--set", "data.stop_tokens=" + ",".join("abcdefghijklmnopqrst")])
    assert rc == 0
    s = json.loads((out / "prepare.json").read_text())
    own = s["source"]["self_prompts"]
    written = [json.loads(line) for line in (out / own["file"]).read_text().splitlines()]
    kept_ids = [r["id"] for r in written if r["finish"] == "stop" and r["prompt"].strip()][:4]
    ids = load_prepared(out)["sample_id"]
    assert own["num_kept"] == len(kept_ids) > 0 and s["num_kept"] == 3 + own["num_kept"]
    assert sorted(i for i in ids if i.startswith("self-")) == kept_ids
    # each request is the user turn of its sample, answered by the regeneration
    regen = {json.loads(line)["id"] for line in (out / s["regeneration"]["results"]).read_text().splitlines()}
    assert set(kept_ids) <= regen


def test_config_and_input_errors(tmp_path, capsys):
    with pytest.raises(ConfigError, match="self_prompt_temperature"):
        load_config("tiny", ["data.self_prompts=5", "data.self_prompt_temperature=0"])
    with pytest.raises(ConfigError, match="each opener must be a non-empty string"):
        load_config("tiny", ['data.self_prompt_openers=["Write", " "]'])
    with pytest.raises(ConfigError, match="self_prompt_opener_share=0.0 must lie in"):
        load_config("tiny", ["data.self_prompt_opener_share=0"])
    cfg = load_config("tiny", ['data.self_prompt_openers=["Write a Python function that", "Fix this code, please:"]'])
    assert cfg.data.self_prompt_openers == ["Write a Python function that", "Fix this code, please:"]
    rc = cli_main(["prepare", "--config", "tiny", "--out", str(tmp_path / "a"), "--num-prompts", "0"])
    assert rc == 2 and "--self-prompts N" in capsys.readouterr().err
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"id": "x", "prompt": "q", "response": "a"}) + "\n")
    rc = cli_main(["prepare", "--config", "tiny", "--data", str(src), "--self-prompts", "2", "--out", str(tmp_path / "b")])
    assert rc == 2 and "--regenerate local" in capsys.readouterr().err
    assert not (tmp_path / "b" / "prepare.json").exists()


# ---------------------------------------------------------------- templates whose user turn ends in no stop token

MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
           "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
WORDS = "▁Hi ▁there, ▁Tell ▁tell ▁me ▁a ▁joke. ▁[INST] ▁[/INST] ▁Plan ▁trip. ▁Sure, ▁here ▁is ▁plan. ▁Day ▁1:".split()


def sentencepiece_like(specials: list[str] = ()):
    """A word-level tokenizer that marks word starts with ▁ and drops the first one when decoding, as
    SentencePiece (Llama-2, Mistral) does; `specials` become special tokens (Mistral v3's control tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if specials:
        fast.add_special_tokens({"additional_special_tokens": list(specials)})
    fast.chat_template = MISTRAL
    return fast


def scripted(monkeypatch, tok, texts: list[tuple[str, str]]):
    """A target whose generation writes the given (text, finish) rows in turn, whatever it is given."""
    import types

    import torch

    calls = []

    def generate_batch(model, prompts, *, stop_ids, **_):
        calls.append((prompts, stop_ids))
        rows = [texts[(len(calls) - 1) * len(prompts) + i] for i in range(len(prompts))]
        return [{"tokens": tok(t, add_special_tokens=False)["input_ids"], "finish": f} for t, f in rows]

    monkeypatch.setattr("eyas.data.self_prompts.generate_batch", generate_batch)
    return types.SimpleNamespace(tokenizer=tok, model=torch.nn.Linear(1, 1)), calls


@pytest.mark.parametrize("specials", [[], ["[INST]", "[/INST]"]], ids=["inst-as-text", "inst-as-special-tokens"])
def test_a_request_ends_where_the_template_ends_the_user_turn(monkeypatch, tmp_path, specials):
    """Mistral's user turn ends in ` [/INST]`, not a stop token: the target writes its request, then ` [/INST]`
    and an answer. The request is what came before; it counts as finished even if the answer ran to the limit."""
    tok = sentencepiece_like(specials)
    target, calls = scripted(monkeypatch, tok, [("Plan a trip. [/INST] Sure, here is a plan.", "stop"),
                                                ("Tell me a joke. [/INST] Day 1: Day 1: Day 1:", "length"),
                                                ("Plan a plan.", "stop"), ("Tell me a", "length")])
    template = ChatTemplate(tok)
    prompts, summary = write_self_prompts(target, template, 3, tmp_path / "p.jsonl", temperature=1.0,
                                          max_new_tokens=12, batch_size=4)
    assert [p["prompt"] for p in prompts] == ["Plan a trip.", "Tell me a joke.", "Plan a plan."]
    assert summary["dropped"] == {"truncated": 1, "empty": 0, "duplicate": 0}
    # a [/INST] that is one special token also stops the writing there
    marker = tok.convert_tokens_to_ids("[/INST]") if specials else None
    assert (marker in calls[0][1]) == bool(specials)


def test_an_opener_keeps_the_space_sentencepiece_drops(monkeypatch, tmp_path):
    """SentencePiece drops the leading space of the first token it decodes: the continuation of "Hi there," is
    decoded with the opener, so the request reads "Hi there, tell me a joke." and not "Hi there,tell me ..."."""
    tok = sentencepiece_like()
    target, _ = scripted(monkeypatch, tok, [("tell me a joke.", "stop")])
    prompts, _ = write_self_prompts(target, ChatTemplate(tok), 1, tmp_path / "p.jsonl", temperature=1.0,
                                    max_new_tokens=8, batch_size=1, openers=["Hi there,"], opener_share=1.0)
    assert [p["prompt"] for p in prompts] == ["Hi there, tell me a joke."]


def test_smollm2_requests_are_unchanged_by_the_turn_end(smollm2):
    """ChatML's user turn ends in the stop token <|im_end|>: the end of the turn cuts nothing, and a continuation
    decodes with its opener exactly as opener + continuation (byte-level BPE keeps every space)."""
    from eyas.data.self_prompts import _request, user_turn_end

    tok = smollm2.tokenizer
    template = ChatTemplate(tok, stop_token_ids(tok, smollm2.model.generation_config))
    assert user_turn_end(template) == "<|im_end|>"
    opener = "Write a Python function that"
    for text in (" sorts a list.", "\nreturns 2 + 2", " écrit «ça»?", "<|im_start|>assistant\nSure"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert _request(tok, None, [], ids, "<|im_end|>") == (tok.decode(ids, skip_special_tokens=True), False)
        got = _request(tok, opener, tok(opener, add_special_tokens=False)["input_ids"], ids, "<|im_end|>")
        assert got == (opener + tok.decode(ids, skip_special_tokens=True), False)

