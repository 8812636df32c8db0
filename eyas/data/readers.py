"""Read conversations from JSONL, JSON, Parquet files and Hugging Face datasets, and check them.

Every record becomes either a `Conversation` (an id and a list of {role, content} messages with
roles system/user/assistant) or a `Skip` (a reason from REASONS and where it came from, `file:line`).
Nothing here raises on bad data: a bad record is a Skip, a bad file is one Skip for the file, so that
`eyas prepare` can report every problem at once and never end in a traceback.

A few common shapes are repaired instead of skipped, each named in the conversation's `edits` (from
EDITS) and counted in one line once the sources are read: an empty system message (ShareGPT dumps hold
many) is dropped; a last assistant turn left empty is dropped when regeneration writes it anyway; a last
user turn that nothing answers is cut, so the turns before it still train. A top-level "system" field
(LLaMA-Factory's ShareGPT and OpenAI records, and prompt-response ones) is the system prompt.

A record larger than `data.max_record_mb` is a Skip (too_large) found before it is parsed: a JSONL line is
read in bounded pieces and never held whole, a Parquet row is measured in Arrow before it becomes Python
objects. A JSON document is parsed whole, so a file over MAX_JSON_MB is refused with the advice to use JSONL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from eyas.common import print0
from eyas.config import DataConfig

MB = 1 << 20
# json.load holds a whole document, as Python objects several times its size; larger files must be JSONL
MAX_JSON_MB = 256

# reason -> what the user reads in prepare.json
REASONS = {
    "unreadable_file": "the file could not be opened or parsed",
    "invalid_utf8": "the line is not valid UTF-8",
    "malformed_json": "the line is not valid JSON",
    "too_large": "larger than data.max_record_mb (skipped before it was parsed)",
    "not_an_object": "the record is not a JSON object",
    "unknown_format": "no conversations/messages/prompt field (or not the --format asked for)",
    "missing_field": "a message lacks its role or content",
    "unknown_role": "a role other than system/user/assistant (or ShareGPT human/gpt/system)",
    "non_string_content": "a message content is not a string",
    "empty_content": "a message content is empty or whitespace only",
    "two_user_turns": "two user turns in a row",
    "bad_turn_order": "turns do not alternate user/assistant after an optional leading system prompt",
    "no_assistant_turn": "no assistant turn to train on (and nothing regenerates one)",
    "two_system_prompts": "a top-level system field and a system message both; keep one",
    "duplicate_id": "the id was already seen in the input",
    "template_mismatch": "the chat template does not render this conversation as a sequence of prefixes",
    "too_long": "longer than data.max_length tokens (data.on_long=drop)",
    "no_assistant_tokens": "no assistant token in the sample (or none left inside data.max_length after truncation)",
    "regeneration_failed": "the target (or endpoint) produced no response for this prompt",
}
# repair -> what the user reads: the record is kept with this change
EDITS = {
    "empty_system_dropped": "empty system message dropped",
    "placeholder_answer_dropped": "empty last answer dropped (regeneration writes it)",
    "trailing_user_cut": "last user turn without an answer cut",
}

_ROLE_MAP = {
    "sharegpt": {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"},
    "openai": {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"},
}
FORMATS = ("auto", "sharegpt", "openai", "prompt-response")
_ID_KEYS = ("id", "sample_id", "conversation_id", "question_id", "task_id")


@dataclass
class Conversation:
    sample_id: str
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}]
    where: str  # file:line (or dataset:index) of the record
    edits: tuple[str, ...] = ()  # repairs made to the record (EDITS keys), in order
    # characters of the last assistant message that count in the loss, its end of turn left out (None: all of it
    # and its end of turn); the rest stays in the sample as context (data.regen_loops=mask, answers cut by the cap)
    loss_chars: int | None = None


@dataclass
class Skip:
    reason: str
    where: str
    detail: str = ""


def read_sources(sources: Iterable[str], fmt: str = "auto", need_assistant: bool = True,
                 max_record_mb: float = DataConfig.max_record_mb) -> Iterator[Conversation | Skip]:
    """All records of all sources in order; duplicate ids (across sources too) and records larger than
    `max_record_mb` are skipped."""
    limit = max(1, int(max_record_mb * MB))
    seen: set[str] = set()
    labels: set[str] = set()
    edits: dict[str, list] = {}  # repair -> [count, first record]
    for k, source in enumerate(sources):
        # records without an id are named `label:line`; two sources with the same file name
        # (a/train.jsonl, b/train.jsonl) get distinct labels so their records do not collide
        label = source.rstrip("/").split("/")[-1]
        if label in labels:
            label = f"{label}#{k}"
        labels.add(label)
        for item in _read_one(source, label, fmt, need_assistant, limit):
            if isinstance(item, Conversation):
                if item.sample_id in seen:
                    yield Skip("duplicate_id", item.where, item.sample_id)
                    continue
                seen.add(item.sample_id)
                for e in item.edits:
                    edits.setdefault(e, [0, item.where])[0] += 1
            yield item
    if edits:
        print0("read with repairs: " + "; ".join(f"{EDITS[e]}: {n} (first at {where})"
                                                 for e, (n, where) in edits.items()))


def _read_one(source: str, stem: str, fmt: str, need_assistant: bool, limit: int) -> Iterator[Conversation | Skip]:
    path = Path(source).expanduser()
    if not path.exists() and not _looks_like_hub_name(source):
        yield Skip("unreadable_file", source, "no such file")
        return
    if path.is_dir() or not path.exists():
        yield from _read_hf(source, stem, fmt, need_assistant, limit)
        return
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".jsonl", ".jsonl.gz"):
        yield from _read_jsonl(path, stem, fmt, need_assistant, limit)
    elif suffix == ".json":
        yield from _read_json(path, stem, fmt, need_assistant, limit)
    elif suffix == ".parquet":
        yield from _read_parquet(path, stem, fmt, need_assistant, limit)
    else:
        yield Skip("unreadable_file", source, f"unknown file type {path.suffix!r} (use .jsonl, .json or .parquet)")


def _looks_like_hub_name(source: str) -> bool:
    return source.count("/") == 1 and not source.startswith((".", "/", "~")) and " " not in source


def bounded_lines(f, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, line) for each line of the binary file `f`; a line longer than `limit` bytes comes as
    (number, None), read past in pieces so that it is never held whole."""
    lineno = 0
    while raw := f.readline(limit + 1):
        lineno += 1
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield lineno, raw
            continue
        while (rest := f.readline(MB)) and not rest.endswith(b"\n"):
            pass
        yield lineno, None


