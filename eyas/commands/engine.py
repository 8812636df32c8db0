"""`eyas engine`: the target loaded once into vLLM, serving regeneration and capture on a Unix socket.

eyas run starts it itself when target.backend=vllm; by hand it lets a user run `eyas prepare` and `eyas capture`
against one load of a big target (pass them `--engine-socket PATH`). It serves until it is terminated
(SIGTERM or Ctrl-C), then shuts vLLM down. The logic is eyas.target.vllm.service.
"""

from __future__ import annotations

EPILOG = """\
The engine answers on PATH once the target is loaded (PATH.key holds the key a client needs, readable by this
user only); `eyas prepare --backend vllm --engine-socket PATH ...` and `eyas capture --backend vllm
--engine-socket PATH ...` then use it. target.engine holds vLLM's arguments (tensor_parallel_size ...)."""


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="demo", help="preset name or YAML file (default: demo)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    parser.add_argument("--target", help="target model: HF dir, hub id, .gguf, smollm2 (default: from config)")
    parser.add_argument("--layers", help="aux layer ids in the HF hidden_states convention (default: the config's)")
    parser.add_argument("--socket", required=True, metavar="PATH", help="the Unix socket to serve on (created)")


def main(args) -> int:
    from eyas.config import load_config
    from eyas.target.vllm.service import main as serve_main

    sets = list(args.set) + ["target.backend=vllm"]
    if args.target:
        sets.append(f"target.model={args.target}")
    if args.layers:
        sets.append(f"target.aux_layers={args.layers}")
    return serve_main(load_config(args.config, sets), args.socket)
