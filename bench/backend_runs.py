"""The whole pipeline through each target backend, side by side: `eyas run --preset demo` (or another preset)
once with target.backend=hf and once with vllm, each in its own run directory, then one table: regeneration and
capture rates, the target's loads, the training loss and each eval result's tau. Drafts trained on a vLLM-written
store and on a transformers-written one should reach the same tau within noise.

    python bench/backend_runs.py                          # demo preset, SmolLM2 on CPU (about 25 minutes on 2 cores)
    python bench/backend_runs.py --preset tiny --set target.model=smollm2 --set data.num_prompts=12
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--backends", default="hf,vllm")
    p.add_argument("--engine", default='{"max_model_len": 1024}', help="target.engine for vLLM (JSON)")
    p.add_argument("--workdir", default=None, help="where the run directories go (default: a temporary directory)")
    return p.parse_args()


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_one(args, backend: str, run: Path) -> dict:
    cmd = [sys.executable, "-m", "eyas", "run", "--preset", args.preset, "--backend", backend, "--run-dir", str(run),
           "--quiet", "--set", f"target.engine={args.engine}"]
    for s in args.set:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{backend}: eyas run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    stages = _read(run / "stages.json")
    prep, store = _read(run / "prepared" / "summary.json"), _read(run / "store" / "summary.json")
    metrics = (run / "train" / "metrics.jsonl").read_text().splitlines()
    last = json.loads(metrics[-1]) if metrics else {}
    taus = {p.stem: (_read(p).get("summary") or {}).get("tau_pooled") for p in sorted((run / "eval").glob("*.json"))
            if p.name != "summary.json" and not p.name.startswith(".")}
    loads = stages.get("engine_loads") or []
    return {"backend": backend, "wall_s": wall, "regen_tok_s": prep.get("regen_tokens_per_s"),
            "capture_tok_s": store.get("tokens_per_s"), "loss": last.get("loss"), "taus": taus,
            "engine_loads": [(x.get("served"), x.get("ready_s")) for x in loads]}


def main() -> None:
    args = parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="eyas-bench-backend-runs-"))
    rows = [run_one(args, b, work / f"run-{b}") for b in args.backends.split(",")]
    names = sorted({k for r in rows for k in r["taus"]})
    print(f"\n{args.preset} preset {' '.join(args.set)} (run directories under {work})")
    print(f"{'backend':8} {'wall s':>7} {'regen tok/s':>12} {'capture tok/s':>14} {'loss':>7} "
          + " ".join(f"{n:>24}" for n in names) + "  engine loads (stages, s)")
    for r in rows:
        taus = " ".join(f"{r['taus'].get(n) or float('nan'):>24.3f}" for n in names)
        print(f"{r['backend']:8} {r['wall_s']:>7.0f} {r['regen_tok_s'] or 0:>12.1f} {r['capture_tok_s'] or 0:>14.0f} "
              f"{r['loss'] or float('nan'):>7.3f} {taus}  {r['engine_loads'] or '-'}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
