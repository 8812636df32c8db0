"""Fake stage tables for the pipeline tests, and a runner entry point (`python pipeline_fakes.py SPEC.json`).

A spec is JSON: {"run": DIR, "preset": "tiny", "set": [...], "opts": {RunOptions fields},
"stages": [{"name", "reads", "writes", "config", "gpus", "tails", "timeout_s", "args": [...]}]}.
Each fake stage runs fake_stage.py with `--out RUN/<writes>` plus its args (and --resume/--tail as the
runner decides), so the runner under test is the real one and only the stage commands are stand-ins.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAKE = str(HERE / "fake_stage.py")
sys.path.insert(0, str(HERE.parents[1]))  # the repository, for a runner started from anywhere

from eyas.pipeline import Cmd, RunOptions, Stage  # noqa: E402


def fake_stage(name, writes, args=(), reads=(), config=(), gpus="none", tails=None, timeout_s=0.0):
    def commands(ctx):
        argv = [sys.executable, FAKE, "--name", name, "--out", str(ctx.run / writes), *args]
        argv += ["--resume"] * ctx.resume + ["--tail"] * ctx.tail
        return [Cmd(argv)]

    return Stage(name, tuple(reads), writes, tuple(config), gpus, commands, tails=tails, timeout_s=timeout_s)


def stages_from_spec(spec):
    return tuple(fake_stage(**s) for s in spec["stages"])


def main(path):
    from eyas.common import EyasError
    from eyas.config import load_config
    from eyas.gpu.procs import Terminated
    from eyas.pipeline import run_pipeline

    spec = json.loads(Path(path).read_text())
    cfg = load_config(spec.get("preset", "tiny"), spec.get("set", []))
    try:
        run_pipeline(cfg, Path(spec["run"]), RunOptions(**spec.get("opts", {})), stages_from_spec(spec))
    except Terminated as e:
        return 128 + e.signum
    except KeyboardInterrupt:
        return 130
    except EyasError as e:
        print(f"runner: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
