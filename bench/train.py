"""Training throughput and MFU of the EAGLE-3 draft (TTT forward + backward + AdamW step) on random features.

    python bench/train.py                  # 8B-shaped draft (H 4096, Vd 32000, V 128256, K 7, seq 2048), bf16 on CUDA
    python bench/train.py --tiny           # a toy shape that runs end to end on a CPU in seconds
    python bench/train.py --small          # SmolLM2-shaped draft (H 576, Vd 8192, V 49152, K 5, seq 384)
    python bench/train.py --configs reference,dense --batch 1

Each configuration in --configs is timed on the same shape, side by side:
  reference      the plain path (dense fp32 attention scores, per-step fp32 logits + F.cross_entropy)
  dense          the fast path: fused-mask GEMM attention, fused chunked lm_head + soft CE, few host syncs
  dense+compile  the same with the unrolled draft step under torch.compile
  flex+compile   FlexAttention over [k0; k1..kk] with a block mask (no T x T tensor), step compiled
`:compiled-ce` after a `+compile` configuration (e.g. `flex+compile:compiled-ce`) compiles the soft
cross-entropy's passes over the logits too (`train.compile_loss`); without it they run eagerly.
Model FLOPs count every unrolled step (fc once; per step q/k/v/o, MLP, causal attention over step-0
keys + the diagonal, the draft lm_head; backward = 2x forward) plus the frozen target head (draft-vocab
logits and the full-vocab argmax, forward only). MFU is given against the bf16 matmul rate measured on
this device at the start (the issue's ceiling) and against --peak-tflops. Then the longest sequence
that fits (batch 1) is searched over a few sizes. Configurations are skipped once --budget-s is spent.
The table comes last; `--profile` then adds the kernels of two steps of the fastest configuration under
torch.profiler, grouped by operator, by GPU time (where a step's time goes when MFU is low).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time

import torch

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.train.loop import TTTModule
from eyas.train.metrics import peak_memory_gib

SHAPES = {
    "8b": dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256, draft_vocab=32000, ttt=7, seq=2048),
    "small": dict(hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152, draft_vocab=8192, ttt=5, seq=384),
    "tiny": dict(hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, draft_vocab=256, ttt=3, seq=64),
}


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


def matmul_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The measured dense matmul rate (the MFU ceiling): 8192^3 products on CUDA."""
    if device.type != "cuda":
        return None
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0, reps = time.perf_counter(), 30
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


