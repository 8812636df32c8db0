"""The built-in prompt corpus: instruction prompts made offline from text that ships with CPython.

Sources: the language reference topics in `pydoc_data.topics`, the docstrings of a fixed list of
standard-library modules, and the Zen of Python (the `this` module, rot13 in its source). Templates
per MT-bench category (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities) turn
them into prompts. Candidates are deduplicated, shuffled with the seed and taken round-robin over the
categories, so any `num_prompts` gives a balanced, deterministic set for a given Python version
(prepare.json records the corpus hash). The responses come from regeneration by the target.
"""

from __future__ import annotations

import codecs
import importlib
import importlib.util
import inspect
import random
import re

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")

# modules whose import is cheap and side-effect free; sorted names keep the order stable
_MODULES = sorted({
    "abc", "argparse", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath", "codecs",
    "collections", "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "dis", "email.utils", "enum", "fnmatch", "fractions", "functools", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "html", "http.cookies", "inspect", "io", "ipaddress",
    "itertools", "json", "keyword", "locale", "logging", "math", "numbers", "operator", "os.path",
    "pathlib", "platform", "pprint", "queue", "random", "re", "secrets", "shlex", "shutil", "statistics",
    "string", "struct", "tarfile", "tempfile", "textwrap", "threading", "time", "tokenize", "typing",
    "unicodedata", "urllib.parse", "uuid", "weakref", "zipfile", "zlib",
})
_STEM_MODULES = {"math", "cmath", "statistics", "random", "fractions", "decimal", "colorsys", "hashlib", "zlib",
                 "binascii", "struct", "numbers", "bisect", "heapq", "datetime", "calendar", "time"}
_FIELDS = ("history", "philosophy", "law", "literature", "journalism", "music composition", "architecture",
           "urban planning", "political science", "art criticism", "teaching", "economics", "linguistics",
           "ethics", "anthropology", "religious studies")
_MATH_FUNCS = {"gcd": 2, "lcm": 2, "comb": 2, "perm": 2, "factorial": 1, "isqrt": 1}


