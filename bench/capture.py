"""Capture throughput: store writes included vs forward-only, same model, same batches; bytes per token;
the disk's raw write rate in the same run, and whether the disk is the bound.

    python bench/capture.py --model llama8b-random     # Llama-3-8B shapes, random bf16 weights, CUDA (~2-3 min on an H200)
    python bench/capture.py --model smollm2 --device cpu --samples 32 --min-len 64 --max-len 192
    python bench/capture.py --tiny                     # the tiny random target on CPU: the whole path in seconds
    python bench/capture.py --backend hf,vllm          # the capture stage through transformers and through vLLM,
                                                       # side by side (bench/capture_backends.py; SmolLM2 on CPU)

In order: synthetic prepared data (random ids, fixed seed) in a work directory; the disk's write rate
there (`--disk-gb` written by as many threads as the capture's writers, each file fsynced); forward-only
over exactly the batches the capture forms; a capture per storage dtype (each store deleted after, to
spare the disk); forward-only again (the mean of both is the baseline, so drift shows); one pass at the
token budget chosen from free memory (peak memory, no out-of-memory; CUDA and --tiny only). The last
lines are a short table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.config import load_config  # noqa: E402
from eyas.stages import capture  # noqa: E402
from eyas.store.batching import auto_token_budget, next_batch, plan_shards, token_batches  # noqa: E402
from eyas.data.prepared import load_prepared_arrays  # noqa: E402
from eyas.store.writer import default_writer_threads  # noqa: E402
from eyas.target import load_target  # noqa: E402


def llama8b_random(device: str):
    """Llama-3-8B's shapes (hidden 4096, 32 layers, GQA 32/8, vocab 128256) with random bf16 weights, SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.target.load import _finish
    from eyas.target.tiny import make_tiny_tokenizer

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_theta=500000.0, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return _finish(model, make_tiny_tokenizer(), "llama8b-random", None, torch.device(device), torch.bfloat16)


