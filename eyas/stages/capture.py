"""The capture stage: prepared data -> the target's hidden states -> a packed, checksummed, resumable store.

Reads top to bottom: open the store (new or resumed, eyas.store.create), plan shards, then for each shard of
this rank take a host buffer from the writer's bounded pool, run token-budgeted forward passes into it (an
out-of-memory error lowers the budget and retries: capture_passes.BatchRunner), hand it to the writer
threads, and finally merge the ranks' manifests and write STORE/summary.json. On CUDA each pass's states
are copied to the pinned buffer on a separate stream, so the copy overlaps the next forward pass and the
writes overlap both; on CPU the same structure runs with plain memory. Under torchrun each rank writes its
own shards and rank 0 merges the manifest at the end.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.common import EyasError, atomic_write_json, format_bytes, print0, progress, warn
from eyas.data.prepared import Prepared, load_prepared_arrays
from eyas.identity import check_target
from eyas.ownership import writing
from eyas.stages.capture_passes import BatchRunner
from eyas.store.batching import auto_token_budget, plan_shards
from eyas.store.codec import bytes_per_token, state_layout
from eyas.store.create import finish_store, new_manifest, open_store
from eyas.store.manifest import MANIFEST, SUMMARY, committed_shards, nonfinite_ids, read_manifest
from eyas.store.writer import ShardJob, ShardWriter
from eyas.target.capture import FeatureCapture


@dataclass(frozen=True)
class Inputs:
    prepared: str | Path  # a directory written by the prepare stage


@dataclass
class _Plan:
    """What this rank captures: the store's shards, those already committed, this rank's share of the rest."""

    shards: list
    done: set
    todo: list[int]
    dtype: str
    budget: int
    manifest: dict


def run(cfg, inputs: Inputs, out: str | Path, *, target=None, engine_socket: str | None = None) -> dict:
    """Capture `inputs.prepared` into the store `out` (resuming what is committed there); returns the summary.
    Rank 0 holds the store's lock meanwhile (eyas.ownership): a second capture into it stops at once."""
    from eyas.target import load_target

    rank, world, local_rank, owned = _init_distributed()
    try:
        with writing(out, "capture", lead=rank == 0) as store:
            prepared = load_prepared_arrays(inputs.prepared)
            if cfg.target.backend == "vllm":
                if target is None:
                    from eyas.target.vllm.capture import load_for_engine

                    target = load_for_engine(cfg)  # its identity, head and norm: the engine computes the states
                return _capture_vllm(cfg, prepared, store, target, world, engine_socket)
            if engine_socket:
                raise EyasError("--engine-socket needs target.backend=vllm (the engine is vLLM's)")
            if target is None:
                device = cfg.target.device
                if world > 1 and device == "auto" and torch.cuda.is_available():
                    device = f"cuda:{local_rank}"
                target = load_target(cfg.target.model, device=device, dtype=cfg.target.dtype,
                                     trust_remote_code=cfg.target.trust_remote_code)
            return _capture(cfg, prepared, store, target, rank, world)
    finally:
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()


def _check_prepared(prepared: Prepared, target) -> None:
    if len(prepared) == 0:
        raise EyasError(f"{prepared.path} holds no samples; nothing to capture")
    if int(prepared.tokens.max()) >= target.vocab_size:
        raise EyasError(f"{prepared.path} holds token id {int(prepared.tokens.max())} but {target.name} has a vocabulary "
                        f"of {target.vocab_size}: the data was prepared with another tokenizer; re-run `eyas prepare`")
    check_target({"tokenizer_hash": prepared.info.get("tokenizer_hash")}, target.identity, what=f"the prepared data {prepared.path}",
                 fix="re-run `eyas prepare` with this target (its tokenizer made the token ids)")


def _plan(cfg, prepared: Prepared, store: Path, target, features: FeatureCapture, rank: int, world: int) -> _Plan:
    dtype = cfg.capture.dtype if cfg.capture.dtype != "auto" else ("bf16" if target.device.type == "cuda" else "fp32")
    shards = plan_shards(prepared.lengths, cfg.capture.shard_tokens)
    fresh = new_manifest(cfg, target, features.aux_layers, prepared, shards, dtype)
    # the first run's budget is recorded and reused on resume, so that a resumed store is bit-identical
    # to an uninterrupted one (batch composition changes the low bits of the results)
    fresh["token_budget"] = cfg.capture.token_budget or auto_token_budget(
        target, features.num_aux, int(prepared.lengths.max()), cfg.capture.ram_budget_gb)
    if rank == 0:
        manifest = open_store(store, fresh, target)
    _barrier(world)
    if rank != 0:
        manifest = read_manifest(store)
    done = {rec["index"] for rec in committed_shards(store, manifest)}
    todo = [i for i in range(len(shards)) if i % world == rank and i not in done]
    if done and not todo and world == 1 and len(done) == len(shards):
        print0(f"{store} already holds all {len(shards)} shards; nothing to capture")
    elif done:
        print0(f"resuming {store}: {len(done)} of {len(shards)} shards already committed")
    budget = cfg.capture.token_budget or manifest.get("token_budget") or fresh["token_budget"]
    return _Plan(shards, done, todo, dtype, budget, manifest)


