"""Capture throughput: store writes included vs forward-only, same model, same batches; bytes per token.

    python bench/capture.py                              # SmolLM2 on CPU (the figures in docs/perf/capture.md)
    python bench/capture.py --model llama8b-random       # an 8B-shaped Llama with random weights, bf16, CUDA

Synthetic prepared data (random token ids, fixed seed) is written to a temporary directory; the forward
pass runs over exactly the batches the capture loop forms. The last lines printed are a short table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.config import load_config  # noqa: E402
from eyas.store import capture  # noqa: E402
from eyas.store.batching import auto_token_budget, plan_shards, token_batches  # noqa: E402
from eyas.store.prepared import load_prepared_arrays  # noqa: E402
from eyas.target import load_target  # noqa: E402


def llama8b_random(device: str):
    """Llama-3-8B's shapes (hidden 4096, 32 layers, GQA 32/8, vocab 128256) with random bf16 weights."""
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


@torch.inference_mode()
def forward_only(target, prepared, budget: int, shard_tokens: int) -> float:
    """tokens/s of the base model alone (no hooks, no copies, no writes) over the capture's batches."""
    lengths = prepared.lengths
    batches = [b for rows in plan_shards(lengths, shard_tokens) for b in token_batches(rows, lengths, budget)]
    device = target.device

    def run(rows):
        longest = int(lengths[rows].max())
        ids = torch.zeros(len(rows), longest, dtype=torch.long)  # [B, L]
        mask = torch.zeros(len(rows), longest, dtype=torch.long)  # [B, L]
        for b, row in enumerate(rows):
            n = int(lengths[row])
            ids[b, :n] = torch.from_numpy(prepared.input_ids(row))
            mask[b, :n] = 1
        target.decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)

    run(batches[0])  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for rows in batches:
        run(rows)
    sync(device)
    return float(lengths.sum()) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny | llama8b-random | any load_target spec")
    p.add_argument("--device", default="auto")
    p.add_argument("--samples", type=int, default=0, help="default: 48 on CPU, 192 on CUDA")
    p.add_argument("--min-len", type=int, default=0, help="default: 64 on CPU, 256 on CUDA")
    p.add_argument("--max-len", type=int, default=0, help="default: 256 on CPU, 1536 on CUDA")
    p.add_argument("--token-budget", type=int, default=0, help="0 = from free memory, as eyas capture does")
    p.add_argument("--shard-tokens", type=int, default=0, help="default: 16384 on CPU, 131072 on CUDA")
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--workdir", default=None, help="where the stores go (default: a temporary directory)")
    args = p.parse_args()

    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = "cuda" if cuda and args.device == "auto" else ("cpu" if args.device == "auto" else args.device)
    samples = args.samples or (192 if cuda else 48)
    min_len, max_len = args.min_len or (256 if cuda else 64), args.max_len or (1536 if cuda else 256)
    shard_tokens = args.shard_tokens or (131072 if cuda else 16384)

    t0 = time.perf_counter()
    if args.model == "llama8b-random":
        target = llama8b_random(device)
        spec = "llama8b-random"
    else:
        target = load_target(args.model, device=device, dtype="auto")
        spec = args.model
    print(f"loaded {target.name} ({target.num_layers} layers, hidden {target.hidden_size}, {target.dtype}) "
          f"on {target.device} in {time.perf_counter() - t0:.1f} s", flush=True)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="eyas-bench-capture-"))
    prepared_dir = make_prepared(work / "prepared", samples, min_len, max_len, min(target.vocab_size, 32000))
    prepared = load_prepared_arrays(prepared_dir)
    from eyas.target.layers import default_aux_layers

    num_aux = len(default_aux_layers(target.num_layers))
    budget = args.token_budget or auto_token_budget(target, num_aux, max_len)
    tokens = int(prepared.offsets[-1])
    print(f"{samples} samples, {tokens:,} tokens, lengths {min_len}..{max_len}, token budget {budget}", flush=True)

    # forward-only before and after the captures, so that machine load drifting over the run shows up
    fwd_before = forward_only(target, prepared, budget, shard_tokens)
    print(f"forward only: {fwd_before:,.0f} tok/s", flush=True)
    rows = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        cfg = load_config("demo", [f"target.spec={spec}", f"capture.dtype={dtype}", f"capture.token_budget={budget}",
                                   f"capture.shard_tokens={shard_tokens}"])
        s = capture(cfg, prepared_dir, work / f"store-{dtype}", target=target)
        rows.append((dtype, s["tokens_per_s"], s["bytes_per_token"], s["store_bytes"]))
    fwd_after = forward_only(target, prepared, budget, shard_tokens)
    fwd = (fwd_before + fwd_after) / 2
    print(f"forward only again: {fwd_after:,.0f} tok/s (mean {fwd:,.0f})", flush=True)
    device_name = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else \
        f"CPU x{torch.get_num_threads()} threads"
    print()
    print(f"capture benchmark: {target.name} on {device_name}, {tokens:,} tokens, budget {budget} tokens/pass")
    print(f"| {'store':<8} | {'capture tok/s':>13} | {'forward tok/s':>13} | {'capture/fwd':>11} | {'bytes/token':>11} | {'store size':>10} |")
    print(f"|{'-' * 10}|{'-' * 15}|{'-' * 15}|{'-' * 13}|{'-' * 13}|{'-' * 12}|")
    for dtype, tps, bpt, size in rows:
        print(f"| {dtype:<8} | {tps:>13,.0f} | {fwd:>13,.0f} | {tps / fwd:>11.2f} | {bpt:>11,.0f} | {size / 2**20:>7.1f} MiB |")


if __name__ == "__main__":
    main()