def _too_large(where: str, size: str, limit: int) -> Skip:
    return Skip("too_large", where, f"{size}, over data.max_record_mb={limit / MB:g}")


def _read_jsonl(path: Path, stem: str, fmt: str, need_assistant: bool, limit: int) -> Iterator[Conversation | Skip]:
    import gzip

    try:
        f = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except OSError as e:
        yield Skip("unreadable_file", str(path), e.strerror or type(e).__name__)
        return
    with f:
        try:
            for lineno, raw in bounded_lines(f, limit):
                item = _jsonl_record(path, stem, lineno, raw, fmt, need_assistant, limit)
                if item is not None:  # a blank line
                    yield item
        except (OSError, EOFError) as e:  # a truncated or corrupt gzip stream
            yield Skip("unreadable_file", str(path), f"{type(e).__name__}: {e}")


def _jsonl_record(path: Path, stem: str, lineno: int, raw: bytes | None, fmt: str, need_assistant: bool,
                  limit: int) -> Conversation | Skip | None:
    where = f"{path}:{lineno}"
    if raw is None:
        return _too_large(where, f"longer than {limit:,} bytes", limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Skip("invalid_utf8", where)
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return Skip("malformed_json", where, e.msg)
    except RecursionError:
        return Skip("malformed_json", where, "nested too deeply")
    return parse_record(record, f"{stem}:{lineno}", where, fmt, need_assistant)


def _read_json(path: Path, stem: str, fmt: str, need_assistant: bool, limit: int) -> Iterator[Conversation | Skip]:
    try:
        size = path.stat().st_size
        if size > MAX_JSON_MB * MB:
            yield Skip("unreadable_file", str(path), f"a JSON document of {size / MB:,.0f} MB is read whole (at most "
                                                     f"{MAX_JSON_MB} MB); write it as JSONL, one record per line")
            return
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        yield Skip("invalid_utf8", f"{path}:byte {e.start}", "the file is not valid UTF-8")
        return
    except json.JSONDecodeError as e:
        yield Skip("unreadable_file", f"{path}:{e.lineno}", f"not valid JSON: {e.msg}")
        return
    except RecursionError:
        yield Skip("unreadable_file", str(path), "not valid JSON: nested too deeply")
        return
    except OSError as e:
        yield Skip("unreadable_file", str(path), e.strerror or type(e).__name__)
        return
    if isinstance(doc, dict):  # {"data": [...]} and similar wrappers
        lists = [v for v in doc.values() if isinstance(v, list)]
        doc = lists[0] if len(lists) == 1 else [doc]
    if not isinstance(doc, list):
        yield Skip("unreadable_file", str(path), "expected a list of records")
        return
    for i, record in enumerate(doc):
        yield _checked(record, f"{stem}:{i}", f"{path}:record {i}", fmt, need_assistant, limit)


def _checked(record: Any, default_id: str, where: str, fmt: str, need_assistant: bool,
             limit: int) -> Conversation | Skip:
    """parse_record for a record already in memory (a JSON document's entry, a dataset row), measured as
    JSON first: one over the cap is skipped as it would be in a JSONL file, before it is tokenized."""
    size = len(json.dumps(record, ensure_ascii=False, default=str).encode())
    if size > limit:
        return _too_large(where, f"{size:,} bytes", limit)
    return parse_record(record, default_id, where, fmt, need_assistant)


def _read_parquet(path: Path, stem: str, fmt: str, need_assistant: bool, limit: int) -> Iterator[Conversation | Skip]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        i = 0
        # small batches: a batch is decoded whole before its rows can be measured
        for batch in pf.iter_batches(batch_size=64):
            for row in range(batch.num_rows):
                where = f"{path}:row {i}"
                one = batch.slice(row, 1)
                if one.nbytes > limit:  # the bytes of this row's values in Arrow, before any Python object
                    yield _too_large(where, f"{one.nbytes:,} bytes", limit)
                else:
                    yield parse_record(one.to_pylist()[0], f"{stem}:{i}", where, fmt, need_assistant)
                i += 1
    except Exception as e:  # noqa: BLE001 -- pyarrow raises several types for a bad or truncated file
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        yield Skip("unreadable_file", str(path), f"{type(e).__name__}: {first}" if first else type(e).__name__)


def _read_hf(name: str, stem: str, fmt: str, need_assistant: bool, limit: int) -> Iterator[Conversation | Skip]:
    """A hub dataset name (`org/name`, optionally `org/name:split`) or a `save_to_disk` directory."""
    try:
        import datasets

        if Path(name).is_dir():
            ds = datasets.load_from_disk(name)
        else:
            repo, _, split = name.partition(":")
            ds = datasets.load_dataset(repo, split=split or "train")
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    except Exception as e:  # noqa: BLE001 -- offline, missing, private: all one skip with the reason
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        hint = "" if Path(name).is_dir() else "; without network, pass a local file or a save_to_disk directory"
        yield Skip("unreadable_file", name, f"{type(e).__name__}: {first}{hint}")
        return
    for i, record in enumerate(ds):
        yield _checked(record, f"{stem}:{i}", f"{name}:row {i}", fmt, need_assistant, limit)


# ---------------------------------------------------------------- one record

def parse_record(record: Any, default_id: str, where: str, fmt: str = "auto",
                 need_assistant: bool = True) -> Conversation | Skip:
    """Normalise one record to a Conversation, or say why it cannot be used."""
    if not isinstance(record, dict):
        return Skip("not_an_object", where)
    kind = _detect(record) if fmt == "auto" else fmt
    if kind is None or (fmt != "auto" and _detect(record) != fmt):
        return Skip("unknown_format", where)
    sample_id = next((str(record[k]) for k in _ID_KEYS if record.get(k) not in (None, "")), default_id)
    if kind == "prompt-response":
        messages = [{"role": "user", "content": record.get("prompt")}]
        if "response" in record or "completion" in record:
            messages.append({"role": "assistant", "content": record.get("response", record.get("completion"))})
        return _check(sample_id, messages, where, need_assistant, record.get("system"))
    raw = record["conversations"] if kind == "sharegpt" else record["messages"]
    if not isinstance(raw, list):
        return Skip("unknown_format", where, "conversation field is not a list")
    messages = []
    for m in raw:
        if not isinstance(m, dict):
            return Skip("missing_field", where, "a message is not an object")
        role = m.get("from", m.get("role"))
        content = m.get("value", m.get("content"))
        if role is None or "value" not in m and "content" not in m:
            return Skip("missing_field", where)
        if not isinstance(role, str) or role.lower() not in _ROLE_MAP[kind]:
            return Skip("unknown_role", where, str(role)[:40])
        messages.append({"role": _ROLE_MAP[kind][role.lower()], "content": content})
    return _check(sample_id, messages, where, need_assistant, record.get("system"))


def _detect(record: dict) -> str | None:
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        return "openai"
    if "prompt" in record:
        return "prompt-response"
    return None


def _blank(content: Any) -> bool:
    """None, or only whitespace: a placeholder."""
    return content is None or isinstance(content, str) and not content.strip()


def _check(sample_id: str, messages: list[dict], where: str, need_assistant: bool,
           system: Any = None) -> Conversation | Skip:
    """The conversation, repaired (EDITS) where a common shape allows, with the record's top-level `system`
    field (None or blank: none) as its system prompt; or why it cannot be used."""
    edits: list[str] = []
    if messages and messages[0]["role"] == "system" and _blank(messages[0]["content"]):
        messages = messages[1:]
        edits.append("empty_system_dropped")
    if not _blank(system):  # checked like any content: a non-string is a skip, not dropped
        if messages and messages[0]["role"] == "system":
            return Skip("two_system_prompts", where, 'drop the record\'s "system" field or its system message')
        messages = [{"role": "system", "content": system}] + messages
    roles = [m["role"] for m in messages]
    if not need_assistant and roles[-1:] == ["assistant"] and _blank(messages[-1]["content"]):
        messages = messages[:-1]  # a placeholder that the regeneration replaces
        edits.append("placeholder_answer_dropped")
    elif need_assistant and roles[-2:] == ["assistant", "user"]:
        messages = messages[:-1]  # its content is not checked: it is not used
        edits.append("trailing_user_cut")
    for m in messages:
        if not isinstance(m["content"], str):
            return Skip("non_string_content", where, type(m["content"]).__name__)
        if not m["content"].strip():
            return Skip("empty_content", where, m["role"])
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body:
        return Skip("no_assistant_turn", where)
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            if m["role"] == "user" and i > 0 and body[i - 1]["role"] == "user":
                return Skip("two_user_turns", where)
            return Skip("bad_turn_order", where, f"turn {i} is {m['role']}, expected {expected}")
    if need_assistant and body[-1]["role"] != "assistant":
        return Skip("no_assistant_turn", where)
    return Conversation(sample_id, [dict(m) for m in messages], where, tuple(edits))