def _capture_vllm(cfg, prepared: Prepared, store: Path, target, world: int, engine_socket: str | None) -> dict:
    """The same capture with the states from a vLLM engine (target.backend=vllm), which spreads the target over
    its devices itself (target.engine): the run's engine at `engine_socket` (eyas.target.vllm.service), or one
    started here for this capture. A sample the engine would refuse stops it before anything is written; an
    engine that dies stops it naming the engine, with the committed shards intact for a resume."""
    from eyas.target.vllm.capture import connect, engine_dtype, extraction

    if world > 1:
        raise EyasError("target.backend=vllm captures from one process (the engine spreads the target with "
                        "target.engine.tensor_parallel_size and the like); start it without torchrun")
    _check_prepared(prepared, target)  # before the engine's start, which takes a while
    if engine_socket:
        print0(f"capture: using the engine on {engine_socket}")
        features = connect(engine_socket, target, cfg.target.aux_layers)
        session = contextlib.closing(features.engine)
    else:
        session = extraction(target, cfg.target.aux_layers, dtype=engine_dtype(cfg), engine=cfg.target.engine,
                             states_dir=store / ".vllm-states")
    with session as opened:
        features = features if engine_socket else opened
        limit = features.engine.max_model_len
        too_long = [i for i, n in enumerate(prepared.lengths) if n >= limit]
        if too_long:
            names = ", ".join(str(prepared.sample_ids[i]) for i in too_long[:5])
            raise EyasError(f"{len(too_long)} sample(s) of {prepared.path} are too long for the vLLM engine (max_model_len "
                            f"{limit}, one token is generated): {names}{', ...' if len(too_long) > 5 else ''}; raise "
                            f"target.engine.max_model_len or re-run `eyas prepare` with a lower data.max_length")
        try:
            return _capture(cfg, prepared, store, target, 0, 1, features)
        except EyasError:
            raise
        except Exception as e:  # noqa: BLE001 - vLLM's EngineDeadError and what a dying engine raises
            if "EngineDead" not in type(e).__name__ and "engine" not in str(e).lower():
                raise
            committed = len(committed_shards(store, read_manifest(store)))
            raise EyasError(f"the vLLM engine died during capture ({type(e).__name__}: {str(e).strip()[:200]}); "
                            f"the {committed} committed shard(s) of {store} are intact: rerun the same command to "
                            f"resume") from e


def _capture(cfg, prepared: Prepared, store: Path, target, rank: int, world: int, features=None) -> dict:
    features = features or FeatureCapture(target, cfg.target.aux_layers)
    _check_prepared(prepared, target)
    plan = _plan(cfg, prepared, store, target, features, rank, world)
    lengths = prepared.lengths
    runner = BatchRunner(features, prepared, plan.dtype, plan.budget, cfg.capture.inject_oom_tokens,
                         target.tokenizer.pad_token_id or 0)
    capacity = max((int(lengths[plan.shards[i]].sum()) for i in plan.todo), default=1)  # this rank's largest shard
    writer = ShardWriter(store, plan.manifest, state_layout(plan.dtype, features.num_aux, target.hidden_size),
                         capacity, pinned=target.device.type == "cuda", rank=rank, world_size=world,
                         bytes_per_token=bytes_per_token(plan.dtype, features.num_aux, target.hidden_size),
                         num_threads=getattr(cfg.capture, "writer_threads", 0))
    print0(f"capture {target.name} -> {store}: layers {features.aux_layers} + final (post-norm), {plan.dtype}, "
           f"{len(plan.todo)} shard(s) to write on rank {rank} of {world}, token budget {plan.budget} "
           f"({'set' if cfg.capture.token_budget else 'from free memory, kept for resumes'}), "
           f"{writer.num_threads} writer thread(s)")
    t0 = time.perf_counter()
    num_samples, num_tokens = _write_shards(plan, prepared, runner, writer)
    t_computed = time.perf_counter()
    writer.close()
    wall = time.perf_counter() - t0
    totals = _sum_over_ranks([num_samples, num_tokens, runner.num_splits, writer.num_bytes, writer.busy_s,
                              writer.wait_s, time.perf_counter() - t_computed], world)
    _barrier(world)
    if rank == 0:
        finish_store(store)
    _barrier(world)
    summary = _summarize(store, plan, runner, writer, features, wall, totals, world)
    if rank == 0 and (num_tokens > 0 or not (store / SUMMARY).is_file()):  # a no-op rerun keeps the real summary
        atomic_write_json(store / SUMMARY, summary)
    if summary["nonfinite_samples"] and rank == 0:
        bad_ids = nonfinite_ids(read_manifest(store)["shards"])
        warn(f"the target's states of {len(bad_ids)} sample(s) hold NaN or inf ({', '.join(bad_ids[:5])}"
             f"{', ...' if len(bad_ids) > 5 else ''}; listed per shard in {store / MANIFEST}): training skips them. "
             f"With target.dtype=fp16 the target's activations may overflow: capture with bf16 or fp32; if the "
             f"target overflows in bf16 too, check these samples (and `eyas verify {store}`)")
    return summary


