"""The capture loop: prepared data -> the target's hidden states -> a packed, checksummed, resumable store.

Reads top to bottom: open the store (new or resumed), plan shards, then for each shard of this rank
take a host buffer from the writer's bounded pool, run token-budgeted forward passes into it (an
out-of-memory error lowers the budget and retries), hand it to the writer threads, and finally merge
the ranks' manifests and write STORE/summary.json. On CUDA each pass's states are copied to the pinned
buffer on a separate stream, so the copy overlaps the next forward pass and the writes overlap both;
on CPU the same structure runs with plain memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eyas.common import EyasError, atomic_write_json, format_bytes, print0, progress, warn
from eyas.store.batching import auto_token_budget, next_batch, plan_fingerprint, plan_shards
from eyas.store.codec import bytes_per_token, encode, parts, state_layout
from eyas.store.manifest import HEAD_FILE, MANIFEST, RESUME_KEYS, RESUME_KEYS_SINCE, SCHEMA_VERSION, SUMMARY
from eyas.store.manifest import committed_shards
from eyas.store.manifest import differing_keys, nonfinite_ids, read_manifest, write_manifest
from eyas.data.prepared import Prepared, load_prepared_arrays
from eyas.store.shardfile import write_shard_file
from eyas.store.staging import ShardBuffer
from eyas.store.writer import ShardJob, ShardWriter
from eyas.target.capture import FeatureCapture


class BatchRunner:
    """A shard's rows -> token-budgeted forward passes -> its states in a host buffer; on OOM, a smaller budget.

    An out-of-memory error halves the token budget (until the failed pass's rows no longer fit in one
    pass) and re-plans the rest of the shard from the failed pass on, for this and every later shard.
    Budgets stay the first budget over a power of two, so a budget forced 4x too large ends at the one
    that fits and forms exactly the batches a run with that budget forms: the store is bit-identical.
    """

    def __init__(self, features: FeatureCapture, prepared: Prepared, dtype: str, budget: int,
                 inject_oom_tokens: int = 0, pad_id: int = 0):
        self.features, self.prepared, self.dtype = features, prepared, dtype
        self.budget, self.inject_oom_tokens, self.pad_id = budget, inject_oom_tokens, pad_id
        self.device = features.target.device
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.num_splits = 0  # forward passes that ran out of memory and were re-planned smaller

    def run_shard(self, rows: np.ndarray, buffer: ShardBuffer, on_pass=None) -> None:
        lengths = self.prepared.lengths
        start = 0
        while start < len(rows):
            batch = rows[start:start + next_batch(rows[start:], lengths, self.budget)]
            try:
                states, nonfinite = self._forward(batch)
            except torch.OutOfMemoryError as e:
                reason = str(e).splitlines()[0][:120] if str(e) else "out of memory"
            else:
                buffer.put(states, self.copy_stream, nonfinite)
                del states, nonfinite
                start += len(batch)
                if on_pass is not None:
                    on_pass(int(lengths[batch].sum()))
                continue
            # here, outside the except block, the failed pass's tensors (held by the traceback) are freed
            self._shrink(rows[start:], batch, reason)

    def _shrink(self, rest: np.ndarray, failed: np.ndarray, reason: str) -> None:
        lengths = self.prepared.lengths
        padded = len(failed) * int(lengths[failed].max())
        if len(failed) == 1:
            raise EyasError(f"one sample of {padded} tokens does not fit in memory ({reason}); "
                            f"lower data.max_length or use a device with more memory")
        self.num_splits += 1
        while self.budget > 1 and next_batch(rest, lengths, self.budget) >= len(failed):
            self.budget //= 2
        warn(f"out of memory on a forward pass of {len(failed)} samples ({padded} padded tokens): {reason}; "
             f"token budget now {self.budget}, retrying with {next_batch(rest, lengths, self.budget)} samples")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _forward(self, rows: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(the stored states of the rows' real tokens, [B] tokens per row whose states hold a NaN or inf)."""
        lengths = self.prepared.lengths[rows]
        batch, longest = len(rows), int(lengths.max())
        if self.inject_oom_tokens and batch * longest > self.inject_oom_tokens:
            raise torch.OutOfMemoryError(f"injected: {batch * longest} tokens > capture.inject_oom_tokens")
        ids = np.full((batch, longest), self.pad_id, dtype=np.int64)  # [B, L], right padding
        mask = np.zeros((batch, longest), dtype=np.int64)  # [B, L]
        for b, row in enumerate(rows):
            ids[b, :lengths[b]] = self.prepared.input_ids(row)
            mask[b, :lengths[b]] = 1
        # flat positions of the real tokens, samples in row order: computed here, so that unpadding on the
        # device needs no device-to-host sync (a boolean mask index would wait for the forward pass)
        real = np.concatenate([b * longest + np.arange(n) for b, n in enumerate(lengths)])  # [t]
        owner = np.repeat(np.arange(batch), lengths)  # [t] the row of each real token
        ids_t, mask_t, real_t, owner_t = (self._to_device(a) for a in (ids, mask, real, owner))
        aux, final = self.features(ids_t, mask_t)  # [B, L, A*H], [B, L, H]
        aux = aux.reshape(batch * longest, -1).index_select(0, real_t)  # [t, A*H]
        final = final.reshape(batch * longest, -1).index_select(0, real_t)  # [t, H]
        # a token's states hold a NaN or inf iff their sum does (one read, no [t, A*H] mask). Summed in fp32: an
        # fp16 sum overflows at 65504, which a target's massive activations reach with every value finite (only
        # values near 1e34 overflow here). Counted per row on the device, read by the writer thread
        bad = ~(torch.isfinite(aux.sum(-1, dtype=torch.float32)) & torch.isfinite(final.sum(-1, dtype=torch.float32)))
        nonfinite = torch.zeros(batch, dtype=torch.int32, device=aux.device).index_add_(0, owner_t, bad.int())  # [B]
        aux_dtype, final_dtype = parts(self.dtype)
        aux_q, aux_s = encode(aux, aux_dtype, self.features.num_aux)
        final_q, final_s = encode(final, final_dtype, 1)
        states = {"aux_hidden": aux_q, "final_hidden": final_q}
        if aux_s is not None:
            states["aux_scale"] = aux_s
        if final_s is not None:
            states["final_scale"] = final_s
        return states, nonfinite

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Through pinned memory on CUDA: a copy from pageable memory may wait for the device to be idle."""
        t = torch.from_numpy(array)
        return t.pin_memory().to(self.device, non_blocking=True) if self.copy_stream is not None else t.to(self.device)


# ---------------------------------------------------------------- the store

def _scales_note(dtype: str) -> str | None:
    """The manifest's word on the fp8 parts' scales (None without fp8)."""
    names = [name for name, part in zip(("aux_scale [T, A]", "final_scale [T, 1]"), parts(dtype)) if part == "fp8"]
    return f"per token and layer: amax / 448, fp32 {', '.join(names)}" if names else None


def new_manifest(cfg, target, features: FeatureCapture, prepared: Prepared, shards: list, dtype: str) -> dict:
    from eyas import __version__

    return {
        "schema_version": SCHEMA_VERSION,
        "target": target.identity,
        "target_model": cfg.target.model,
        "target_config": json.loads(target.config.to_json_string(use_diff=False)),
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "aux_layers": features.aux_layers,
        "final_hidden": "post_norm",
        "dtype": dtype,
        # the dtype the target computed in (the stored dtype may be lower): a resume in another one would mix
        # states of two precisions in one store
        "compute_dtype": str(target.dtype).removeprefix("torch."),
        "scales": _scales_note(dtype),
        "shard_tokens": cfg.capture.shard_tokens,
        "plan": {"num_shards": len(shards), "num_samples": len(prepared), "num_tokens": int(prepared.offsets[-1]),
                 "prepared_fingerprint": prepared.fingerprint, "fingerprint": plan_fingerprint(shards)},
        "prepared": {"path": prepared.path, "fingerprint": prepared.fingerprint},
        "target_head": None,
        "shards": [],
        "num_samples": 0,
        "num_tokens": 0,
        "num_bytes": 0,
        "complete": False,
        "eyas_version": __version__,
    }


def _check_writable(store: Path) -> None:
    try:
        store.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=store)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise EyasError(f"cannot write into {store} ({e.strerror or e}); make it writable or choose another --out"
                        + ("; the store already there stays valid" if (store / MANIFEST).is_file() else "")) from None


def open_store(store: Path, fresh: dict, target) -> dict:
    """Create a store or reopen one for resuming (rank 0 only). Returns the manifest to extend."""
    _check_writable(store)
    for leftover in store.glob(".*.tmp"):
        leftover.unlink(missing_ok=True)
    if (store / MANIFEST).is_file():
        manifest = read_manifest(store)
        diffs = differing_keys(manifest, {k: fresh[k] for k in RESUME_KEYS})
        diffs += differing_keys(manifest, {k: fresh[k] for k in RESUME_KEYS_SINCE if k in manifest})
        if diffs:
            was = f" (target.dtype: the store was computed in {manifest['compute_dtype']}, this run computes in " \
                  f"{fresh['compute_dtype']})" if "compute_dtype" in diffs else ""
            raise EyasError(f"{store} holds a capture made with other settings (differs in: {', '.join(diffs)}){was}; "
                            f"rerun with the original arguments to resume, or choose another --out")
        manifest["shards"] = committed_shards(store, manifest)
        write_manifest(store, manifest)
        for rank_file in store.glob("manifest.rank-*.json"):
            rank_file.unlink()
        return manifest
    # a head file alone is what a capture killed before its first manifest left: written again below
    foreign = [p.name for p in store.iterdir() if not p.name.startswith(".") and p.name != HEAD_FILE]
    if foreign:
        raise EyasError(f"{store} is not empty and holds no store ({', '.join(sorted(foreign)[:3])}, ...); "
                        f"choose an empty or new --out")
    head = {"embed_tokens.weight": target.embed_tokens.weight.detach().cpu().clone(),  # [V, H]
            "lm_head.weight": target.lm_head.weight.detach().cpu().clone()}  # [V, H]
    tmp = store / f".{HEAD_FILE}.tmp"
    sha256 = write_shard_file(tmp, head, {"target": json.dumps(target.identity)})
    os.replace(tmp, store / HEAD_FILE)
    fresh["target_head"] = {"file": HEAD_FILE, "sha256": sha256}
    write_manifest(store, fresh)
    return fresh


def finish_store(store: Path) -> dict:
    """Fold the ranks' records into manifest.json and mark it complete when every planned shard is there."""
    manifest = read_manifest(store)
    manifest["shards"] = committed_shards(store, manifest)
    manifest["complete"] = len(manifest["shards"]) == manifest["plan"]["num_shards"]
    write_manifest(store, manifest)
    for rank_file in store.glob("manifest.rank-*.json"):
        rank_file.unlink()
    return manifest


