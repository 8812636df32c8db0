"""The eval stage: speculative decoding with a trained draft on MT-bench, HumanEval or a JSONL of prompts.

An EAGLE-3 draft runs eval.steps' chains and eval.tree; a DFlash draft runs chains only: each of eval.steps
that fits its block (at most block_size - 1 guesses) plus block_size - 1 itself, its trees skipped with a line
saying why. Each result and summary.json entry records the draft's `method`.

Besides one RESULT.json (+ .png) per benchmark and setting, the stage keeps `summary.json` in the results'
directory: the stage's own summary that the run report reads (`wall_s`, `tokens_per_s`) and the headline
figures of every result there, merged across runs (`eyas run` runs one benchmark per process), written
atomically. An entry's `wall_s` counts from the stage's start or its previous entry, so the first one also
carries loading the target and the warm-up, and the entries sum to the processes' wall time.

While a setting runs, each finished request is appended to RESULT.requests.jsonl beside it: an eval that is
killed keeps those, and the same call again decodes only the missing requests (the plain decoding baseline
is run again in full). The file goes once RESULT.json is written.

Several drafts against one target (`run_drafts`, `eyas eval --draft A --draft B --out-dir DIR`) share one load
of the target and one plain decoding baseline: each context is decoded plainly once, by the first draft's
engine that meets it, and every draft's speedup is over those same timings. Each draft's results go to
DIR/<its directory's name>/, laid out as one draft's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eyas.common import EyasError, atomic_write_json, print0, read_json
from eyas.layout import eval_result_name
from eyas.ownership import writing

SUMMARY = "summary.json"
# the figures of a benchmark summary that summary.json repeats per result
HEADLINE = ("method", "tau_pooled", "tau_per_request", "speedup_vs_plain", "speedup_vs_hf", "tokens_per_s",
            "plain_tokens_per_s", "hf_tokens_per_s", "plain_mismatches", "num_requests", "num_tokens", "num_cycles",
            "total_s", "repeat_token_share", "tau_in_repeats", "tau_elsewhere", "ngram_k", "ngram_tau")


@dataclass(frozen=True)
class Inputs:
    draft: str | Path  # a training run directory (its latest checkpoint), a step directory or an export directory


def run(cfg, inputs: Inputs, out: str | Path, *, target=None, settings: list | None = None,
        result_path: Callable[[str, str], Path] | None = None, hf: bool | None = None,
        require_compile: bool = False, own_out: bool | None = None, engine: str = "eyas",
        batch_size: int = 1) -> dict:
    """Every benchmark of cfg.eval with every setting (default: cfg.eval.steps and cfg.eval.tree) ->
    OUT/<bench>-<setting>.json|.png (or where `result_path(bench, setting)` says) and summary.json beside
    them; -> {bench: {setting: summary}}. `target`: an already loaded target, else cfg.target.model.
    `require_compile`: eval.compile_draft was asked for explicitly, so a device that cannot honour it is an
    error rather than a warning. `own_out` (default: without `result_path`): `out` is the results' own
    directory, claimed and locked for the stage (eyas.ownership); else it is the user's (the directory of one
    result file) and left as it is. `engine`: "eyas" (eyas's own speculative engine) or "vllm" (vLLM itself
    measures the chains, `batch_size` requests at once: eyas.stages.eval_vllm)."""
    if engine not in ("eyas", "vllm"):
        raise EyasError(f"eval engine {engine!r} is not one of: eyas, vllm")
    if engine == "eyas" and batch_size != 1:
        raise EyasError(f"--batch-size {batch_size}: eyas's engine decodes one request at a time; "
                        f"batches need --engine vllm")
    stage = _run if engine == "eyas" else _run_vllm
    own_out = result_path is None if own_out is None else own_out
    if own_out:
        with writing(out, "eval") as out:
            return stage(cfg, inputs, out, target, settings, result_path, hf, require_compile, batch_size)
    if Path(out).exists() and not Path(out).is_dir():
        raise EyasError(f"{out} is an existing file, not a directory: the results cannot go there; choose another "
                        f"--out")
    return stage(cfg, inputs, out, target, settings, result_path, hf, require_compile, batch_size)


def _run_vllm(cfg, inputs: Inputs, out: str | Path, target, settings, result_path, hf, require_compile,
              batch_size: int) -> dict:
    """The chains through vLLM, which loads the target itself (`target` and `hf` are for eyas's engine)."""
    from eyas.stages import eval_vllm

    started = time.perf_counter()
    if require_compile:
        raise EyasError("--compile-draft compiles eyas's own engine; vLLM compiles (or not) as target.engine "
                        "says: drop --compile-draft with --engine vllm")
    settings = eval_vllm.chain_settings(cfg.eval.steps) if settings is None else settings
    if result_path is None:
        Path(out).mkdir(parents=True, exist_ok=True)
        result_path = lambda bench, name: Path(out) / eval_result_name(bench, name)  # noqa: E731
    return eval_vllm.run(cfg, inputs.draft, settings, result_path, batch_size=batch_size, started=started)


def _run(cfg, inputs: Inputs, out: str | Path, target, settings, result_path, hf, require_compile,
         batch_size: int = 1) -> dict:
    started = time.perf_counter()
    settings, target = _prepare(cfg, settings, target)
    return _run_draft(cfg, inputs.draft, out, target, settings, result_path, hf, require_compile, started)


def _prepare(cfg, settings, target):
    """-> (the settings to run, the loaded target), after eval.threads is applied."""
    from eyas.speculative.bench import settings_of

    if cfg.eval.threads > 0:
        import torch

        torch.set_num_threads(cfg.eval.threads)
    settings = settings_of(cfg.eval.steps, cfg.eval.tree) if settings is None else settings
    if not settings:
        raise EyasError("nothing to evaluate: give eval.steps (chain lengths) and/or eval.tree "
                        "(--steps K and/or --tree TOPK,DEPTH,TOTAL)")
    if target is None:
        from eyas.target import load_target

        target = load_target(cfg.target.model, device=cfg.target.device, dtype=cfg.target.dtype,
                             trust_remote_code=cfg.target.trust_remote_code)
    return settings, target


def _run_draft(cfg, draft, out, target, settings, result_path, hf, require_compile, started: float,
               baselines: dict | None = None) -> dict:
    from eyas.speculative.bench import bench_name, block_settings
    from eyas.speculative.build import build_engine

    engine, info = build_engine(target, draft, cfg.target.aux_layers, cuda_graphs=cfg.eval.cuda_graphs,
                                compile_draft=cfg.eval.compile_draft, require_compile=require_compile)
    method = info["method"]
    if method == "dflash":  # chains of at most block_size - 1 guesses, and that one itself
        settings = block_settings(settings, engine.draft.cfg.block_size)
        result_path = _distinct(result_path, [bench_name(b) for b in cfg.eval.benches], settings)
    print0(f"target {target.name} ({target.device}, {target.dtype}) | {method} draft {draft}"
           f"{f' (block {engine.draft.cfg.block_size})' if method == 'dflash' else ''} | aux layers {info['aux']} | "
           f"{'CUDA graphs for greedy chains, trees and plain decoding' if engine.static else 'eager decoding'}"
           f"{f' (draft compiled, {engine.compile_draft})' if engine.compile_draft else ''} | "
           f"settings {', '.join(n for n, _ in settings)} | temperature {cfg.eval.temperature} | "
           f"max new tokens {cfg.eval.max_new_tokens}")
    if result_path is None:
        Path(out).mkdir(parents=True, exist_ok=True)
        result_path = lambda bench, name: Path(out) / eval_result_name(bench, name)  # noqa: E731
    hf = cfg.eval.hf_baseline if hf is None else hf
    return run_benches(cfg, engine, target, info, settings, str(draft), result_path, started, hf=hf,
                       baselines=baselines)


def draft_labels(drafts: list) -> list[str]:
    """Each draft's results directory under run_drafts' DIR: the name of the draft's own directory."""
    labels = [Path(d).resolve().name for d in drafts]
    for label in dict.fromkeys(labels):
        same = [str(d) for d, x in zip(drafts, labels) if x == label]
        if len(same) > 1:
            raise EyasError(f"the drafts {', '.join(same)} share the directory name {label!r}, which names each "
                            f"draft's results under --out-dir: pass each draft once, or copy one under another name")
    return labels


def run_drafts(cfg, drafts: list, out: str | Path, *, target=None, settings: list | None = None,
               hf: bool | None = None, require_compile: bool = False) -> dict:
    """Every draft in turn on every benchmark and setting, against one load of the target and one plain decoding
    baseline: OUT/<label>/<bench>-<setting>.json|.png and OUT/<label>/summary.json per draft (draft_labels), OUT
    claimed and locked for the stage. A DFlash draft runs the chains of `settings` that fit its block plus its
    block's own (block_settings). -> {label: {bench: {setting: summary}}}."""
    labels = draft_labels(drafts)
    with writing(out, "eval") as out:
        started = time.perf_counter()
        settings, target = _prepare(cfg, settings, target)
        baselines, results = {}, {}
        for label, draft in zip(labels, drafts):
            where = Path(out) / label
            results[label] = _run_draft(cfg, draft, where, target, settings,
                                        lambda bench, name, where=where: where / eval_result_name(bench, name),
                                        hf, require_compile, started, baselines)
            started = time.perf_counter()
            _free_cuda(target)
        print0(compare_table(results))
    return results


def _free_cuda(target) -> None:
    """Give back the memory of a finished draft's engine (its weights and CUDA graphs) before the next is built."""
    import gc

    gc.collect()
    if target.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def compare_table(results: dict) -> str:
    """The drafts side by side: one row per benchmark, draft and setting (tau, speedup, plain decoding's rate)."""
    lines = ["| benchmark | draft | method | setting | tau (pooled / per request) | speedup vs plain | plain tok/s |",
             "|---|---|---|---|---|---|---|"]
    benches = list(dict.fromkeys(b for per in results.values() for b in per))
    for bench in benches:
        for label, per in results.items():
            for name, s in per.get(bench, {}).items():
                lines.append(f"| {bench} | {label} | {s.get('method', 'eagle3')} | {name} | "
                             f"{s['tau_pooled']:.2f} / {s['tau_per_request']:.2f} | {s['speedup_vs_plain']:.2f}x | "
                             f"{s['plain_tokens_per_s']:.1f} |")
    return "\n".join(lines)


def _distinct(result_path, benches: list[str], settings) -> Callable[[str, str], Path] | None:
    """`result_path`, or where it names one file for several results (it was made for one setting and a DFlash
    draft added its block's chain) one that adds -BENCH-SETTING to the name, as `eyas eval --out` does for many."""
    if result_path is None:
        return None
    paths = {result_path(b, name) for b in benches for name, _ in settings}
    if len(paths) == len(benches) * len(settings):
        return result_path

    def each(bench: str, name: str) -> Path:
        p = result_path(bench, name)
        return p.with_name(f"{p.stem}-{bench}-{name}{p.suffix}")

    return each


def run_benches(cfg, engine, target, info: dict, settings, draft: str, result_path, started: float,
                hf: bool, baselines: dict | None = None) -> dict:
    """Every benchmark of cfg.eval with every setting: RESULT.json + .png at `result_path(bench name,
    setting)`, merged into summary.json beside them. -> {bench name: {setting: summary}}. `baselines`
    ({bench name: the dict bench_one keeps its Baselines in}, filled here) carries plain decoding from one draft's
    run to the next."""
    from eyas.speculative.bench import bench_name, bench_one

    results = {}
    for bench in cfg.eval.benches:
        paths = {}
        for name, _ in settings:
            first = result_path(bench_name(bench), name)
            paths[(bench, name)] = (first, first.with_suffix(".png"))
            first.parent.mkdir(parents=True, exist_ok=True)
        results[bench_name(bench)] = bench_one(engine, target, bench, settings, cfg.eval.temperature,
                                               cfg.eval.max_new_tokens, cfg.eval.limit, paths, hf=hf,
                                               extra_settings={"draft": draft, "aux_layers": info["aux"],
                                                               "cuda_graphs": engine.static,
                                                               "compile_draft": engine.compile_draft,
                                                               "draft_weights": info["meta"].get("weights_stamp")},
                                               chat_template_kwargs=cfg.data.chat_template_kwargs,
                                               baselines=None if baselines is None else baselines.setdefault(
                                                   bench_name(bench), {}))
        started = update_summary(bench, results[bench_name(bench)], paths, cfg, draft, started)
        print0(f"results: {', '.join(str(p[0]) for p in paths.values())}; "
               f"summary {next(iter(paths.values()))[0].parent / SUMMARY}")
    return results


def update_summary(bench: str, summaries: dict, paths: dict, cfg, draft: str, since: float) -> float:
    """Merge one benchmark's results into summary.json beside them (atomically); -> the time now.

    Each result's entry is keyed by its file name (stem); the time since `since` is spread so that the
    first entry carries what came before its own work (loading, warm-up, earlier benchmarks' writing).
    """
    now = time.perf_counter()
    own = sum(s.get("wall_s", 0.0) for s in summaries.values())
    extra = max(0.0, (now - since) - own)
    by_dir: dict[Path, dict] = {}
    for i, (name, s) in enumerate(summaries.items()):
        json_path = paths[(bench, name)][0]
        entry = {"bench": bench, "setting": name, "file": json_path.name,
                 **{k: s[k] for k in HEADLINE if k in s},
                 "temperature": cfg.eval.temperature, "max_new_tokens": cfg.eval.max_new_tokens,
                 "limit": cfg.eval.limit, "draft": draft, "finished_at": time.time(),
                 "wall_s": round(s.get("wall_s", 0.0) + (extra if i == 0 else 0.0), 3)}
        by_dir.setdefault(json_path.parent, {})[json_path.stem] = entry
    for directory, entries in by_dir.items():
        path = directory / SUMMARY
        try:
            doc = read_json(path)
            results = doc.get("results") if isinstance(doc, dict) else None
        except (OSError, ValueError):
            results = None
        results = dict(results) if isinstance(results, dict) else {}
        results.update(entries)
        good = [r for r in results.values() if isinstance(r, dict)]
        tokens = sum(r.get("num_tokens", 0) for r in good)
        decode_s = sum(r.get("total_s", 0.0) for r in good)
        atomic_write_json(path, {
            "schema_version": 1,
            "stage": "eval",
            "wall_s": round(sum(r.get("wall_s", 0.0) for r in good), 3),
            "tokens_per_s": tokens / decode_s if decode_s > 0 else 0.0,  # speculative decoding, all results
            "num_results": len(results),
            "results": dict(sorted(results.items())),
        })
    return now
