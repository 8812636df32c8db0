"""`eyas run`: the whole pipeline in one run directory (the stage table is in eyas/pipeline/table.py)."""

from __future__ import annotations

from pathlib import Path

from eyas.commands import non_negative_seconds


def add_arguments(parser) -> None:
    parser.add_argument("config_file", nargs="?", default=None, metavar="CONFIG.yaml",
                        help="a YAML config (or give --preset)")
    parser.add_argument("--preset", "--config", dest="preset", default=None,
                        help="tiny | demo | full, or a YAML file (default: the run dir's config.yaml, else demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (repeatable)")
    parser.add_argument("--run-dir", required=True, help="where every stage writes; rerun to resume or skip")
    parser.add_argument("--backend", choices=["hf", "vllm"],
                        help="who runs the target for regeneration and capture: hf (transformers, one copy per GPU) "
                             "or vllm (one vLLM engine for both stages, loaded once per run, spread over the GPUs "
                             "with target.engine, e.g. --set target.engine.tensor_parallel_size=8); default: the "
                             "config's target.backend")
    parser.add_argument("--gpus", default=None, help="device indices to use, e.g. 0,1,2,3 (default: all visible)")
    parser.add_argument("--wait-for-gpus", type=non_negative_seconds, default=0.0, metavar="SECONDS",
                        help="wait this long for other processes to free our GPUs (default: refuse at once)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="never run capture and training at once, even with two or more GPUs")
    parser.add_argument("--stage-timeout", type=non_negative_seconds, default=0.0, metavar="SECONDS",
                        help="end a stage command that runs longer than this (default: no limit)")
    parser.add_argument("--grace", type=non_negative_seconds, default=10.0, metavar="SECONDS",
                        help="time between SIGTERM and SIGKILL when a stage is ended")
    parser.add_argument("--release-timeout", type=non_negative_seconds, default=120.0, metavar="SECONDS",
                        help="how long to wait for a stage's GPU memory to be released")
    parser.add_argument("--quiet", action="store_true", help="do not copy stage output to the terminal")


def _devices(text: str | None) -> list[int] | None:
    """--gpus as NVML device indices, each of a GPU this machine has: one that is not there is refused before
    the run directory is touched."""
    from eyas.common import EyasError
    from eyas.gpu import nvml
    from eyas.gpu.devices import parse_gpus

    if text is None:
        return None
    devices = parse_gpus(text)
    if devices and not nvml.available():
        raise EyasError(f"--gpus {text}: no GPU is visible here ({nvml.why_unavailable()}); drop --gpus to run "
                        f"the stages on the CPU")
    known = sorted(g.index for g in nvml.gpus()) if devices else []
    missing = sorted(set(devices) - set(known))
    if missing:
        raise EyasError(f"--gpus {text}: this machine has no GPU {', '.join(map(str, missing))} (it has "
                        f"{', '.join(map(str, known)) or 'none'}); `eyas gpus` lists them")
    return devices


def _check_draft_shape(cfg) -> None:
    """A local target directory's config.json must give a draft that training can build (train.rope against
    the target's rope scaling, heads, sizes); other target specs are checked when training starts."""
    import json

    from eyas.common import EyasError
    from eyas.draft.config import DraftConfig

    path = Path(str(cfg.target.model)).expanduser() / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return  # loading the target names what is wrong with its files
    if not isinstance(hf, dict):
        return
    try:
        DraftConfig.from_target_config(hf, rope=cfg.train.rope)
    except ValueError as e:
        raise EyasError(f"the draft for target {cfg.target.model}: {e}") from None
    except (KeyError, TypeError):
        return  # a config that is not a decoder's: loading the target says so


def main(args) -> int:
    from eyas.common import EyasError
    from eyas.config import load_config
    from eyas.gpu.procs import Terminated
    from eyas.layout import RunLayout
    from eyas.pipeline import RunOptions, run_pipeline

    if args.config_file and args.preset:
        raise EyasError("give either CONFIG.yaml or --preset, not both")
    from eyas.ownership import check_output_path

    check_output_path(args.run_dir, "run directory (--run-dir)")  # Path('') would mean the current directory
    layout = RunLayout(Path(args.run_dir))
    source = args.config_file or args.preset
    if source is None and layout.config.is_file():
        source = str(layout.config)  # a rerun without a config continues with the run's own
    cfg = load_config(source, args.overrides + ([f"target.backend={args.backend}"] if args.backend else []))
    from eyas.data.benchmarks import check_benches

    check_benches(cfg.eval.benches, cfg.data.max_record_mb)  # the eval stage comes last: find a missing benchmark before the first
    _check_draft_shape(cfg)  # likewise a target whose draft training could not build, before regeneration and capture
    opts = RunOptions(gpus=_devices(args.gpus),
                      wait_for_gpus=args.wait_for_gpus, overlap=not args.no_overlap,
                      stage_timeout=args.stage_timeout, grace_s=args.grace,
                      release_timeout_s=args.release_timeout, echo=not args.quiet)
    try:
        runner = run_pipeline(cfg, layout.run, opts)
    except Terminated as e:
        print(f"eyas run: stopped by {e}; every stage process was ended; rerun the same command to resume")
        return 128 + e.signum
    except KeyboardInterrupt:
        print("eyas run: interrupted; every stage process was ended; rerun the same command to resume")
        return 130
    print(f"\neyas run: finished; report: {layout.report}")
    for line in runner.summary:
        print(f"  {line}")
    return 0
