"""`eyas eval`: speculative decoding with a trained draft on MT-bench, HumanEval or a JSONL of prompts.

`evaluate(cfg, draft_path, out_dir, target=None)` is the same work as a Python call for the pipeline.
The draft is loaded here (the top layer) because `eyas.export.load_draft` sits above `eyas.speculative`.

Besides one RESULT.json (+ .png) per benchmark and setting, the command keeps `summary.json` in the
results' directory: the stage's own summary that the pipeline reads (`wall_s`, `tokens_per_s`) and the
headline figures of every result there, merged across runs (the pipeline runs one benchmark x setting
per process), written atomically. An entry's `wall_s` counts from the command's start or its previous
entry, so the first one also carries loading the target and the warm-up, and the entries sum to the
commands' wall time.

While a setting runs, each finished request is appended to RESULT.requests.jsonl beside it: an eval that
is killed keeps those, and the same command run again decodes only the missing requests (the plain
decoding baseline is run again in full). The file goes once RESULT.json is written.
"""

from __future__ import annotations

import time
from pathlib import Path

from eyas.commands import flag_overrides

SUMMARY = "summary.json"
# the figures of a benchmark summary that summary.json repeats per result
HEADLINE = ("tau_pooled", "tau_per_request", "speedup_vs_plain", "speedup_vs_hf", "tokens_per_s", "plain_tokens_per_s",
            "hf_tokens_per_s", "plain_mismatches", "num_requests", "num_tokens", "num_cycles", "total_s",
            "repeat_token_share", "tau_in_repeats", "tau_elsewhere", "ngram_k", "ngram_tau")

HELP = "speculative decoding with a draft: acceptance length and speedup"
EPILOG = """\
writes RESULT.json (+ .png) per benchmark and setting and summary.json beside them. While a setting runs,
finished requests go to RESULT.requests.jsonl: if the eval is killed, the same command again decodes only
the requests that are missing (the plain-decoding baseline runs again in full)."""


def add_arguments(p) -> None:
    p.add_argument("--config", default="demo", help="preset name or YAML file (default: demo)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--target", help="target spec (HF dir, hub id, .gguf, smollm2, tiny); default: the config's")
    p.add_argument("--draft", required=True, help="a training run dir, a step dir or an export dir")
    p.add_argument("--bench", action="append", metavar="mt-bench|humaneval|FILE.jsonl",
                   help="benchmark (repeatable); a JSONL holds one {id, prompt} or {id, conversations|messages} per line")
    p.add_argument("--steps", type=int, help="chain length k (alone: no tree run)")
    p.add_argument("--tree", metavar="TOPK,DEPTH,TOTAL", help="EAGLE-2 dynamic tree, e.g. 4,5,16 (alone: no chain run)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--limit", type=int, help="prompts per benchmark (0 = all)")
    p.add_argument("--threads", type=int, help="torch CPU threads (on a busy machine 1 can be several times faster)")
    p.add_argument("--no-hf-baseline", action="store_true", help="do not time transformers generate")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on a GPU, decode greedy chains, trees and plain text eagerly instead of replaying CUDA "
                        "graphs (sampling is always eager)")
    compiled = p.add_mutually_exclusive_group()
    compiled.add_argument("--compile-draft", action="store_true",
                          help="with CUDA graphs on a GPU, compile the draft-side passes with torch.compile "
                               "(inductor) before their graphs are captured (eval.compile_draft, on in the full "
                               "preset): fused kernels, about 10 %% faster trees on an H200; compiling costs some "
                               "seconds per setting at its first generation. Refused anywhere else")
    compiled.add_argument("--no-compile-draft", action="store_true",
                          help="run the draft's passes uncompiled (eval.compile_draft=false)")
    p.add_argument("--out", default="eval/result.json",
                   help="RESULT.json; with several benchmarks or settings, -BENCH-SETTING is added to the name")
    p.add_argument("--out-dir", help="write DIR/BENCH-SETTING.json and .png instead (the layout of a run's eval/)")


def _config(args):
    from eyas.config import load_config

    sets = list(args.set)
    if args.target:
        sets.append(f"target.model={args.target}")
    if args.bench:
        sets.append(f"eval.benches={','.join(args.bench)}")
    if args.tree is not None:
        sets.append(f"eval.tree={args.tree}")  # validated by the config; which settings run is _settings' call
    sets += flag_overrides(args, "eval", "temperature", "max_new_tokens", "limit", "threads")
    if args.no_hf_baseline:
        sets.append("eval.hf_baseline=false")
    if args.no_cuda_graphs:
        sets.append("eval.cuda_graphs=false")
    if args.compile_draft:
        sets.append("eval.compile_draft=true")
    if args.no_compile_draft:
        sets.append("eval.compile_draft=false")
    return load_config(args.config, sets)


