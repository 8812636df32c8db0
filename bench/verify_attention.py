"""What one attention call of a verify pass costs, by query count, attended width and SDPA backend.

    python bench/verify_attention.py [--queries 1,37,49] [--widths 256,512,1024] [--layers 30]

A profile of the graphed tree (docs/PERFORMANCE.md) put 40 % of a tree verify pass's extra cost over a plain
step in attention: SmolLM2's 30 layers took 6 us each for one query and 18 us for 37 masked queries, every
call over all 1,024 slots of the static cache. This measures the call alone, shaped as the engine makes it
(transformers with an explicit boolean mask: keys and values repeated to the query heads, no causal flag):
`--layers` calls captured in one CUDA graph and replayed between CUDA events, so the figure is GPU time
with the launch gaps of a graph, per call. The mask lets each query see the first half of the width (the
committed past) and a lower-triangular block of the new entries after it (a chain; a tree's ancestor
mask has the same density or less); the rest of the width is hidden, as the unused cache slots are.

Backends: `auto` (what SDPA picks), then each one forced; a backend that refuses the inputs is shown as
`-`. The last table sets the best widths side by side: whether attending over a width that follows the
committed length (as regeneration does) would pay, and which backend to force for masked queries.

`--cpu` runs the math backend eagerly on the CPU: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"auto": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def make_inputs(queries: int, width: int, heads: int, kv_heads: int, head_dim: int, dtype, device):
    """q [1, heads, T, D], k and v [1, kv_heads, W, D] and the boolean mask [1, 1, T, W] described above."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, heads, queries, head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, kv_heads, width, head_dim, generator=g).to(device, dtype)
    v = torch.randn(1, kv_heads, width, head_dim, generator=g).to(device, dtype)
    past = width // 2
    cols = torch.arange(width)
    rows = torch.arange(queries)
    mask = (cols[None, :] < past) | ((cols[None, :] >= past) & (cols[None, :] - past <= rows[:, None]))
    return q, k, v, mask[None, None].to(device)


def attention(q, k, v, mask, groups: int):
    """The call transformers makes with a mask: repeated keys and values, the mask as given."""
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def time_per_call(fn, layers: int, repeats: int, cuda: bool) -> float:
    """Median microseconds per call over `repeats` replays of `layers` calls (one CUDA graph on CUDA)."""
    import time

    def body():
        for _ in range(layers):
            fn()

    if cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(1000 * start.elapsed_time(end) / layers)
        return statistics.median(times)
    body()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        body()
        times.append(1e6 * (time.perf_counter() - t0) / layers)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", default="1,37,49",
                   help="query counts (plain step 1, tree 12,3,36 verify 37, 16,4,48 49)")
    p.add_argument("--widths", default="256,512,1024", help="attended widths (cache slots)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30, help="calls per graph (SmolLM2 has 30 layers)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--cpu", action="store_true", help="math backend, eager, fp32 on the CPU: checks the script only")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    backends = list(BACKENDS) if cuda else ["math"]
    queries = [int(x) for x in args.queries.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    groups = args.heads // args.kv_heads
    where = torch.cuda.get_device_name() if cuda else "CPU (script check only)"
    print(f"{where}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}; "
          f"heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}; {args.layers} calls per replay, median of {args.repeats}")

    results: dict[tuple[int, int, str], float | None] = {}
    for t in queries:
        for w in widths:
            q, k, v, mask = make_inputs(t, w, args.heads, args.kv_heads, args.head_dim, dtype, device)
            reference = attention(q.float(), k.float(), v.float(), mask, groups)
            for name in backends:
                chosen = BACKENDS[name]

                def call(chosen=chosen):
                    if chosen is None:
                        return attention(q, k, v, mask, groups)
                    with sdpa_kernel([chosen]):
                        return attention(q, k, v, mask, groups)

                try:
                    out = call()
                    err = (out.float() - reference).abs().max().item()
                    if err > (5e-2 if cuda else 1e-4):
                        raise RuntimeError(f"differs from fp32 math by {err:.3g}")
                    results[(t, w, name)] = time_per_call(call, args.layers, args.repeats, cuda)
                except RuntimeError as e:  # a backend that refuses these inputs (or a wrong result)
                    results[(t, w, name)] = None
                    print(f"  {name} at {t} queries x {w} slots: {str(e).splitlines()[0][:140]}")

    print("\n| queries | width | " + " | ".join(f"{b} us" for b in backends) + " |")
    print("|---|---|" + "---|" * len(backends))
    for t in queries:
        for w in widths:
            cells = [results[(t, w, b)] for b in backends]
            print(f"| {t} | {w} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")

    print("\nper pass of all layers (us): the engine's way (auto, widest width) against the best measured")
    print("| queries | auto at widest | best | best backend, width |")
    print("|---|---|---|---|")
    for t in queries:
        base = results[(t, widths[-1], backends[0])]
        found = [(v, b, w) for (tq, w, b), v in results.items() if tq == t and v is not None]
        best = min(found)
        base_s = "-" if base is None else f"{base * args.layers:.1f}"
        print(f"| {t} | {base_s} | {best[0] * args.layers:.1f} | {best[1]}, {best[2]} |")


if __name__ == "__main__":
    main()