class Bench:
    def __init__(self, shape: dict, device: torch.device, dtype: str):
        self.shape, self.device, self.dtype = shape, device, dtype
        hf = dict(hidden_size=shape["hidden"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                  intermediate_size=shape["intermediate"], vocab_size=shape["vocab"], rms_norm_eps=1e-5,
                  max_position_embeddings=131072, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
        self.cfg = DraftConfig.from_target_config(hf, shape["draft_vocab"], num_aux_layers=3)
        self.store_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        self.lm_head = (torch.randn(shape["vocab"], shape["hidden"], device=device) * 0.02).to(self.store_dtype)  # [V, H]
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def batch(self, b: int, t: int) -> dict:
        h, dev = self.shape["hidden"], self.device
        return {
            "input_ids": torch.randint(0, self.shape["vocab"], (b, t), device=dev),
            "attention_mask": torch.ones(b, t, dtype=torch.bool, device=dev),
            "loss_mask": torch.ones(b, t, device=dev),
            "aux_hidden": torch.randn(b, t, 3 * h, device=dev).to(self.store_dtype),  # [B, T, A*H]
            "final_hidden": torch.randn(b, t, h, device=dev).to(self.store_dtype),  # [B, T, H]
        }

    def trainer(self, config: str):
        """(step function, number of trainable parameters) of one configuration on a fresh draft."""
        config, _, variant = config.partition(":")
        attention, _, compiled = config.partition("+")
        impl = "reference" if attention == "reference" else "fast"
        torch.manual_seed(0)
        draft = Eagle3Draft(self.cfg).to(self.device)
        model = TTTModule(draft, self.shape["ttt"], 0.8, "fused", impl=impl,
                          attention="dense" if impl == "reference" else attention, compile=compiled == "compile",
                          compile_loss=variant == "compiled-ce")
        if variant not in ("", "compiled-ce"):
            raise ValueError(f"unknown configuration variant {variant!r} (known: compiled-ce)")
        params = [p for p in model.parameters() if p.requires_grad]
        fused = self.device.type == "cuda"
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=fused)
        autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if self.dtype == "bf16" \
            else contextlib.nullcontext

        def step(batch):
            with autocast():
                res = model(batch, self.lm_head)
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return res

        return step, draft.num_trainable_params()

    def time(self, config: str, b: int, t: int, steps: int, warmup: int) -> dict:
        step, num_params = self.trainer(config)
        batch = self.batch(b, t)
        t0 = time.perf_counter()
        for _ in range(warmup):
            res = step(batch)
        res.loss_k  # noqa: B018 - one read of the statistics, as the training loop does
        self.sync()
        first_s = time.perf_counter() - t0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            res = step(batch)
            res.loss_k  # noqa: B018
        self.sync()
        seconds = (time.perf_counter() - t0) / steps
        train_flops, head_flops = flops_per_token(self.cfg, self.shape["ttt"], t, 3)
        return {"config": config, "step_s": seconds, "tokens_per_s": b * t / seconds, "warmup_s": first_s,
                "tflops": b * t * (train_flops + head_flops) / seconds / 1e12, "peak_GiB": peak_memory_gib(self.device),
                "loss": float(res.loss.detach()), "params": num_params, "gflop_per_token": (train_flops + head_flops) / 1e9}

    def fits(self, config: str, t: int) -> bool:
        try:
            step, _ = self.trainer(config)
            step(self.batch(1, t)).loss_k  # noqa: B018
            self.sync()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            free(self.device)


def profile(bench: Bench, config: str, b: int, t: int, top: int = 20) -> None:
    """Two steps of `config` (after two unprofiled ones) under torch.profiler: operators by self device time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step, _ = bench.trainer(config)
    batch = bench.batch(b, t)
    for _ in range(2):
        step(batch).loss_k  # noqa: B018
    bench.sync()
    cuda = bench.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(2):
            step(batch).loss_k  # noqa: B018
        bench.sync()
    # operators (host-side events) only: each holds the device time of the kernels it launched, and the kernels'
    # own events would count that time twice
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU]
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = [e for e in events if key(e) > 0]
    events.sort(key=key, reverse=True)
    total = sum(key(e) for e in events) or 1.0
    print(f"\nprofile of {config}, two steps of {b} x {t} tokens: {total / 2e3:.1f} ms of "
          f"{'GPU' if cuda else 'CPU'} time per step by operator (self time; the top {top})")
    print("| operator | calls per step | ms per step | share |")
    print("|---|---|---|---|")
    for e in events[:top]:
        print(f"| {e.key[:60]} | {e.count // 2} | {key(e) / 2e3:.2f} | {100 * key(e) / total:.1f} % |")
    free(bench.device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = p.add_mutually_exclusive_group()
    group.add_argument("--small", action="store_true", help="SmolLM2-135M shape")
    group.add_argument("--tiny", action="store_true", help="a toy shape for a CPU smoke run (seconds)")
    for name in ("hidden", "heads", "kv-heads", "intermediate", "vocab", "draft-vocab", "ttt", "seq"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 4 on CUDA, 2 on CPU)")
    p.add_argument("--configs", default=None,
                   help="comma list of reference, dense, dense+compile, flex+compile "
                        "(default on CUDA: reference,dense,flex+compile,dense+compile; on CPU: reference,dense)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 8 on CUDA, 2 on CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--peak-tflops", type=float, default=None, help="nominal peak (default 989 for bf16 on CUDA)")
    p.add_argument("--max-seq", type=int, default=None, help="upper end of the longest-sequence search (0 = skip)")
    p.add_argument("--budget-s", type=float, default=170.0, help="skip what is left once this much time is spent")
    p.add_argument("--profile", action="store_true",
                   help="after the table, profile two steps of the fastest configuration (operators by GPU time)")
    return p.parse_args(argv)


def shape_from_args(args: argparse.Namespace) -> dict:
    """The named shape (8B unless --tiny or --small) with any size given on the command line."""
    shape = dict(SHAPES["tiny" if args.tiny else "small" if args.small else "8b"])
    for k in shape:
        if getattr(args, k.replace("-", "_"), None) is not None:
            shape[k] = getattr(args, k)
    for k in ("kv_heads", "draft_vocab"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    return shape


def time_configs(bench: Bench, configs: list[str], batch: int, t: int, steps: int, warmup: int,
                 t_begin: float, budget_s: float, notes: list[str]) -> list[dict]:
    """Each configuration's timing, in order; failures and skips go to `notes`."""
    results = []
    for config in configs:
        if time.perf_counter() - t_begin > budget_s:
            notes.append(f"{config}: skipped (time budget of {budget_s:.0f} s spent)")
            continue
        try:
            r = bench.time(config, batch, t, steps, warmup)
            results.append(r)
            print(f"{config}: {r['step_s'] * 1000:.1f} ms/step, {r['tokens_per_s']:,.0f} tok/s, "
                  f"{r['tflops']:.1f} TFLOP/s, {r['peak_GiB']:.1f} GiB, loss {r['loss']:.4f}", flush=True)
        except Exception as e:  # noqa: BLE001 - a configuration that fails is reported, not fatal
            notes.append(f"{config}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            print(notes[-1], flush=True)
        free(bench.device)
    return results


def longest_sequence(bench: Bench, config: str, t: int, max_seq: int, t_begin: float, budget_s: float,
                     notes: list[str]) -> int | None:
    """The longest sequence (batch 1, doubling from `t`) that `config` fits, or None if no larger one was."""
    longest = None
    size = t
    while size * 2 <= max_seq and time.perf_counter() - t_begin < budget_s:
        size *= 2
        if not bench.fits(config, size):
            notes.append(f"longest sequence: {size} tokens does not fit ({config}, batch 1)")
            break
        longest = size
    if longest is None and size == t:
        notes.append("longest sequence: not searched (time budget spent)")
    return longest


def print_table(shape: dict, device: torch.device, dtype: str, batch: int, t: int, results: list[dict],
                measured: float | None, nominal: float | None) -> None:
    """The run's description, the MFU ceiling and one row per configuration that ran."""
    print()
    cuda = device.type == "cuda"
    dev_name = torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device {dev_name}, {dtype}, torch {torch.__version__}; draft H {shape['hidden']}, heads {shape['heads']}/"
          f"{shape['kv_heads']}, I {shape['intermediate']}, Vd {shape['draft_vocab']}, V {shape['vocab']}, "
          f"K {shape['ttt']}, batch {batch} x seq {t}"
          + (f"; {results[0]['params'] / 1e6:.1f}M trainable, {results[0]['gflop_per_token']:.2f} GFLOP/token" if results else ""))
    ceiling = f"measured bf16 matmul {measured:.0f} TFLOP/s" if measured else "no measured ceiling (CPU)"
    print(f"MFU ceiling: {ceiling}" + (f"; nominal {nominal:.0f}" if nominal else ""))
    header = ["config", "step ms", "tokens/s", "TFLOP/s", "MFU (measured)", "MFU (nominal)", "peak GiB", "1st steps s", "loss"]
    rows = [[r["config"], f"{r['step_s'] * 1000:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['tflops']:.1f}",
             f"{100 * r['tflops'] / measured:.1f}%" if measured else "n/a",
             f"{100 * r['tflops'] / nominal:.1f}%" if nominal else "n/a",
             f"{r['peak_GiB']:.1f}", f"{r['warmup_s']:.1f}", f"{r['loss']:.4f}"] for r in results]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)))


