"""Where a speculative cycle's time goes on the GPU: each CUDA graph of a chain or tree cycle timed alone.

    python bench/cycle_phases.py --draft RUN/train [--steps 3,5,7] [--trees "4,4,12;8,6,40"] [--prompts 4]

The engine's graphed path queues a whole cycle (graphs `chain` or `tree`, `verify`, `rebuild`; eyas/speculative/graphs.py)
ahead of the host, so an end-to-end run cannot say which phase costs what. Here, after decoding each
prompt normally (which captures the graphs and fills both caches), every graph is replayed alone
--repeats times between CUDA events, with the committed length reset before each replay, so the
phases run at the cache length the decoding reached. The plain-decoding step graph is timed the same
way. The last table gives each phase in milliseconds and in plain steps, their sum, and the cycle
time the real decoding measured (total time / cycles): the difference is what the phases alone do
not explain (host work, launch gaps, reads).

SmolLM2 in bf16 on CUDA. `--cpu` runs the same passes eagerly in fp32 (a check of the script, not a
measurement).

Each pass is captured once per attended width (eyas/speculative/graphs.py); the phases are timed at the width the
decoding used at its end and, in the column beside, at the decoder's whole capacity (what every pass
attended over before widths existed). `--width-step` sets the engine's width step (default the engine's),
e.g. to the capacity (1024) to run the whole comparison, end to end included, as it was.

`--profile` then runs the plain step and the first setting's verify pass eagerly under torch.profiler
(the same kernels a graph replays, without the launch gaps) and prints, per operator, the kernel time of
one pass of each side by side: what makes a verify pass dearer than a plain step.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch

from eyas.speculative.build import build_engine
from eyas.speculative import graphs
from eyas.speculative.engine import SpecEngine
from eyas.data.benchmarks import mtbench_questions
from eyas.speculative.bench import encode_turn, settings_of
from eyas.target import load_target


def timed(step, reset, repeats: int, cuda: bool) -> float:
    """Median milliseconds of one replay of `step` (GPU time between events on CUDA), `reset` run (untimed)
    before each."""
    times = []
    for _ in range(repeats):
        reset()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def kernel_times(fn, reset, calls: int, cuda: bool) -> dict[str, float]:
    """Microseconds of kernel time per call of `fn` by operator (CPU time on a CPU), `reset` before each call
    (its own few kernels are counted too)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        reset()
        fn()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            reset()
            fn()
        if cuda:
            torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type != DeviceType.CPU or not e.key.startswith("aten::"):
            continue
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            out[e.key] = us / calls
    return out