def _first_sentence(text: str) -> str:
    paras = [p for p in re.split(r"\n\s*\n", inspect.cleandoc(text)) if p.strip()]
    # C functions start with a signature line such as "sqrt(x)" or "gcd(*integers)"
    if paras and re.match(r"^[\w.]+\(.*\)( -> .*)?$", paras[0].strip().splitlines()[0]):
        paras = paras[1:] if len(paras[0].strip().splitlines()) == 1 else ["\n".join(paras[0].splitlines()[1:])] + paras[1:]
    if not paras:
        return ""
    flat = " ".join(paras[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", flat)
    return (m.group(1) if m else flat).strip()


def _docstrings() -> list[tuple[str, str, str]]:
    """(module, qualified name, one-sentence summary) of public functions, classes and methods."""
    out = []
    for name in _MODULES:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- a module missing from a trimmed Python is simply not used
            continue
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            owner = getattr(obj, "__module__", None)
            if owner in _MODULES and owner != name:
                continue  # a re-export (enum.auto seen from ast) is described by its own module
            members = [(attr, obj)]
            if inspect.isclass(obj):
                members += [(f"{attr}.{m}", getattr(obj, m, None)) for m in sorted(vars(obj)) if not m.startswith("_")]
            for qual, item in members:
                doc = getattr(item, "__doc__", None)
                if not isinstance(doc, str) or (item is not obj and not callable(item)):
                    continue
                summary = _first_sentence(doc)
                if 25 <= len(summary) <= 220 and summary.isascii() and "deprecated" not in summary.lower():
                    out.append((name, f"{name}.{qual}", summary))
    return out


def _topic_paragraphs() -> list[tuple[str, str]]:
    """(topic title, prose paragraph) pairs from the language reference."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        lines = topics[key].strip().splitlines()
        title = (lines[0].strip() if lines else key).replace('"', "'")
        for para in re.split(r"\n\s*\n", topics[key]):
            if para.startswith((" ", "*", "=")) or "::=" in para:
                continue  # grammar, code and underlines are not prose
            flat = " ".join(para.split())
            if 160 <= len(flat) <= 600 and flat.isascii():  # long passages make prefill the cost of regeneration
                out.append((title, flat))
    return out


def _zen() -> list[str]:
    spec = importlib.util.find_spec("this")
    if spec is None or not spec.origin:
        return []
    from pathlib import Path

    source = Path(spec.origin).read_text(encoding="utf-8")
    encoded = re.search(r's = """(.*?)"""', source, re.S)
    if not encoded:
        return []
    lines = codecs.decode(encoded.group(1), "rot13").strip().splitlines()
    return [line.strip() for line in lines[2:] if line.strip()]  # skip the title line


def _candidates(rng: random.Random) -> dict[str, list[str]]:
    docs, paras, zen = _docstrings(), _topic_paragraphs(), _zen()
    titles = sorted({t for t, _ in paras})
    modules = sorted({m for m, _, _ in docs})
    c: dict[str, list[str]] = {k: [] for k in CATEGORIES}
    for mod, qual, summary in docs:
        c["coding"].append(f"Write a Python function that uses `{qual}` in a realistic task. The documentation says: "
                           f"\"{summary}\" Include a docstring and a short usage example.")
        c["coding"].append(f"Without calling `{qual}`, implement your own version of it in plain Python. "
                           f"Its documentation says: \"{summary}\" Explain any edge cases you handle.")
        c["roleplay"].append(f"You are a senior engineer reviewing a pull request in which a junior colleague used "
                             f"`{qual}` without understanding it. Stay in character and explain to them what it does "
                             f"(\"{summary}\") and when they should avoid it.")
        c["reasoning"].append(f"The Python documentation says of `{qual}`: \"{summary}\" Describe a situation where a "
                              f"programmer relying on it could still get a wrong result, and reason step by step about why.")
        if mod in _STEM_MODULES:
            c["stem"].append(f"Explain the mathematics or science behind `{qual}`, whose documentation says: "
                             f"\"{summary}\" Give one worked numerical example.")
    for mod in modules:
        c["writing"].append(f"Write a short, engaging blog post for beginners about Python's `{mod}` module: what "
                            f"problem it solves and one example of it in everyday work.")
        c["writing"].append(f"Draft a concise email to your team proposing that a project adopt the standard "
                            f"`{mod}` module instead of hand-written helpers. Give two reasons.")
        c["roleplay"].append(f"Pretend you are the `{mod}` module of Python's standard library, introducing yourself "
                             f"at a party of other modules. Stay in character for one paragraph.")
    for title, para in paras:
        c["extraction"].append(f"Extract every Python keyword, built-in name and operator mentioned in the passage "
                               f"below and return them as a JSON list of strings.\n\n{para}")
        c["extraction"].append(f"Summarise the following passage from the Python language reference in exactly three "
                               f"bullet points.\n\n{para}")
        c["reasoning"].append(f"Read this passage from the Python language reference and state one consequence that "
                              f"follows from it but is not written in it. Explain your reasoning.\n\n{para}")
    for title in titles:
        c["writing"].append(f"Write a short story in which a programmer finally understands \"{title}\" in Python. "
                            f"Keep it under 300 words.")
        c["writing"].append(f"Write a persuasive paragraph arguing that \"{title}\" is the part of Python every new "
                            f"developer should learn first.")
        c["roleplay"].append(f"Act as a museum guide in an exhibition about programming languages, presenting the "
                             f"exhibit \"{title}\" to a group of school children.")
    for line in zen:
        for fld in _FIELDS:
            c["humanities"].append(f"Write a short essay on how the principle \"{line}\" from the Zen of Python "
                                   f"applies to {fld}.")
            c["humanities"].append(f"Would a scholar of {fld} agree that \"{line}\"? Discuss both sides in two "
                                   f"paragraphs.")
    for i in range(400):
        a, b, c_, d = rng.randint(12, 999), rng.randint(3, 97), rng.randint(2, 60), rng.randint(2, 12)
        name = sorted(_MATH_FUNCS)[i % len(_MATH_FUNCS)]
        args = ", ".join(str(rng.randint(4, 60) if _MATH_FUNCS[name] > 1 else rng.randint(3, 12))
                         for _ in range(_MATH_FUNCS[name]))
        c["math"].append(f"Compute math.{name}({args}) by hand, without a computer, and show every step.")
        c["math"].append(f"A warehouse stores {a} boxes. Each day {b} boxes arrive and {c_} leave. After {d} days, "
                         f"how many boxes are there? Show your work.")
        c["math"].append(f"Solve for x: {b}x + {a} = {a + b * d}. Then check your answer by substitution.")
    return c


def default_prompts(num_prompts: int, seed: int = 0) -> list[dict]:
    """`num_prompts` distinct prompts as [{id, category, prompt}], balanced over the categories."""
    rng = random.Random(seed)
    pools = _candidates(rng)
    seen: set[str] = set()
    for cat in CATEGORIES:
        pool = []
        for p in pools[cat]:
            if p not in seen:
                seen.add(p)
                pool.append(p)
        rng.shuffle(pool)
        pools[cat] = pool
    out: list[dict] = []
    index = {cat: 0 for cat in CATEGORIES}
    while len(out) < num_prompts:
        progressed = False
        for cat in CATEGORIES:
            if len(out) == num_prompts:
                break
            if index[cat] < len(pools[cat]):
                out.append({"id": f"corpus-{cat}-{index[cat]:05d}", "category": cat, "prompt": pools[cat][index[cat]]})
                index[cat] += 1
                progressed = True
        if not progressed:
            break  # every pool is exhausted: fewer prompts than asked (the caller reports it)
    return out
