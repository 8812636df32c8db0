"""The data stage: conversations -> token ids, assistant loss masks and the draft vocabulary (eyas.data)."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from eyas.common import EyasError, atomic_write_json
from eyas.ownership import writing


@dataclass(frozen=True)
class Inputs:
    # conversation files, saved dataset directories or hub dataset names; empty: the built-in prompt corpus
    # (and the target's own prompts with data.self_prompts)
    data: tuple[str, ...] = ()


def run(cfg, inputs: Inputs, out: str | Path, *, target=None, engine_socket: str | None = None) -> dict:
    """Prepare into `out`; returns prepare.json's content and writes OUT/summary.json (`stage_summary`).
    The directory's lock is held meanwhile (eyas.ownership): a second prepare into it stops at once.
    With target.backend=vllm, regeneration runs in the engine served at `engine_socket` (eyas run's), or in
    one started here."""
    from eyas.data import prepare

    t0 = time.perf_counter()
    vllm = cfg.target.backend == "vllm"
    if engine_socket and not vllm:
        raise EyasError("--engine-socket needs target.backend=vllm (the engine is vLLM's)")
    with writing(out, "prepare") as out, contextlib.ExitStack() as stack:
        if target is None:
            if vllm:
                from eyas.target.vllm.capture import load_for_engine

                target = load_for_engine(cfg)  # the engine holds the weights; here the tokenizer and identity
            else:
                from eyas.target import load_target

                target = load_target(cfg.target.model, device=cfg.target.device, dtype=cfg.target.dtype,
                                     trust_remote_code=cfg.target.trust_remote_code)
        engine = None
        if vllm and cfg.data.regenerate == "local":
            if cfg.data.self_prompts:
                raise EyasError("data.self_prompts are written by the target through transformers, which "
                                "target.backend=vllm does not load; set data.self_prompts=0 or target.backend=hf")
            engine = stack.enter_context(_engine(cfg, target, engine_socket, out))
        load_s = time.perf_counter() - t0
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data=list(inputs.data)))
        summary = prepare(cfg, out, target, engine)
        atomic_write_json(out / "summary.json", stage_summary(summary, time.perf_counter() - t0, load_s))
    return summary


@contextlib.contextmanager
def _engine(cfg, target, engine_socket: str | None, out: Path):
    """The vLLM engine regeneration uses: the one served at `engine_socket`, or one started for this command
    (its state files, none for generation, in a directory of OUT it removes)."""
    if engine_socket:
        from eyas.target.vllm.service import RemoteEngine

        print(f"prepare: regenerating through the engine on {engine_socket}", flush=True)
        with RemoteEngine(engine_socket) as engine:
            yield engine
        return
    from eyas.target.vllm.capture import start_engine

    states = out / ".vllm-states"
    with start_engine(cfg, target=target, states_dir=states) as engine:
        yield engine
    shutil.rmtree(states, ignore_errors=True)


def stage_summary(prep: dict, wall_s: float, load_s: float) -> dict:
    """The stage's figures in the keys every stage's summary.json uses (the run report reads samples_per_s).

    `tokens` counts every token of the kept samples; regeneration figures count this run's work only
    (a resumed run skips what an earlier one wrote).
    """
    regen = prep.get("regeneration") or {}
    regen_s = regen.get("seconds_this_run") or 0.0
    regen_tokens = regen.get("num_tokens_this_run") or 0
    return {
        "stage": "prepare",
        "wall_s": round(wall_s, 3),
        "target_load_s": round(load_s, 3),
        "samples": prep["num_kept"],
        "samples_per_s": round(prep["num_kept"] / wall_s, 3) if wall_s > 0 else None,
        "tokens": prep["num_tokens"],
        "loss_tokens": prep["num_loss_tokens"],
        "read": prep["num_read"],
        "skipped": prep["dropped"],  # {reason: count}; reasons are explained in prepare.json
        "skipped_total": prep["num_dropped"],
        "truncated": prep["length_policy"]["num_truncated"],
        "regenerated": regen.get("num_responses_this_run", 0),
        "regen_tokens": regen_tokens,
        "regen_s": regen_s,
        "regen_tokens_per_s": round(regen_tokens / regen_s, 2) if regen_s > 0 and regen_tokens else None,
        "tokenize_conversations_per_s": prep.get("tokenize_conversations_per_s"),
        "draft_vocab_coverage": prep["vocab"]["coverage"],
    }