def print_profile(plain: dict[str, float], verify: dict[str, float], name: str, rows: int = 16) -> None:
    print(f"\nkernel time per pass by operator (eager, {'GPU' if torch.cuda.is_available() else 'CPU'} microseconds): "
          f"plain step against {name} verify")
    print(f"| operator | plain step | {name} verify | difference |")
    print("|---|---|---|---|")
    keys = sorted(set(plain) | set(verify), key=lambda k: -(verify.get(k, 0) - plain.get(k, 0)))
    for k in keys[:rows]:
        a, b = plain.get(k, 0.0), verify.get(k, 0.0)
        print(f"| {k} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    a, b = sum(plain.values()), sum(verify.values())
    print(f"| all operators | {a:.1f} | {b:.1f} | {b - a:+.1f} ({b / a:.2f}x) |")


def print_operators(times: dict[str, float], name: str, rows: int = 16) -> None:
    """The operators that take most of one pass's kernel time."""
    total = sum(times.values())
    print(f"\nkernel time of the {name} pass by operator (eager, {'GPU' if torch.cuda.is_available() else 'CPU'} "
          f"microseconds; {total:.1f} in all)")
    print("| operator | us per pass | share |")
    print("|---|---|---|")
    for k in sorted(times, key=lambda k: -times[k])[:rows]:
        print(f"| {k} | {times[k]:.1f} | {100 * times[k] / total:.1f} % |")


def measure(engine, prompts: list, eos: set, args, cuda: bool) -> tuple[list, dict]:
    """(table rows, kernel profiles) of the plain step and every setting's phases, decoding `prompts` first."""
    rows = []
    plain_ms, plain_full, plain_cycle = [], [], []
    profiles = {}
    for ids in prompts:
        res = engine.plain_generate(ids, args.new_tokens, eos_token_ids=eos)
        plain_cycle.append(1000 * res.total_s / max(1, len(res.tokens)))
        dec = engine._decoder
        n0 = int(dec.n)
        b = dec._plain_buffers()

        def reset(n0=n0):
            dec.n.fill_(n0 - 1)

        step = dec._at(b, n0)["step"]  # the width the step writing slot n0 - 1 uses
        plain_ms.append(timed(step, reset, args.repeats, cuda))
        plain_full.append(timed(dec._at(b, dec.capacity)["step"], reset, args.repeats, cuda))
        if args.profile and "plain" not in profiles:
            dec._at(b, n0)  # eager passes read the width when they run
            profiles["plain"] = kernel_times(step.fn, reset, 10, cuda)
    plain = statistics.median(plain_ms)
    rows.append(("plain step", plain, 1.0, statistics.median(plain_full), statistics.median(plain_cycle), None))
    settings = settings_of([int(k) for k in args.steps.split(",") if k.strip()], None)  # eval's names
    settings += [s for t in args.trees.split(";") if t.strip() for s in settings_of([], t.strip())]
    for name, setting in settings:
        draft_phase = "chain" if "steps" in setting else "tree"
        per = {draft_phase: [], "verify": [], "rebuild": [], "cycle": [], "tau": []}
        full = {draft_phase: [], "verify": [], "rebuild": []}
        for ids in prompts:
            res = engine.generate(ids, args.new_tokens, eos_token_ids=eos, **setting)
            per["cycle"].append(1000 * res.total_s / max(1, res.num_cycles))
            per["tau"].append(res.tau)
            dec = engine._decoder
            if "steps" in setting:
                b, room = dec._chain_buffers(setting["steps"]), setting["steps"] + 1
            else:
                topk, depth, total = setting["tree"]
                b, room = dec._tree_buffers(*setting["tree"]), max(total + 1, (depth - 1) * topk, depth + 1)
            n0 = int(dec.n)

            def reset(n0=n0, room=room):
                dec.n.fill_(max(1, n0 - room))  # the phases write inside the slots that decoding used
                dec.a.zero_()

            engine.runner.attach()  # the verify pass reads the aux layers through hooks (eager) or its graph
            try:
                for phase in (draft_phase, "verify", "rebuild"):
                    full[phase].append(timed(dec._at(b, dec.capacity)[phase], reset, args.repeats, cuda))
                    per[phase].append(timed(dec._at(b, max(1, n0 - room) + room)[phase], reset, args.repeats, cuda))
                if args.profile and "verify" not in profiles:
                    passes = dec._at(b, max(1, n0 - room) + room)
                    profiles["verify"] = (name, kernel_times(passes["verify"].fn, reset, 10, cuda))
                    profiles["draft"] = (f"{name} {draft_phase}", kernel_times(passes[draft_phase].fn, reset, 10, cuda))
            finally:
                engine.runner.detach()
        med = {key: statistics.median(v) for key, v in per.items()}
        med_full = {key: statistics.median(v) for key, v in full.items()}
        for phase in (draft_phase, "verify", "rebuild"):
            rows.append((f"{name} {phase}", med[phase], med[phase] / plain, med_full[phase], None, None))
        total = med[draft_phase] + med["verify"] + med["rebuild"]
        total_full = sum(med_full.values())
        rows.append((f"{name} phases summed", total, total / plain, total_full, med["cycle"], med["tau"]))
    return rows, profiles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, help="a training run dir, step dir or export dir")
    p.add_argument("--steps", default="3,5,7", help="chain lengths ('' for none)")
    p.add_argument("--trees", default="", help="tree shapes TOPK,DEPTH,TOTAL separated by ';', e.g. '4,4,12;8,6,40'")
    p.add_argument("--prompts", type=int, default=4, help="MT-bench first turns to decode")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--cpu", action="store_true", help="eager fp32 on the CPU: checks the script only")
    p.add_argument("--width-step", type=int, default=None,
                   help="attended widths in steps of this many cache slots (default: eyas.speculative.graphs.WIDTH_STEP)")
    p.add_argument("--profile", action="store_true",
                   help="also profile the plain step, the first setting's verify pass and its draft pass by operator")
    p.add_argument("--compile-draft", metavar="BACKEND", default=None,
                   help="then everything again with the draft's passes compiled by this torch.compile backend "
                        "(inductor; SpecEngine's compile_draft, eyas eval --compile-draft), side by side")
    args = p.parse_args()
    cuda = not args.cpu
    if args.width_step:
        graphs.WIDTH_STEP = args.width_step
    if cuda and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (the phases are CUDA graphs); --cpu checks the script")
    target = load_target("smollm2", device="cuda" if cuda else "cpu", dtype="bf16" if cuda else "fp32")
    engine, _ = build_engine(target, args.draft, cuda_graphs=True)
    if not cuda:  # the static path, eagerly
        engine = SpecEngine(target.model, engine.draft, engine.runner.aux_layers, sync_timing=False, static=True)
    tok = target.tokenizer
    eos = {tok.eos_token_id}
    prompts = [encode_turn(tok, [{"role": "user", "content": q["turns"][0]}])
               for q in mtbench_questions()[:args.prompts]]
    arms = [("draft as it is", engine)]
    if args.compile_draft:
        arms.append((f"draft compiled ({args.compile_draft})",
                     SpecEngine(target.model, engine.draft, engine.runner.aux_layers, sync_timing=False, static=True,
                                compile_draft=args.compile_draft)))
    tables, failed = [], []
    for label, arm in arms:
        t0 = time.perf_counter()
        try:
            rows, profiles = measure(arm, prompts, eos, args, cuda)
        except Exception:  # a failing arm (a compiler error, say) must not lose the tables measured before it
            if label == arms[0][0]:
                raise
            traceback.print_exc()
            failed.append(f"{label}: failed after {time.perf_counter() - t0:.0f} s ({traceback.format_exc(limit=0).strip()})")
            continue
        tables.append((label, rows, profiles, time.perf_counter() - t0, arm._decoder.capacity))
    where = f"bf16, CUDA graphs, {torch.cuda.get_device_name()}" if cuda else "fp32, eager on the CPU"
    for line in failed:
        print(f"\n{line[:600]}")
    for label, rows, profiles, seconds, capacity in tables:
        print(f"\nSmolLM2 {where}; {label} ({seconds:.0f} s, graph captures included); {len(prompts)} MT-bench first "
              f"turns, {args.new_tokens} new tokens; medians of {args.repeats} replays per phase; width step "
              f"{graphs.WIDTH_STEP}, capacity {capacity}")
        print("| graph | GPU ms | plain steps | GPU ms at the whole capacity | measured ms per step/cycle (end to end) "
              "| tau |")
        print("|---|---|---|---|---|---|")
        for name, ms, ratio, ms_full, measured, tau in rows:
            print(f"| {name} | {ms:.3f} | {ratio:.2f} | {ms_full:.3f} | {'' if measured is None else f'{measured:.3f}'} "
                  f"| {'' if tau is None else f'{tau:.2f}'} |")
        if "verify" in profiles:
            print_profile(profiles["plain"], profiles["verify"][1], profiles["verify"][0])
            print_operators(profiles["draft"][1], profiles["draft"][0])
    if failed:
        raise SystemExit(1)

if __name__ == "__main__":
    main()
