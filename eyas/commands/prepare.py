"""`eyas prepare`: conversations -> token ids, assistant loss masks and the draft vocabulary.

    eyas prepare --target TARGET --data PATH_OR_NAME [--data ...] --out DIR [--format auto|sharegpt|openai|prompt-response]
                 [--max-length N] [--on-long drop|truncate] [--strict] [--regenerate local|URL] [--draft-vocab N]

Without --data it builds the built-in prompt corpus (data.num_prompts prompts made from text that
ships with CPython, so the set differs between Python versions); --self-prompts N adds N user prompts
written by the target itself. Inputs: JSONL, JSON or Parquet files, `save_to_disk` directories or hub dataset
names (`org/name[:split]`), in ShareGPT, OpenAI-messages or {prompt, response} form. Records that
cannot be used are skipped with a reason, counted in DIR/prepare.json; --strict makes any skip an error.
"""

from __future__ import annotations

from pathlib import Path

from eyas.commands import flag_overrides

EPILOG = """\
writes into DIR:
  dataset/            Arrow dataset: sample_id, input_ids (int32), loss_mask (int8, 1 on assistant tokens)
  vocab.safetensors   draft vocabulary: d2t (offsets), t2d, token_counts
  prepare.json        source, template and tokenizer hashes, kept/skipped counts per reason with the
                      first file:line of each, length policy (written after the data: its presence
                      means they are complete)
  summary.json        wall_s, samples, samples_per_s, tokens, skipped per reason, regeneration figures
  regen-*.jsonl       regenerated responses (a rerun resumes from it)
  self-prompts-*.jsonl  user prompts the target wrote (with --self-prompts; a rerun resumes from it)
  config.yaml         the resolved config

formats: ShareGPT {conversations: [{from, value}]}, OpenAI {messages: [{role, content}]},
{prompt, response[, system]}; a record is named by its id (or sample_id, conversation_id,
question_id, task_id) field, else by FILE:LINE. Regeneration replaces the last assistant turn.
exit status: 0 when a dataset was written (skips reported), 2 with a one-line reason otherwise
(and on any skip under --strict)."""


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="demo", help="preset name (tiny, demo, full) or YAML file (default: demo)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set data.num_prompts=500 (repeatable)")
    parser.add_argument("--target", help="target: HF dir, hub id, .gguf, smollm2, tiny (default: from config)")
    parser.add_argument("--data", action="append", metavar="PATH_OR_NAME",
                        help="input file (.jsonl/.json/.parquet), saved dataset dir or hub name org/name[:split] (repeatable); "
                             "none = the built-in prompt corpus")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--format", choices=["auto", "sharegpt", "openai", "prompt-response"],
                        help="record format (default: auto, detected per record)")
    parser.add_argument("--max-length", type=int, metavar="N",
                        help="longest sample in tokens (default: data.max_length of the config)")
    parser.add_argument("--on-long", choices=["drop", "truncate"], help="what to do with longer samples (default: drop)")
    parser.add_argument("--strict", action="store_true", default=None, help="any skipped record is an error")
    parser.add_argument("--regenerate", metavar="local|URL",
                        help="rewrite the assistant responses with the target: 'local' (in this process), "
                             "an OpenAI-compatible server URL, or 'none' (default with --data: none; "
                             "without --data: the config's, 'local' in the presets)")
    parser.add_argument("--draft-vocab", type=int, metavar="N", help="draft vocabulary size, capped at the target's (default: data.draft_vocab of the config)")
    parser.add_argument("--num-prompts", type=int, metavar="N", help="size of the built-in corpus, without --data (default: data.num_prompts of the config); "
                             "it is made from CPython's own texts, so the prompts depend on the Python version")
    parser.add_argument("--backend", choices=["hf", "vllm"],
                        help="who regenerates with --regenerate local: hf (transformers in this process) or vllm (a "
                             "vLLM engine, target.engine); default: target.backend of the config")
    parser.add_argument("--engine-socket", metavar="PATH",
                        help="with --backend vllm: regenerate through the engine `eyas engine` serves at PATH")
    parser.add_argument("--self-prompts", type=int, metavar="N",
                        help="also have the target write N user prompts itself (it continues its chat template's "
                             "opening of a user turn; duplicates and cut-off ones are dropped) and answer them; "
                             "needs --regenerate (default: data.self_prompts of the config)")


def config_from_args(args):
    from eyas.config import load_config

    sets = list(args.set)
    if args.target:
        sets.append(f"target.model={args.target}")
    if args.backend:
        sets.append(f"target.backend={args.backend}")
    sets += flag_overrides(args, "data", "format", "max_length", "on_long", "strict", "regenerate", "draft_vocab",
                           "num_prompts", "self_prompts")
    if args.data and args.regenerate is None and not any(x.startswith("data.regenerate=") for x in args.set):
        # the presets regenerate their built-in prompts; a user's own conversations keep their
        # responses unless --regenerate asks otherwise
        sets.append("data.regenerate=none")
    cfg = load_config(args.config, sets)
    if args.data:
        # paths may contain commas, so they bypass the comma-separated --set syntax
        cfg.data.data = list(args.data)
    return cfg


def main(args) -> int:
    from eyas.common import EyasError, print0, save_config

    from eyas.stages import prepare

    from eyas.ownership import check_output_path

    cfg = config_from_args(args)
    check_output_path(args.out, "output directory (--out)")  # Path('') would mean the current directory
    out = Path(args.out)
    try:
        summary = prepare.run(cfg, prepare.Inputs(data=tuple(cfg.data.data)), out,
                              engine_socket=args.engine_socket)
        save_config(cfg, out / "config.yaml")
    except OSError as e:  # a full disk or a read-only directory is the user's to fix, not a traceback
        raise EyasError(f"{e.filename or out}: {e.strerror or e}") from None
    dropped = ", ".join(f"{r} {n}" for r, n in summary["dropped"].items()) or "none"
    regen = summary["regeneration"]
    regen_line = ""
    if regen:
        loops = regen.get("repetition_loops") or {}
        regen_line = (f" Regenerated {regen['num_responses']} responses ({regen['num_tokens']} tokens, {regen['mode']}; "
                      f"{regen['finish'].get('length', 0)} stopped at the token limit, {loops.get('responses', 0)} end "
                      f"in a repetition loop, about {100 * loops.get('token_share', 0):.1f}% of the tokens"
                      f"{_loop_policy(loops, summary)}).")
    print0(f"Prepared {summary['num_kept']} of {summary['num_read']} conversations into {out}/dataset "
           f"({summary['num_tokens']} tokens, {summary['num_loss_tokens']} under the loss mask); skipped: {dropped}."
           f"{regen_line} Draft vocabulary {summary['vocab']['draft_vocab_size']} of {summary['vocab']['vocab_size']} "
           f"ids covers {100 * summary['vocab']['coverage']:.1f}% of assistant tokens. "
           f"Details in {out}/prepare.json ({summary['seconds']:.1f} s).")
    return 0


def _loop_policy(loops: dict, summary: dict) -> str:
    """What data.regen_loops did, for the closing line ('' with keep)."""
    if loops.get("policy") == "mask":
        return (f"; masked: {loops.get('masked_responses', 0)} loops, "
                f"{summary.get('num_loop_masked_tokens', 0)} tokens kept as context only")
    if loops.get("policy") == "drop":
        return f"; dropped: {loops.get('dropped_responses', 0)} looping responses"
    return ""