def main(argv=None) -> int:
    args = parse_args(argv)
    t_begin = time.perf_counter()
    shape = shape_from_args(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    steps = args.steps or (8 if cuda else 2)
    batch = args.batch or (4 if cuda else 2)
    configs = (args.configs or ("reference,dense,flex+compile,dense+compile" if cuda else "reference,dense")).split(",")
    nominal = args.peak_tflops or (989.0 if cuda and dtype == "bf16" else None)
    measured = matmul_tflops(device, torch.bfloat16 if dtype == "bf16" else torch.float32)
    bench = Bench(shape, device, dtype)
    t = shape["seq"]

    notes = []
    results = time_configs(bench, configs, batch, t, steps, args.warmup, t_begin, args.budget_s, notes)

    # the longest sequence (batch 1) that fits, with the fastest configuration that ran
    longest = None
    best = max(results, key=lambda r: r["tokens_per_s"]) if results else None
    max_seq = args.max_seq if args.max_seq is not None else (131072 if cuda else 0)
    if best and max_seq:
        longest = longest_sequence(bench, best["config"], t, max_seq, t_begin, args.budget_s, notes)

    # ---- the table, last
    print_table(shape, device, dtype, batch, t, results, measured, nominal)
    if best:
        print(f"longest sequence that fits (batch 1, {best['config']}): "
              + (f"{longest:,} tokens" if longest else f"{t:,} tokens (larger sizes not tried or not fitting)"))
    for note in notes:
        print(f"note: {note}")
    if args.profile and best:
        profile(bench, best["config"], batch, t)
    print(f"bench wall time {time.perf_counter() - t_begin:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