# ---------------------------------------------------------------- the entry point

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


def capture(cfg, prepared_dir, store_dir, target=None) -> dict:
    """Capture `prepared_dir` into `store_dir` (resuming what is committed there); returns the summary."""
    from eyas.target import load_target

    rank, world, local_rank, owned = _init_distributed()
    try:
        prepared = load_prepared_arrays(prepared_dir)
        if target is None:
            device = cfg.target.device
            if world > 1 and device == "auto" and torch.cuda.is_available():
                device = f"cuda:{local_rank}"
            target = load_target(cfg.target.model, device=device, dtype=cfg.target.dtype)
        return _capture(cfg, prepared, Path(store_dir), target, rank, world)
    finally:
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()


def _capture(cfg, prepared: Prepared, store: Path, target, rank: int, world: int) -> dict:
    features = FeatureCapture(target, cfg.target.aux_layers)
    dtype = cfg.capture.dtype if cfg.capture.dtype != "auto" else ("bf16" if target.device.type == "cuda" else "fp32")
    if len(prepared) == 0:
        raise EyasError(f"{prepared.path} holds no samples; nothing to capture")
    if int(prepared.tokens.max()) >= target.vocab_size:
        raise EyasError(f"{prepared.path} holds token id {int(prepared.tokens.max())} but {target.name} has a vocabulary "
                        f"of {target.vocab_size}: the data was prepared with another tokenizer; re-run `eyas prepare`")
    made_with = prepared.info.get("tokenizer_hash")
    if made_with and made_with != target.identity.get("tokenizer_hash"):
        raise EyasError(f"{prepared.path} was prepared with another tokenizer ({made_with}) than {target.name}'s "
                        f"({target.identity.get('tokenizer_hash')}); re-run `eyas prepare` with this target")
    lengths = prepared.lengths
    shards = plan_shards(lengths, cfg.capture.shard_tokens)
    max_len = int(lengths.max())
    fresh = new_manifest(cfg, target, features, prepared, shards, dtype)
    # the first run's budget is recorded and reused on resume, so that a resumed store is bit-identical
    # to an uninterrupted one (batch composition changes the low bits of the results)
    fresh["token_budget"] = cfg.capture.token_budget or auto_token_budget(
        target, features.num_aux, max_len, cfg.capture.ram_budget_gb)
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
    pad_id = target.tokenizer.pad_token_id or 0
    runner = BatchRunner(features, prepared, dtype, budget, cfg.capture.inject_oom_tokens, pad_id)
    per_token = bytes_per_token(dtype, features.num_aux, target.hidden_size)
    capacity = max((int(lengths[shards[i]].sum()) for i in todo), default=1)  # tokens of this rank's largest shard
    writer = ShardWriter(store, manifest, state_layout(dtype, features.num_aux, target.hidden_size), capacity,
                         pinned=target.device.type == "cuda", rank=rank, world_size=world, bytes_per_token=per_token,
                         num_threads=getattr(cfg.capture, "writer_threads", 0))
    remaining = sum(int(lengths[shards[i]].sum()) for i in todo)
    print0(f"capture {target.name} -> {store}: layers {features.aux_layers} + final (post-norm), {dtype}, "
           f"{len(todo)} shard(s) to write on rank {rank} of {world}, token budget {budget} "
           f"({'set' if cfg.capture.token_budget else 'from free memory, kept for resumes'}), "
           f"{writer.num_threads} writer thread(s)")
    bar = progress(total=remaining, unit="tok", unit_scale=True, desc="capture", smoothing=0.1)
    t0 = time.perf_counter()
    num_samples = num_tokens = 0
    try:
        for index in todo:
            rows = shards[index]
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
    t_computed = time.perf_counter()
    writer.close()
    wall = time.perf_counter() - t0

    totals = _sum_over_ranks([num_samples, num_tokens, runner.num_splits, writer.num_bytes, writer.busy_s,
                              writer.wait_s, time.perf_counter() - t_computed], world)
    num_samples, num_tokens, splits, num_bytes, busy_s, wait_s, drain_s = totals
    _barrier(world)
    if rank == 0:
        finish_store(store)
    _barrier(world)
    final = read_manifest(store)
    bad_ids = nonfinite_ids(final["shards"])
    summary = {
        "store": str(store), "complete": final["complete"], "dtype": dtype, "aux_layers": features.aux_layers,
        "wall_s": round(wall, 3), "samples": int(num_samples), "tokens": int(num_tokens), "bytes": int(num_bytes),
        "tokens_per_s": round(num_tokens / wall, 1) if wall > 0 else 0.0,
        "bytes_per_token": round(final["num_bytes"] / max(1, final["num_tokens"]), 1),
        "write_mb_per_s": round(num_bytes / wall / 1e6, 1) if wall > 0 else 0.0,
        "num_samples": int(num_samples), "num_tokens": int(num_tokens),  # this run's, as samples and tokens
        "store_samples": final["num_samples"], "store_tokens": final["num_tokens"], "store_bytes": final["num_bytes"],
        "num_shards": len(final["shards"]), "resumed_shards": len(done), "token_budget": budget,
        "final_token_budget": runner.budget, "oom_splits": int(splits), "world_size": world,
        "writer_threads": writer.num_threads, "staging_buffers": writer.max_buffers,
        "staging_alloc_s": round(writer.alloc_s, 3),  # before the timed loop, like loading the target
        # summed over ranks: writer threads' busy time, the loop's waits for a free buffer (writes behind),
        # and the time from the last forward pass to the last commit
        "writer_busy_s": round(busy_s, 3), "writer_wait_s": round(wait_s, 3), "drain_s": round(drain_s, 3),
        "nonfinite_samples": len(bad_ids),  # in the whole store: their states hold NaN or inf; training skips them
    }
    if rank == 0 and (num_tokens > 0 or not (store / SUMMARY).is_file()):  # a no-op rerun keeps the real summary
        atomic_write_json(store / SUMMARY, summary)
    print0(f"captured {summary['samples']:,} samples, {summary['tokens']:,} tokens in {wall:.1f} s "
           f"({summary['tokens_per_s']:,.0f} tok/s, {summary['write_mb_per_s']:,.1f} MB/s written, "
           f"{splits:.0f} OOM split(s), waited {wait_s:.1f} s for the writers); store {store}: "
           f"{final['num_samples']:,} samples, {final['num_tokens']:,} tokens, {len(final['shards'])} shards, "
           f"{format_bytes(final['num_bytes'])} ({summary['bytes_per_token']:,} B/token), "
           f"{'complete' if final['complete'] else 'INCOMPLETE'}")
    if bad_ids and rank == 0:
        warn(f"the target's states of {len(bad_ids)} sample(s) hold NaN or inf ({', '.join(bad_ids[:5])}"
             f"{', ...' if len(bad_ids) > 5 else ''}; listed per shard in {store / MANIFEST}): training skips them. "
             f"With target.dtype=fp16 the target's activations may overflow: capture with bf16 or fp32; if the "
             f"target overflows in bf16 too, check these samples (and `eyas verify {store}`)")
    return summary