def _write_shards(plan: _Plan, prepared: Prepared, runner: BatchRunner, writer: ShardWriter) -> tuple[int, int]:
    """This rank's shards through the passes and the writers; -> (samples, tokens) handed over."""
    lengths = prepared.lengths
    remaining = sum(int(lengths[plan.shards[i]].sum()) for i in plan.todo)
    bar = progress(total=remaining, unit="tok", unit_scale=True, desc="capture", smoothing=0.1)
    num_samples = num_tokens = 0
    try:
        for index in plan.todo:
            rows = plan.shards[index]
            buffer = writer.buffer()  # waits while every buffer is still being written: memory stays bounded
            runner.run_shard(rows, buffer, on_pass=bar.update)
            writer.submit(ShardJob(index, rows, [prepared.sample_ids[r] for r in rows],
                                   [prepared.input_ids(r) for r in rows], [prepared.loss_mask(r) for r in rows],
                                   buffer, tokens_left=remaining))
            remaining -= int(lengths[rows].sum())
            num_samples, num_tokens = num_samples + len(rows), num_tokens + int(lengths[rows].sum())
    except BaseException:
        bar.close()
        with contextlib.suppress(BaseException):  # commit what was handed over before the failure
            writer.close()
        raise
    bar.close()
    return num_samples, num_tokens


def _summarize(store: Path, plan: _Plan, runner: BatchRunner, writer: ShardWriter, features: FeatureCapture,
               wall: float, totals: list[float], world: int) -> dict:
    """STORE/summary.json's figures (this run's, summed over ranks, and the whole store's), printed as a line."""
    num_samples, num_tokens, splits, num_bytes, busy_s, wait_s, drain_s = totals
    final = read_manifest(store)
    summary = {
        "store": str(store), "complete": final["complete"], "dtype": plan.dtype, "aux_layers": features.aux_layers,
        "wall_s": round(wall, 3), "samples": int(num_samples), "tokens": int(num_tokens), "bytes": int(num_bytes),
        "tokens_per_s": round(num_tokens / wall, 1) if wall > 0 else 0.0,
        "bytes_per_token": round(final["num_bytes"] / max(1, final["num_tokens"]), 1),
        "write_mb_per_s": round(num_bytes / wall / 1e6, 1) if wall > 0 else 0.0,
        "num_samples": int(num_samples), "num_tokens": int(num_tokens),  # this run's, as samples and tokens
        "store_samples": final["num_samples"], "store_tokens": final["num_tokens"], "store_bytes": final["num_bytes"],
        "num_shards": len(final["shards"]), "resumed_shards": len(plan.done), "token_budget": plan.budget,
        "final_token_budget": runner.budget, "oom_splits": int(splits), "world_size": world,
        "writer_threads": writer.num_threads, "staging_buffers": writer.max_buffers,
        "staging_alloc_s": round(writer.alloc_s, 3),  # before the timed loop, like loading the target
        # summed over ranks: writer threads' busy time, the loop's waits for a free buffer (writes behind),
        # and the time from the last forward pass to the last commit
        "writer_busy_s": round(busy_s, 3), "writer_wait_s": round(wait_s, 3), "drain_s": round(drain_s, 3),
        # in the whole store: their states hold NaN or inf; training skips them
        "nonfinite_samples": len(nonfinite_ids(final["shards"])),
    }
    print0(f"captured {summary['samples']:,} samples, {summary['tokens']:,} tokens in {wall:.1f} s "
           f"({summary['tokens_per_s']:,.0f} tok/s, {summary['write_mb_per_s']:,.1f} MB/s written, "
           f"{splits:.0f} OOM split(s), waited {wait_s:.1f} s for the writers); store {store}: "
           f"{final['num_samples']:,} samples, {final['num_tokens']:,} tokens, {len(final['shards'])} shards, "
           f"{format_bytes(final['num_bytes'])} ({summary['bytes_per_token']:,} B/token), "
           f"{'complete' if final['complete'] else 'INCOMPLETE'}")
    return summary


# ---------------------------------------------------------------- torchrun: the few collectives capture needs

def _init_distributed() -> tuple[int, int, int, bool]:
    """(rank, world_size, local_rank, owned): torchrun's environment, gloo for the few barriers we need."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0, False
    import datetime

    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=12))
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), owned


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _sum_over_ranks(values: list[float], world: int) -> list[float]:
    if world == 1:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()
