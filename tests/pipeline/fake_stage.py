"""A stand-in for a stage command, for the pipeline tests: no eyas, no torch, starts in milliseconds.

It appends one JSON line about itself to --record, can spawn children and grandchildren (some ignore
SIGTERM, one starts a session of its own) and list their pids in --pids, then writes --out, fails, or
hangs as --mode says (silent: exit 0 having written nothing).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--name", required=True)
p.add_argument("--out", required=True)
p.add_argument("--mode", default="ok", choices=["ok", "fail", "hang", "silent"])
p.add_argument("--spawn", action="store_true")
p.add_argument("--pids", default=None)
p.add_argument("--record", default=None)
p.add_argument("--items", type=int, default=1)  # files written to --out, one per --delay
p.add_argument("--delay", type=float, default=0.0)
p.add_argument("--follow", default=None)  # a directory to wait on until it holds COMPLETE (a store tail)
p.add_argument("--fail-if", default=None)  # fail when this file exists (lets a test break one attempt)
p.add_argument("--fail-if-late", default=None)  # the same, checked after --follow: a tail that fails late
# the same, checked once --follow's directory holds its first item: a tail that fails while the stage it follows
# has started and still writes, however slowly either process started
p.add_argument("--fail-if-mid", default=None)
p.add_argument("--resume", action="store_true")
p.add_argument("--tail", action="store_true")
args = p.parse_args()
t_start = time.time()


def record(**extra):
    if args.record:
        with open(args.record, "a") as f:
            f.write(json.dumps({"name": args.name, "pid": os.getpid(), "resume": args.resume, "tail": args.tail,
                                "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "t_start": t_start, **extra}) + "\n")


record(result="started")
if args.mode == "silent":
    record(result="ok", t_end=time.time())
    sys.exit(0)
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)  # partial output, as a real stage leaves when it is interrupted

if args.spawn:
    pids = Path(args.pids)
    script = (f'sleep 1000 & echo "grandchild $!" >> {pids}; trap "" TERM; '
              f'sleep 1000 & echo "grandchild-ignoring-term $!" >> {pids}; wait')
    child = subprocess.Popen(["sh", "-c", script])  # the shell itself ignores SIGTERM after the trap
    plain = subprocess.Popen(["sleep", "1000"])
    escaped = subprocess.Popen(["sleep", "1000"], start_new_session=True)  # as torchrun starts its workers
    with open(pids, "a") as f:
        f.write(f"leader {os.getpid()}\nchild-shell {child.pid}\nchild-sleep {plain.pid}\n"
                f"child-own-session {escaped.pid}\n")
    while len(pids.read_text().splitlines()) < 6:  # until the shell has listed both grandchildren
        time.sleep(0.01)

if args.fail_if and Path(args.fail_if).exists():
    record(result="fail")
    sys.exit(3)
if args.mode == "fail":
    record(result="fail")
    sys.exit(3)
if args.mode == "hang":
    record(result="hang")
    time.sleep(1000)

if args.fail_if_mid:
    while not (Path(args.follow) / "item-0").exists():
        time.sleep(0.02)
    if Path(args.fail_if_mid).exists():
        record(result="fail")
        sys.exit(3)
if args.follow:
    while not (Path(args.follow) / "COMPLETE").exists():
        time.sleep(0.02)
if args.fail_if_late and Path(args.fail_if_late).exists():
    record(result="fail")
    sys.exit(3)
for i in range(args.items):
    time.sleep(args.delay)
    (out / f"item-{i}").write_text(f"{args.name} {i}\n")
(out / "COMPLETE").write_text("")
record(result="ok", t_end=time.time())