def _settings(args, cfg) -> list[tuple[str, dict]]:
    """--steps alone runs that chain only, --tree alone that tree only (the pipeline runs each setting as
    its own process), both run both, neither runs the config's eval.steps and eval.tree."""
    from eyas.speculative.bench import settings_of

    if args.steps is None and args.tree is None:
        return settings_of(cfg.eval.steps, cfg.eval.tree)
    if args.steps is not None and args.steps < 1:
        from eyas.common import EyasError

        raise EyasError(f"--steps {args.steps}: a chain needs at least one draft token")
    return settings_of([args.steps] if args.steps is not None else [], cfg.eval.tree if args.tree else None)


def _set_threads(n: int) -> None:
    if n > 0:
        import torch

        torch.set_num_threads(n)


def main(args) -> int:
    from eyas.common import EyasError, print0
    from eyas.target import load_target

    started = time.perf_counter()
    cfg = _config(args)
    _set_threads(cfg.eval.threads)
    settings = _settings(args, cfg)
    if not settings:
        raise EyasError("nothing to evaluate: give --steps K and/or --tree TOPK,DEPTH,TOTAL")
    out = Path(args.out)
    if out.suffix != ".json" or out.name == SUMMARY:
        raise EyasError(f"--out {out}: expected a path ending in .json (other than {SUMMARY}, which eval keeps "
                        f"beside the results)")
    target = load_target(cfg.target.model, device=cfg.target.device, dtype=cfg.target.dtype)
    engine, info = build_engine(target, args.draft, cfg.target.aux_layers, cuda_graphs=cfg.eval.cuda_graphs,
                                compile_draft=cfg.eval.compile_draft, require_compile=args.compile_draft)
    print0(f"target {target.name} ({target.device}, {target.dtype}) | draft {args.draft} | aux layers {info['aux']} | "
           f"{'CUDA graphs for greedy chains, trees and plain decoding' if engine.static else 'eager decoding'}"
           f"{f' (draft compiled, {engine.compile_draft})' if engine.compile_draft else ''} | "
           f"settings {', '.join(n for n, _ in settings)} | temperature {cfg.eval.temperature} | "
           f"max new tokens {cfg.eval.max_new_tokens}")
    many = len(settings) * len(cfg.eval.benches) > 1

    def result_path(bench: str, name: str) -> Path:
        if args.out_dir:
            return Path(args.out_dir) / f"{bench}-{name}.json"
        return out.with_name(f"{out.stem}-{bench}-{name}.json" if many else out.name)

    run_benches(cfg, engine, target, info, settings, str(args.draft), result_path, started,
                hf=cfg.eval.hf_baseline, report=True)
    return 0


def run_benches(cfg, engine, target, info: dict, settings, draft: str, result_path, started: float,
                hf: bool, report: bool = False) -> dict:
    """Every benchmark of cfg.eval with every setting: RESULT.json + .png at `result_path(bench name,
    setting)`, merged into summary.json beside them. -> {bench name: {setting: summary}}."""
    from eyas.common import print0
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
                                               chat_template_kwargs=cfg.data.chat_template_kwargs)
        started = update_summary(bench, results[bench_name(bench)], paths, cfg, draft, started)
        if report:
            print0(f"results: {', '.join(str(p[0]) for p in paths.values())}; "
                   f"summary {next(iter(paths.values()))[0].parent / SUMMARY}")
    return results


def update_summary(bench: str, summaries: dict, paths: dict, cfg, draft: str, since: float) -> float:
    """Merge one benchmark's results into summary.json beside them (atomically); -> the time now.

    Each result's entry is keyed by its file name (stem); the time since `since` is spread so that the
    first entry carries what came before its own work (loading, warm-up, earlier benchmarks' writing).
    """
    from eyas.common import atomic_write_json, read_json

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


