"""Time loading the default target: the first load (GGUF -> cached HF dir) and later loads.

Each measurement is a fresh Python process, as a user's command would be. Prints a table last.
    python bench/load_target.py [--cold] [--repeats 3]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROBE = r"""
import json, time
t0 = time.perf_counter()
import torch, transformers  # noqa: F401
t1 = time.perf_counter()
# transformers imports its Auto classes and the Llama modeling code lazily, on first use: time it apart
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401
from eyas.target import load_target
t2 = time.perf_counter()
t = load_target("smollm2", device="cpu", dtype="fp32")
t3 = time.perf_counter()
print("RESULT", json.dumps({"import_s": t1 - t0, "lazy_import_s": t2 - t1, "load_s": t3 - t2}))
"""


def measure(env) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))
    return {**json.loads(line.split(" ", 1)[1]), "process_s": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true", help="also time a first load into an empty cache")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    env = dict(os.environ)
    if args.cold:
        with tempfile.TemporaryDirectory() as cache:
            cold_env = {**env, "EYAS_CACHE": cache}
            rows.append(("first load (convert GGUF)", measure(cold_env)))
            rows.append(("second load", measure(cold_env)))
    for i in range(args.repeats):
        rows.append((f"warm load {i + 1}", measure(env)))
    print(f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'run':28s} {'import torch+tf (s)':>20s} {'lazy imports (s)':>17s} {'load_target (s)':>16s} "
          f"{'whole process (s)':>18s}")
    for name, r in rows:
        print(f"{name:28s} {r['import_s']:20.2f} {r['lazy_import_s']:17.2f} {r['load_s']:16.2f} {r['process_s']:18.2f}")


if __name__ == "__main__":
    main()
