"""`eyas export`: write a trained draft for SGLang, vLLM and speculators (docs/FORMATS.md)."""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("draft", metavar="RUN_OR_CHECKPOINT",
                        help="a run dir (follows `latest`), a step-N checkpoint dir, or an export dir")
    parser.add_argument("--to", default=None, metavar="FORMAT",
                        help="sglang | vllm | speculators | all, or a comma list "
                             "(default: export.formats of the config)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output dir; with one format the export itself, with several DIR/<format>/")
    parser.add_argument("--config", default="demo", help="preset name (tiny, demo, full) or YAML file (default: demo)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set export.dtype=fp32 (repeatable)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="float weight dtype (default: export.dtype)")
    parser.add_argument("--embed", action="store_true",
                        help="also write the target embedding (from the checkpoint or its store, if either has it)")


def main(args) -> int:
    from eyas.config import load_config
    from eyas.formats import FORMATS
    from eyas.stages import export

    sets = list(args.set)
    if args.to:
        names = list(FORMATS) if args.to == "all" else [f.strip() for f in args.to.split(",") if f.strip()]
        sets.append(f"export.formats={','.join(names)}")
    if args.dtype:
        sets.append(f"export.dtype={args.dtype}")
    if args.embed:
        sets.append("export.embed_tokens=true")
    summary = export.run(load_config(args.config, sets), export.Inputs(draft=args.draft), args.out)
    print(f"exported {len(summary['formats'])} format(s) from {args.draft}; each directory's README.md has the "
          f"launch command")
    return 0