def evaluate(cfg, draft_path, out_dir, target=None, hf: bool | None = None) -> dict:
    """Run every benchmark x setting of `cfg.eval` with the draft at `draft_path` (a run, step or export
    dir); write `out_dir/<bench>-<setting>.json|.png` and `out_dir/summary.json`. -> {bench: {setting: summary}}."""
    from eyas.speculative.bench import settings_of
    from eyas.target import load_target

    started = time.perf_counter()
    _set_threads(cfg.eval.threads)
    if target is None:
        target = load_target(cfg.target.model, device=cfg.target.device, dtype=cfg.target.dtype)
    hf = cfg.eval.hf_baseline if hf is None else hf
    engine, meta = build_engine(target, draft_path, cfg.target.aux_layers, cuda_graphs=cfg.eval.cuda_graphs,
                                compile_draft=cfg.eval.compile_draft)
    from eyas.common import EyasError

    settings = settings_of(cfg.eval.steps, cfg.eval.tree)
    if not settings:
        raise EyasError("nothing to evaluate: give eval.steps (chain lengths) and/or eval.tree")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return run_benches(cfg, engine, target, meta, settings, str(draft_path),
                       lambda bench, name: out_dir / f"{bench}-{name}.json", started, hf=hf)


def weights_stamp(draft_path) -> str:
    """A short id of the draft's weight files (names, sizes, modification times): a draft retrained in place
    gets a new one, so an interrupted eval's requests are not reused for it (eyas.speculative.bench.RequestJournal)."""
    from eyas.common import sha256_json
    from eyas.export.load import resolve_draft_dir

    d = resolve_draft_dir(draft_path)
    files = sorted(f for f in d.iterdir() if f.suffix in (".safetensors", ".bin", ".pt") and f.is_file())
    return sha256_json([(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files])[:16]


def build_engine(target, draft_path, aux_layers=None, cuda_graphs: bool = False,
                 compile_draft: bool = False, require_compile: bool = False) -> tuple[SpecEngine, dict]:
    """Load a draft for `target` and check that it fits; -> (engine, {"aux": HF ids, "meta": draft meta}).
    cuda_graphs: on a CUDA target, the engine's static path (graphs, one cycle queued ahead, so only the
    total time is measured, not the draft/verify split); nothing changes on a CPU.
    compile_draft: the static path's draft-side passes compiled by inductor. Without that path it has no
    effect, said in a warning (a preset's value, like cuda_graphs), or is refused when `require_compile`
    (asked for on the command line)."""
    from eyas.common import EyasError, warn
    from eyas.export import load_draft
    from eyas.speculative.engine import SpecEngine
    from eyas.target import resolve_aux_layers

    static = cuda_graphs and target.device.type == "cuda"
    if compile_draft and not static:
        why = (f"eval.compile_draft needs a CUDA target with eval.cuda_graphs=true (the target is on "
               f"{target.device}, eval.cuda_graphs={str(cuda_graphs).lower()})")
        if require_compile:  # refused, not ignored: whoever asked for it would otherwise time the eager draft
            raise EyasError(f"{why}; drop --compile-draft (or --set eval.compile_draft=false)")
        warn(f"{why}: the draft's passes run uncompiled here (the results record compile_draft: null)")
        compile_draft = False
    draft, meta = load_draft(draft_path, embed_tokens=target.embed_tokens.weight)
    meta["weights_stamp"] = weights_stamp(draft_path)
    dc = draft.cfg
    if dc.hidden_size != target.hidden_size or dc.vocab_size != target.vocab_size:
        raise EyasError(f"draft {draft_path} was built for hidden size {dc.hidden_size} and vocab {dc.vocab_size}, "
                        f"the target {target.name} has {target.hidden_size} and {target.vocab_size}; "
                        f"pass the draft's own target with --target")
    known = meta.get("target") or {}
    if known.get("config_hash") and known["config_hash"] != target.identity.get("config_hash"):
        warn(f"draft {draft_path} was trained for target {known.get('name')!r} ({known['config_hash']}), "
             f"evaluating with {target.name!r} ({target.identity.get('config_hash')})")
    aux = meta.get("aux_layers") or resolve_aux_layers(aux_layers, target.num_layers)
    if len(aux) != dc.num_aux_layers:
        raise EyasError(f"draft {draft_path} fuses {dc.num_aux_layers} aux layers but {len(aux)} ids are known ({aux})")
    draft = draft.to(device=target.device, dtype=target.dtype)
    engine = SpecEngine(target.model, draft, aux, sync_timing=not static, static=static,
                        compile_draft="inductor" if compile_draft else None)
    return engine, {"aux": aux, "meta": meta}