def make_prepared(path: Path, num_samples: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> Path:
    import json

    import datasets

    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=num_samples)
    ids = [rng.integers(0, vocab, size=n).astype(np.int32) for n in lengths]
    masks = [np.r_[np.zeros(n // 2, np.int8), np.ones(n - n // 2, np.int8)] for n in lengths]
    datasets.Dataset.from_dict({"sample_id": [f"b{i}" for i in range(num_samples)], "input_ids": ids,
                                "loss_mask": masks}).save_to_disk(str(path / "dataset"))
    (path / "prepare.json").write_text(json.dumps({"source": "bench/capture.py", "num_kept": num_samples}))
    return path


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def disk_write_rate(directory: Path, total_bytes: int, num_threads: int, file_bytes: int) -> float:
    """Bytes/s of writing `total_bytes` into files of `file_bytes` (each fsynced) with `num_threads`
    threads, as the shard writers do; the files are deleted afterwards."""
    block = memoryview(np.random.default_rng(0).bytes(min(64 << 20, file_bytes)))  # incompressible
    num_files = max(1, -(-total_bytes // file_bytes))
    paths = [directory / f".disk-test-{i}" for i in range(num_files)]
    todo = list(paths)
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                if not todo:
                    return
                path = todo.pop()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                left = file_bytes
                while left > 0:
                    left -= os.write(fd, block[:min(left, len(block))])
                os.fsync(fd)
            finally:
                os.close(fd)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate = num_files * file_bytes / (time.perf_counter() - t0)
    for path in paths:
        path.unlink(missing_ok=True)
    return rate


def _inputs(prepared, rows, device):
    """The padded batch exactly as the capture loop builds it."""
    lengths = prepared.lengths[rows]
    ids = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)  # [B, L]
    mask = np.zeros_like(ids)  # [B, L]
    for b, row in enumerate(rows):
        ids[b, :lengths[b]] = prepared.input_ids(row)
        mask[b, :lengths[b]] = 1
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
    if device.type == "cuda":
        ids_t, mask_t = ids_t.pin_memory(), mask_t.pin_memory()
    return ids_t.to(device, non_blocking=True), mask_t.to(device, non_blocking=True)


@torch.inference_mode()
def forward_only(target, prepared, budget: int, shard_tokens: int) -> float:
    """tokens/s of the base model alone (no hooks, no copies, no writes) over the capture's batches."""
    lengths = prepared.lengths
    batches = [b for rows in plan_shards(lengths, shard_tokens) for b in token_batches(rows, lengths, budget)]
    device = target.device

    def run(rows):
        ids, mask = _inputs(prepared, rows, device)
        target.decoder(input_ids=ids, attention_mask=mask, use_cache=False)

    run(batches[0])  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for rows in batches:
        run(rows)
    sync(device)
    return float(lengths.sum()) / (time.perf_counter() - t0)


def budget_check(target, prepared, budget: int) -> str:
    """One capture pass (hooks, unpadding, encoding) over the longest samples filling the automatic budget."""
    from eyas.stages.capture_passes import BatchRunner
    from eyas.target.capture import FeatureCapture
    from eyas.layers import default_aux_layers

    features = FeatureCapture(target, default_aux_layers(target.num_layers))
    runner = BatchRunner(features, prepared, "bf16", budget)
    rows = plan_shards(prepared.lengths, 1 << 62)[0]  # every row, longest first
    rows = rows[:next_batch(rows, prepared.lengths, budget)]
    padded = len(rows) * int(prepared.lengths[rows].max())
    cuda = target.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(target.device)
    try:
        states = runner._forward(rows)
        sync(target.device)
        del states
    except torch.OutOfMemoryError as e:
        return f"one pass of {padded:,} padded tokens ({len(rows)} samples) at the automatic budget {budget:,}: " \
               f"OUT OF MEMORY ({str(e).splitlines()[0][:100]})"
    memory = ""
    if cuda:
        total = torch.cuda.get_device_properties(target.device).total_memory
        memory = f": peak {torch.cuda.max_memory_allocated(target.device) / 2**30:.1f} of {total / 2**30:.1f} GiB"
    return f"one pass of {padded:,} padded tokens ({len(rows)} samples) at the automatic budget {budget:,}{memory}, no OOM"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny | llama8b-random | any load_target spec")
    p.add_argument("--tiny", action="store_true", help="the tiny random target on CPU with small data (seconds)")
    p.add_argument("--device", default="auto")
    p.add_argument("--samples", type=int, default=0, help="default: 48 on CPU, 512 on CUDA")
    p.add_argument("--min-len", type=int, default=0, help="default: 64 on CPU, 256 on CUDA")
    p.add_argument("--max-len", type=int, default=0, help="default: 256 on CPU, 1536 on CUDA")
    p.add_argument("--token-budget", type=int, default=0, help="0 = from free memory, as eyas capture does")
    p.add_argument("--shard-tokens", type=int, default=0, help="default: 16384 (passes never span shards)")
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--writers", type=int, default=0, help="writer threads (default: min(4, cores))")
    p.add_argument("--disk-gb", type=float, default=0.0, help="GB written for the disk's rate (default 4 on CUDA, 0.5 on CPU)")
    p.add_argument("--workdir", default=None, help="where the stores go (default: a temporary directory)")
    p.add_argument("--backend", default=None, metavar="hf,vllm",
                   help="instead: the capture stage's tokens/s through each target backend, side by side in one run "
                        "(bench/capture_backends.py; --model, --samples, --min-len, --max-len and --workdir apply)")
    p.add_argument("--engine", default='{"max_model_len": 1024}', help="with --backend: target.engine for vLLM (JSON)")
    p.add_argument("--target-dtype", default="fp32", help="with --backend: target.dtype")
    args = p.parse_args()
    if args.tiny:
        args.model, args.device = "tiny", "cpu"
        args.samples, args.min_len, args.max_len = args.samples or 64, args.min_len or 16, args.max_len or 128
        args.shard_tokens, args.disk_gb = args.shard_tokens or 1024, args.disk_gb or 0.05
    return args


def measure_disk(work: Path, disk_gb: float, writers: int, shard_tokens: int, num_aux: int, hidden_size: int) -> float:
    """The disk's write rate (bytes/s) in files about the size of a bf16 shard, printed."""
    state_bytes = (num_aux + 1) * hidden_size * 2  # a bf16 shard's bytes per token, about
    file_bytes = int(min(disk_gb * 1e9, max(16 << 20, shard_tokens * state_bytes)))
    disk = disk_write_rate(work, int(disk_gb * 1e9), writers, file_bytes)
    print(f"disk: {disk_gb:g} GB in files of {file_bytes / 1e6:,.0f} MB by {writers} thread(s), fsynced: "
          f"{disk / 1e6:,.0f} MB/s", flush=True)
    return disk


def capture_stores(target, model: str, dtypes: list[str], prepared_dir: Path, work: Path, budget: int,
                   shard_tokens: int, writers: int) -> list[tuple[str, dict]]:
    """(dtype, capture statistics) of one capture per storage dtype; each store is deleted after, to spare the disk."""
    rows = []
    for dtype in dtypes:
        cfg = load_config("demo", [f"target.model={model}", f"capture.dtype={dtype}",
                                   f"capture.token_budget={budget}", f"capture.shard_tokens={shard_tokens}"])
        cfg.capture.writer_threads = writers
        store = work / f"store-{dtype}"
        s = capture.run(cfg, capture.Inputs(prepared_dir), store, target=target)
        rows.append((dtype, s))
        shutil.rmtree(store, ignore_errors=True)
    return rows


def print_table(target, tokens: int, budget: int, shard_tokens: int, writers: int, seconds: float, disk: float,
                check: str, fwd: float, rows: list[tuple[str, dict]]) -> None:
    """The closing summary: one row per storage dtype, against the forward-only rate and the disk's."""
    device_name = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else \
        f"CPU x{torch.get_num_threads()} threads"
    print()
    print(f"capture benchmark: {target.name} on {device_name}, {tokens:,} tokens, passes of <= {min(budget, shard_tokens):,} "
          f"tokens, {writers} writer thread(s), {seconds:.0f} s in all")
    print(f"disk write+fsync {disk / 1e6:,.0f} MB/s; automatic budget: {check}")
    print("| store | forward tok/s | capture tok/s | capture/fwd | bytes/token | MB/s at fwd rate | MB/s written "
          "| disk MB/s | loop waited s | bound |")
    print("|-------|---------------|---------------|-------------|-------------|------------------|--------------"
          "|-----------|---------------|-------|")
    for dtype, s in rows:
        need = fwd * s["bytes_per_token"]  # what the disk must take for capture to match forward-only
        bound = f"disk ({disk / need:.2f} of need)" if need > disk else "forward"
        print(f"| {dtype:<5} | {fwd:>13,.0f} | {s['tokens_per_s']:>13,.0f} | {s['tokens_per_s'] / fwd:>11.2f} "
              f"| {s['bytes_per_token']:>11,.0f} | {need / 1e6:>16,.0f} | {s['write_mb_per_s']:>12,.0f} "
              f"| {disk / 1e6:>9,.0f} | {s['writer_wait_s']:>13.1f} | {bound} |")


def main() -> None:
    args = parse_args()
    if args.backend:
        import capture_backends

        capture_backends.main(argparse.Namespace(
            model=args.model, backends=args.backend, samples=args.samples or 32, min_len=args.min_len or 64,
            max_len=args.max_len or 192, dtype=args.target_dtype, engine=args.engine, workdir=args.workdir))
        return
    started = time.perf_counter()
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = "cuda" if cuda and args.device == "auto" else ("cpu" if args.device == "auto" else args.device)
    samples = args.samples or (512 if cuda else 48)
    min_len, max_len = args.min_len or (256 if cuda else 64), args.max_len or (1536 if cuda else 256)
    shard_tokens = args.shard_tokens or 16384
    writers = args.writers or default_writer_threads()

    if args.model == "llama8b-random":
        target = llama8b_random(device)
    else:
        target = load_target(args.model, device=device, dtype="auto")
    print(f"loaded {target.name} ({target.num_layers} layers, hidden {target.hidden_size}, {target.dtype}) "
          f"on {target.device} in {time.perf_counter() - started:.1f} s", flush=True)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="eyas-bench-capture-"))
    work.mkdir(parents=True, exist_ok=True)
    prepared_dir = make_prepared(work / "prepared", samples, min_len, max_len, min(target.vocab_size, 32000))
    prepared = load_prepared_arrays(prepared_dir)
    from eyas.layers import default_aux_layers

    num_aux = len(default_aux_layers(target.num_layers))
    auto_budget = auto_token_budget(target, num_aux, max_len)
    budget = args.token_budget or auto_budget
    tokens = int(prepared.offsets[-1])
    print(f"{samples} samples, {tokens:,} tokens, lengths {min_len}..{max_len}, token budget {budget:,} "
          f"(automatic: {auto_budget:,}), shards of {shard_tokens:,} tokens (a pass never spans shards)", flush=True)

    disk = measure_disk(work, args.disk_gb or (4.0 if cuda else 0.5), writers, shard_tokens, num_aux, target.hidden_size)

    # forward-only before and after the captures, so that drift over the run shows up
    fwd_before = forward_only(target, prepared, budget, shard_tokens)
    print(f"forward only: {fwd_before:,.0f} tok/s", flush=True)
    rows = capture_stores(target, args.model, [d for d in args.dtypes.split(",") if d], prepared_dir, work, budget,
                          shard_tokens, writers)
    fwd_after = forward_only(target, prepared, budget, shard_tokens)
    fwd = (fwd_before + fwd_after) / 2
    print(f"forward only again: {fwd_after:,.0f} tok/s (mean {fwd:,.0f})", flush=True)
    if cuda or args.tiny:  # on CPU a pass at the budget is slow and says little
        check = budget_check(target, prepared, auto_budget)
        print(check, flush=True)
    else:
        check = "not checked on CPU"
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)

    print_table(target, tokens, budget, shard_tokens, writers, time.perf_counter() - started, disk, check, fwd, rows)


if __name__ == "__main__":
    main()
