"""Training throughput of the EAGLE-3 draft (TTT forward + backward + AdamW step) on random features.

    python bench/train.py                 # 8B-shaped draft (H 4096, Vd 32000, V 128256, K 7, seq 2048), bf16 on CUDA
    python bench/train.py --small         # SmolLM2-shaped draft (H 576, Vd 8192, V 49152, K 5, seq 384), fp32 on CPU
    python bench/train.py --hidden 2048 --ttt 3 --seq 1024 --batch 2 --steps 5

Counts model FLOPs of every unrolled step (fc once; per step q/k/v/o, MLP, causal attention over
step-0 keys + the diagonal, the draft lm_head; backward = 2x forward) plus the frozen target head
(the draft-vocab logits and the full-vocab argmax, forward only). MFU = achieved / peak, with the
peak from --peak-tflops (default: 989 for an H100/H200 in bf16 on CUDA; none on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.train.loop import TTTModule
from eyas.train.metrics import peak_memory_gib


def flops_per_token(cfg: DraftConfig, ttt: int, seq: int, num_aux: int) -> tuple[float, float]:
    """(training FLOPs of the draft, forward FLOPs of the target head) per token."""
    h, d = cfg.hidden_size, cfg.head_dim
    nh, nkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    fc = 2 * num_aux * h * h
    per_step_dense = 2 * 2 * h * (nh + 2 * nkv) * d + 2 * nh * d * h + 2 * 3 * h * inter + 2 * h * cfg.draft_vocab_size
    attn = 0.0
    for k in range(ttt):
        keys = (seq + 1) / 2 + k  # causal step-0 keys on average, plus k diagonal keys
        attn += 2 * 2 * nh * d * keys  # QK^T and PV
    draft_fwd = fc + ttt * per_step_dense + attn
    target_fwd = 2 * h * cfg.draft_vocab_size + 2 * h * cfg.vocab_size
    return 3 * draft_fwd, target_fwd


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="SmolLM2-135M shape, CPU-sized")
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--draft-vocab", type=int)
    p.add_argument("--ttt", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10 on CUDA, 3 on CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--peak-tflops", type=float, default=None)
    args = p.parse_args(argv)

    shape = (dict(hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152, draft_vocab=8192, ttt=5, seq=384)
             if args.small else
             dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256, draft_vocab=32000, ttt=7, seq=2048))
    for k in shape:
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    steps = args.steps or (10 if device.type == "cuda" else 3)
    peak = args.peak_tflops or (989.0 if device.type == "cuda" and dtype == "bf16" else None)

    hf = dict(hidden_size=shape["hidden"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
              intermediate_size=shape["intermediate"], vocab_size=shape["vocab"], rms_norm_eps=1e-5,
              max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    cfg = DraftConfig.from_target_config(hf, shape["draft_vocab"], num_aux_layers=3)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg).to(device)
    model = TTTModule(draft, shape["ttt"], 0.8, "fused")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    store_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    b, t, h = args.batch, shape["seq"], shape["hidden"]
    lm_head = (torch.randn(shape["vocab"], h, device=device) * 0.02).to(store_dtype)  # [V, H]
    batch = {
        "input_ids": torch.randint(0, shape["vocab"], (b, t), device=device),
        "attention_mask": torch.ones(b, t, dtype=torch.bool, device=device),
        "loss_mask": torch.ones(b, t, device=device),
        "aux_hidden": torch.randn(b, t, 3 * h, device=device).to(store_dtype),  # [B, T, A*H]
        "final_hidden": torch.randn(b, t, h, device=device).to(store_dtype),  # [B, T, H]
    }
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if dtype == "bf16" else contextlib.nullcontext

    def step():
        with autocast():
            res = model(batch, lm_head)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / steps
    tokens = b * t
    train_flops, head_flops = flops_per_token(cfg, shape["ttt"], t, 3)
    achieved = tokens * (train_flops + head_flops) / seconds / 1e12
    rows = [
        ("device", f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} ({dtype}, {torch.get_num_threads()} threads)"),
        ("draft shape", f"H {h}, heads {shape['heads']}/{shape['kv_heads']}, I {shape['intermediate']}, "
                        f"Vd {shape['draft_vocab']}, V {shape['vocab']}"),
        ("trainable params", f"{draft.num_trainable_params() / 1e6:.1f}M"),
        ("TTT steps x tokens", f"{shape['ttt']} x {b}x{t}"),
        ("step time", f"{seconds * 1000:.1f} ms"),
        ("tokens/s", f"{tokens / seconds:,.0f}"),
        ("model TFLOP/s", f"{achieved:.2f} ({(train_flops + head_flops) / 1e9:.2f} GFLOP/token)"),
        ("MFU", f"{100 * achieved / peak:.1f}% of {peak:.3g} TFLOP/s" if peak else "n/a (pass --peak-tflops)"),
        ("peak memory", f"{peak_memory_gib(device):.1f} GiB"),
    ]
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
