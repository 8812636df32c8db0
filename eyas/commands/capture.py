"""`eyas capture`: the target's hidden states at the EAGLE-3 layers into a packed, checksummed store.

Rerunning the same command resumes after the last committed shard. Under torchrun each rank writes
its own shards and rank 0 merges the manifest at the end.
"""

from __future__ import annotations

from eyas.commands import flag_overrides
from eyas.config import STORE_DTYPES


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="demo", help="preset name (tiny, demo, full) or YAML file (default: demo)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set capture.shard_tokens=8192 (repeatable)")
    parser.add_argument("--target", help="target model: HF dir, hub id, .gguf, smollm2, tiny (default: from config)")
    parser.add_argument("--data", required=True, metavar="PREPARED_DIR", help="directory written by `eyas prepare`")
    parser.add_argument("--out", required=True, metavar="STORE", help="store directory (created, or resumed)")
    parser.add_argument("--layers", help="aux layer ids in the HF hidden_states convention, e.g. 2,15,27 "
                                         "(default: EAGLE-3's [2, n//2, n-3])")
    parser.add_argument("--dtype", choices=["auto", *STORE_DTYPES],
                        help="storage dtype (default: from config); fp8-aux: fp8 auxiliary states, bf16 final state")
    parser.add_argument("--token-budget", type=int, help="tokens per forward pass (default: from free memory)")
    parser.add_argument("--shard-tokens", type=int, help="tokens per shard file")
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--backend", choices=["hf", "vllm"],
                        help="who computes the states: hf (transformers in this process, under torchrun one copy per "
                             "GPU) or vllm (a vLLM engine spreading the target with target.engine, e.g. "
                             "--set target.engine.tensor_parallel_size=8); default: target.backend of the config")
    parser.add_argument("--engine-socket", metavar="PATH",
                        help="with --backend vllm: use the engine `eyas engine` serves at PATH instead of starting one "
                             "(eyas run passes its engine so that the target is loaded once per run)")


def config_from_args(args):
    from eyas.config import load_config

    sets = list(args.set)
    if args.target:
        sets.append(f"target.model={args.target}")
    if args.layers:
        sets.append(f"target.aux_layers={args.layers}")
    if args.device:
        sets.append(f"target.device={args.device}")
    if args.backend:
        sets.append(f"target.backend={args.backend}")
    sets += flag_overrides(args, "capture", "dtype", "token_budget", "shard_tokens")
    return load_config(args.config, sets)


def main(args) -> int:
    from eyas.stages import capture

    summary = capture.run(config_from_args(args), capture.Inputs(prepared=args.data), args.out,
                          engine_socket=args.engine_socket)
    return 0 if summary["complete"] else 1
