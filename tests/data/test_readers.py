"""The readers' repairs of common record shapes: each is made, counted and named, or the record is a Skip."""

import json

from eyas.data.readers import Conversation, Skip, parse_record, read_sources

U, A = {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}


def parse(record, need_assistant=True):
    return parse_record(record, "x:1", "x.jsonl:1", need_assistant=need_assistant)


def roles(item):
    assert isinstance(item, Conversation), item
    return [m["role"] for m in item.messages]


def test_a_top_level_system_field_is_the_system_prompt():
    """LLaMA-Factory's ShareGPT (and OpenAI-style) records keep the system prompt beside the turns."""
    for record in ({"conversations": [U, A], "system": "Be brief."},
                   {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                    "system": "Be brief."}):
        conv = parse(record)
        assert conv.messages[0] == {"role": "system", "content": "Be brief."}
        assert roles(conv)[1:] == ["user", "assistant"]
        assert conv.edits == ()
    # an empty field (a dataset column that most rows leave blank) is no system prompt
    assert roles(parse({"conversations": [U, A], "system": ""})) == ["user", "assistant"]
    assert roles(parse({"conversations": [U, A], "system": None})) == ["user", "assistant"]
    # a non-string one is a skip, as in prompt-response records
    assert parse({"conversations": [U, A], "system": 5}).reason == "non_string_content"


def test_two_system_prompts_are_a_skip_that_names_the_record():
    skip = parse({"conversations": [{"from": "system", "value": "Be kind."}, U, A], "system": "Be brief."})
    assert isinstance(skip, Skip) and skip.reason == "two_system_prompts" and skip.where == "x.jsonl:1"
    assert "system" in skip.detail
    # the field replaces an empty system message (which is dropped and counted)
    conv = parse({"conversations": [{"from": "system", "value": ""}, U, A], "system": "Be brief."})
    assert conv.messages[0]["content"] == "Be brief." and conv.edits == ("empty_system_dropped",)


def test_an_empty_system_message_is_dropped_and_counted():
    conv = parse({"conversations": [{"from": "system", "value": ""}, U, A]})
    assert roles(conv) == ["user", "assistant"] and conv.edits == ("empty_system_dropped",)
    # an empty user or assistant message is still a skip
    assert parse({"conversations": [{"from": "human", "value": " "}, A]}).reason == "empty_content"
    assert parse({"conversations": [U, {"from": "gpt", "value": ""}]}).reason == "empty_content"


def test_a_placeholder_answer_is_taken_when_regeneration_replaces_it():
    for placeholder in ("", None, "  "):
        record = {"conversations": [U, A, {"from": "human", "value": "More?"}, {"from": "gpt", "value": placeholder}]}
        conv = parse(record, need_assistant=False)
        assert roles(conv) == ["user", "assistant", "user"] and conv.edits == ("placeholder_answer_dropped",)
        # without regeneration the empty answer would be trained on: a skip
        assert parse(record).reason == ("non_string_content" if placeholder is None else "empty_content")
    # only the last turn is a placeholder
    record = {"conversations": [U, {"from": "gpt", "value": ""}, U, A]}
    assert parse(record, need_assistant=False).reason == "empty_content"


def test_a_trailing_user_turn_is_cut_when_nothing_answers_it():
    record = {"conversations": [U, A, {"from": "human", "value": "Thanks!"}]}
    conv = parse(record)
    assert roles(conv) == ["user", "assistant"] and conv.edits == ("trailing_user_cut",)
    assert roles(parse(record, need_assistant=False)) == ["user", "assistant", "user"]  # regeneration answers it
    # nothing left to train on, or a broken order: still a skip
    assert parse({"conversations": [U]}).reason == "no_assistant_turn"
    assert parse({"conversations": [U, U]}).reason == "two_user_turns"
    assert parse({"conversations": [U, A, U, U]}).reason == "two_user_turns"


def test_read_sources_reports_the_repairs_in_one_line(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    records = [{"id": "a", "conversations": [{"from": "system", "value": ""}, U, A]},
               {"id": "b", "conversations": [U, A, {"from": "human", "value": "Thanks!"}]},
               {"id": "c", "conversations": [U, A]},
               {"id": "d", "conversations": [{"from": "system", "value": ""}, U, A, U]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    items = list(read_sources([str(path)]))
    assert [i.sample_id for i in items] == ["a", "b", "c", "d"]
    assert [i.edits for i in items] == [("empty_system_dropped",), ("trailing_user_cut",), (),
                                        ("empty_system_dropped", "trailing_user_cut")]
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    assert f"empty system message dropped: 2 (first at {path}:1)" in out[0]
    assert f"last user turn without an answer cut: 2 (first at {path}:2)" in out[0]


def _prompt(i: int, size: int = 5) -> dict:
    return {"id": f"r{i}", "prompt": "p" * size, "response": "ok"}


def test_a_jsonl_line_over_the_cap_is_skipped_unread(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (_prompt(0), _prompt(1, 3 << 20), _prompt(2))))
    items = list(read_sources([str(path)], max_record_mb=1))
    assert [getattr(i, "sample_id", None) for i in items] == ["r0", None, "r2"]
    skip = items[1]
    assert skip.reason == "too_large" and skip.where == f"{path}:2" and "data.max_record_mb=1" in skip.detail
    # the same file under a larger cap: every record kept
    assert all(isinstance(i, Conversation) for i in read_sources([str(path)], max_record_mb=4))


def test_a_line_of_exactly_the_cap_is_kept(tmp_path):
    from eyas.data.readers import MB, bounded_lines

    path = tmp_path / "d.jsonl"
    path.write_bytes(b"a" * MB + b"\n" + b"b" * (MB + 1) + b"\n" + b"c" * MB)
    with open(path, "rb") as f:
        got = [(n, None if line is None else len(line)) for n, line in bounded_lines(f, MB)]
    assert got == [(1, MB + 1), (2, None), (3, MB)]


def test_records_over_the_cap_in_json_and_parquet_are_skipped(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [_prompt(0), _prompt(1, 2 << 20), _prompt(2)]
    (tmp_path / "d.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    for name, where in (("d.json", "record 1"), ("d.parquet", "row 1")):
        items = list(read_sources([str(tmp_path / name)], max_record_mb=1))
        assert [type(i).__name__ for i in items] == ["Conversation", "Skip", "Conversation"], name
        assert items[1].reason == "too_large" and items[1].where.endswith(where)


def test_a_json_document_too_large_to_parse_whole_is_refused_with_the_advice(tmp_path, monkeypatch):
    import eyas.data.readers as readers

    monkeypatch.setattr(readers, "MAX_JSON_MB", 1)
    path = tmp_path / "big.json"
    path.write_text(json.dumps([_prompt(i, 1000) for i in range(1500)]))
    (item,) = list(read_sources([str(path)]))
    assert item.reason == "unreadable_file" and "write it as JSONL" in item.detail


def test_a_truncated_gzip_jsonl_is_one_skip(tmp_path):
    import gzip

    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(("".join(json.dumps(_prompt(i)) + "\n" for i in range(50))).encode())[:-30])
    items = list(read_sources([str(path)]))
    assert items[-1].reason == "unreadable_file" and all(isinstance(i, Conversation) for i in items[:-1])
