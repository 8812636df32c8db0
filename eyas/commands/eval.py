"""`eyas eval`: speculative decoding with a trained draft on MT-bench, HumanEval or a JSONL of prompts.

The work, and what it writes, is eyas.stages.eval; this module turns the command line into its call.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from eyas.commands import flag_overrides, positive_int
from eyas.layout import eval_result_name

EPILOG = """\
writes RESULT.json (+ .png) per benchmark and setting and summary.json beside them. While a setting runs,
finished requests go to RESULT.requests.jsonl: if the eval is killed, the same command again decodes only
the requests that are missing (the plain-decoding baseline runs again in full)."""


def add_arguments(p) -> None:
    p.add_argument("--config", default="demo", help="preset name or YAML file (default: demo)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--target", help="target spec (HF dir, hub id, .gguf, smollm2, tiny); default: the config's")
    p.add_argument("--draft", required=True, action="append",
                   help="a training run dir, a step dir or an export dir; repeat it to compare drafts of one target "
                        "(needs --out-dir: each draft's results go to DIR/<its directory's name>/; one load of the "
                        "target and one plain decoding baseline for all, and a table of them side by side at the end)")
    p.add_argument("--bench", action="append", metavar="mt-bench|mt-bench-1|humaneval|FILE.jsonl",
                   help="benchmark (repeatable): mt-bench (80 questions, both turns), mt-bench-1 (their 80 first "
                        "turns alone), humaneval (164); a JSONL holds one {id, prompt} or {id, conversations|messages} "
                        "per line")
    p.add_argument("--steps", type=positive_int, help="chain length k (alone: no tree run)")
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
    p.add_argument("--engine", choices=("eyas", "vllm"), default="eyas",
                   help="who decodes: eyas (default; its own engine, chains and trees, one request at a time) or "
                        "vllm (vLLM itself, as it would serve the draft: a checkpoint is exported for vLLM first, "
                        "chains of --steps tokens (default: each of eval.steps), target.engine passed to vllm.LLM; "
                        "a second opinion on tau, acceptance by position and the speedup over plain vLLM "
                        "decoding; needs vLLM installed; results named BENCH-vllm-chain-K; docs/VLLM.md)")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="with --engine vllm: requests sent to the engine at once (default 1); acceptance does not "
                        "depend on it, tokens/s and the speedup do")
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
    return settings_of([args.steps] if args.steps is not None else [], cfg.eval.tree if args.tree else None)


def main(args) -> int:
    from eyas.common import EyasError
    from eyas.data.benchmarks import check_benches
    from eyas.stages import eval as stage

    cfg = _config(args)
    check_benches(cfg.eval.benches, cfg.data.max_record_mb)  # before the target and the draft are loaded
    if args.engine == "vllm":
        from eyas.stages.eval_vllm import chain_settings

        if args.tree:
            raise EyasError("--tree: trees are eyas-only (vLLM's EAGLE-3 drafts chains); drop --tree or use "
                            "--engine eyas")
        settings = chain_settings([args.steps] if args.steps is not None else cfg.eval.steps)
    else:
        settings = _settings(args, cfg)
    if len(args.draft) > 1:
        if args.engine == "vllm":
            raise EyasError("--engine vllm evaluates one draft per call (vLLM loads the target with the draft); "
                            "give one --draft, or use --engine eyas to compare several")
        if not args.out_dir:
            raise EyasError(f"{len(args.draft)} drafts need --out-dir DIR: each draft's results go to "
                            f"DIR/<its directory's name>/")
        stage.run_drafts(cfg, args.draft, args.out_dir, settings=settings, require_compile=args.compile_draft)
        return 0
    out = Path(args.out)
    if out.suffix != ".json" or out.name == stage.SUMMARY:
        raise EyasError(f"--out {out}: expected a path ending in .json (other than {stage.SUMMARY}, which eval keeps "
                        f"beside the results)")
    many = len(settings) * len(cfg.eval.benches) > 1

    def result_path(bench: str, name: str) -> Path:
        if args.out_dir:
            return Path(args.out_dir) / eval_result_name(bench, name)
        return out.with_name(f"{out.stem}-{bench}-{name}.json" if many else out.name)

    with contextlib.ExitStack() as stack:
        if not args.out_dir:  # --out-dir is claimed and locked by the stage; --out's results are locked here
            from eyas.ownership import exclusive, lock_file

            stack.enter_context(exclusive(lock_file(out), str(out),
                                          fix="wait for it to finish, or choose another --out"))
        stage.run(cfg, stage.Inputs(draft=args.draft[0]), args.out_dir or out.parent, settings=settings,
                  result_path=result_path, require_compile=args.compile_draft, own_out=bool(args.out_dir),
                  engine=args.engine, batch_size=args.batch_size)
    return 0
