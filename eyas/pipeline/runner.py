"""`eyas run`'s runner: it skips what is done, resumes what was interrupted, reruns what changed, and ends
every process it started.

Each stage command runs in its own process group (eyas/gpu/procs.py). RUN/stages.json keeps each stage's
fingerprint (eyas.pipeline.table) and config values, and a manifest of the output of every finished
stage, so a rerun of a finished run only reads the file system. With two or more GPUs, capture and
training run at once on disjoint halves, training tailing the store.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eyas import ownership
from eyas.common import EyasError, atomic_write_json, read_json, save_config, sha256_json
from eyas.config import RunConfig
from eyas.gpu import nvml, procs
from eyas.gpu.devices import default_pool
from eyas.layout import RunLayout
from eyas.pipeline.report import write_report
from eyas.pipeline.table import (STAGES, Cmd, Ctx, Stage, config_changes, config_values, fingerprint_parts, manifest,
                                 only_new_keys_at_default)

POLL_S = 0.1
SCHEMA_VERSION = 2  # of RUN/stages.json
# a tailing stage's record of the output it tails while that still grows (see Runner.decide)
GROWING = "growing"


@dataclass
class RunOptions:
    gpus: list[int] | None = None  # the device pool; None = CUDA_VISIBLE_DEVICES or every GPU NVML sees
    wait_for_gpus: float = 0.0  # seconds to wait for foreign processes to leave our GPUs (0 = refuse)
    overlap: bool = True  # capture and train at once when there are two or more GPUs
    stage_timeout: float = 0.0  # seconds per stage command, 0 = none
    grace_s: float = 10.0  # SIGTERM -> SIGKILL
    release_timeout_s: float = 120.0  # teardown -> GPU memory back near its baseline
    tolerance_mib: float = 256.0
    echo: bool = True  # copy stage output to the terminal


class StageFailed(EyasError):
    pass


@dataclass
class Job:
    stage: Stage
    cmds: list[Cmd]
    devices: list[int]
    t0: float = field(default_factory=time.monotonic)
    proc: procs.StageProcess | None = None
    deadline: float = math.inf
    baseline: dict[int, float] = field(default_factory=dict)
    log_pos: int = 0


def read_state(path: Path) -> dict:
    """The stage records of RUN/stages.json ({} when there is none). A file of another schema is refused
    before anything in the run directory is touched."""
    try:
        doc = read_json(path)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        doc = None
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if version != SCHEMA_VERSION:
        raise EyasError(f"{path} has schema_version {version if version is not None else 'none'}, this eyas reads "
                        f"{SCHEMA_VERSION}: use a new --run-dir, or remove {path} to rerun every stage")
    return doc.get("stages", {})


def _engine_loads(path: Path) -> list[dict]:
    """RUN/stages.json's record of the engine's loads ([] without one)."""
    try:
        loads = read_json(path).get("engine_loads")
    except (OSError, ValueError, AttributeError):
        return []
    return [x for x in loads if isinstance(x, dict)] if isinstance(loads, list) else []


class Runner:
    def __init__(self, cfg: RunConfig, run: Path, opts: RunOptions, stages=STAGES, run_id: str | None = None):
        self.cfg, self.run, self.opts, self.stages = cfg, Path(run), opts, stages
        self.run_id = run_id  # of RUN's marker: recorded by the stage outputs the runner claims
        self.layout = RunLayout(self.run)
        self.state: dict = read_state(self.layout.stages)  # first: another schema is refused, nothing touched
        # every load of the target into the run's engine, by each `eyas run` in this directory (the report's)
        self.engine_loads: list[dict] = _engine_loads(self.layout.stages)
        self.pool = opts.gpus if opts.gpus is not None else default_pool()
        self.nvml = nvml.available()
        known = {g.index for g in nvml.gpus()} if self.nvml else set(self.pool)
        if set(self.pool) - known:
            raise EyasError(f"GPUs {sorted(set(self.pool) - known)} do not exist; NVML sees {sorted(known)}")
        self.records: list[dict] = []
        self.jobs: list[Job] = []
        self.summary: list[str] = []
        self.engine: procs.StageProcess | None = None  # the run's vLLM engine while it serves (target.backend=vllm)
        self.engine_load: dict | None = None  # its record in RUN/stages.json's "engine_loads"

    # -- bookkeeping files
    def _save_state(self) -> None:
        atomic_write_json(self.layout.stages, {"schema_version": SCHEMA_VERSION, "stages": self.state,
                                               "engine_loads": self.engine_loads})

    def _save_records(self) -> None:
        atomic_write_json(self.layout.processes,
                          {"runner": {"pid": os.getpid(), "start_ticks": procs.start_time(os.getpid())},
                           "stages": self.records})

    def _clean_orphans(self) -> None:
        try:
            old = read_json(self.layout.processes).get("stages", [])
        except (OSError, ValueError, AttributeError):
            old = []
        for rec in old:
            if not rec.get("ended"):
                notes, ended = procs.end_orphans(rec, self.opts.grace_s)
                for note in notes:
                    self.log(note)
                leak = nvml.wait_released(rec.get("devices", []), ended, None, 0.0, self.opts.release_timeout_s)
                if leak:
                    raise EyasError(f"orphans of an earlier runner were ended but still hold GPU memory:\n{leak}")
        self.records = []
        self._save_records()

    def log(self, msg: str) -> None:
        try:
            print(f"eyas run: {msg}", flush=True)
        except OSError:  # a closed terminal (EIO): a line lost must never stop a run or its teardown
            pass

    # -- decisions
    def decide(self, stage: Stage) -> tuple[str, str, dict[str, str]]:
        """('skip'|'resume'|'fresh', why, the stage's fingerprint). With the inputs of its record: skip a stage
        that is done with its output unchanged, else resume it on its output (or start it fresh without one).
        With other inputs: remove its output and start it fresh. run_wave records the fingerprint, so its
        inputs' manifests are walked once per decision, not again at the start."""
        rec = self.state.get(stage.name, {})
        out = self.run / stage.writes
        if os.path.lexists(out) and not ownership.owned(out, stage.kind):
            raise EyasError(f"{out} was not made by the {stage.name} stage of eyas run (it has no {ownership.MARKER} "
                            f"of that stage), so the run never adopts, replaces or removes it: move it out of "
                            f"{self.run}, or use another --run-dir")
        parts = fingerprint_parts(stage, self.cfg, self.run)
        old = self._recorded_parts(stage, rec, parts)
        if old == parts:
            action, why = self._same_inputs(rec, out)
        elif old and out.exists():
            action, why = "fresh", self._remove_stale(stage, rec, old, parts, out)
        elif out.exists():
            action, why = "resume", "output present without a record: resuming"
        else:
            action, why = "fresh", "first run"
        return action, why, parts

    def _recorded_parts(self, stage: Stage, rec: dict, parts: dict[str, str]) -> dict[str, str]:
        """The fingerprint a stage's record holds, as it compares with `parts`. A stage that tailed an output
        recorded it as GROWING, not as the manifest it saw then: the output grew under it by design. While the
        same output is written (its stage resumes), GROWING matches it. Its stage's end turns GROWING into the
        final manifest, a fresh start of it (output removed) into a mark that never matches (_tailers_saw): a
        store rewritten with other settings still reruns train. A config recorded by an eyas that lacked some
        keys matches while those keys keep their defaults."""
        old = dict(rec.get("parts") or {})
        tailed = next((s.writes for s in self.stages if s.name == stage.tails), None)
        if old.get(tailed) == GROWING:
            old[tailed] = parts[tailed]
        if old.get("config") not in (None, parts["config"]) and only_new_keys_at_default(
                stage, self.cfg, rec.get("config_values"), old["config"]):
            old["config"] = parts["config"]  # recorded by an eyas without some keys, which are at their defaults
        return old

    @staticmethod
    def _same_inputs(rec: dict, out: Path) -> tuple[str, str]:
        if rec.get("status") == "done" and rec.get("outputs") == sha256_json(manifest(out)):
            return "skip", "done, inputs unchanged"
        if out.exists():
            return "resume", f"resuming after '{rec.get('status', 'unfinished')}'"
        return "fresh", "output missing"

    def _remove_stale(self, stage: Stage, rec: dict, old: dict, parts: dict, out: Path) -> str:
        """Remove the output of a stage whose inputs changed; -> why, naming the changed inputs and config keys."""
        changed = [k for k in parts if old.get(k) != parts[k]]
        if "config" in changed:
            keys = config_changes(stage, self.cfg, rec.get("config_values", {}))
            changed[changed.index("config")] = f"config: {', '.join(keys)}" if keys else "config"
        with ownership.exclusive(ownership.lock_file(out), str(out), fix="wait for it to finish, then rerun"):
            shutil.rmtree(out)
        return f"inputs changed ({', '.join(changed)}): old output removed"

    def devices_for(self, stage: Stage, share: int = 0, of: int = 1) -> list[int]:
        need = stage.gpus(self.cfg) if callable(stage.gpus) else stage.gpus
        if need == "none" or not self.pool:
            return []
        if need == "one":
            return self.pool[:1]
        if of == 1:
            return list(self.pool)
        cut = math.ceil(len(self.pool) / 2)
        return self.pool[:cut] if share == 0 else self.pool[cut:]

    # -- the run
    def execute(self) -> None:
        self.run.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.layout.config)
        self._clean_orphans()
        active = [s for s in self.stages if s.when(self.cfg)]
        # with the engine holding the target on the GPUs, training waits for capture instead of sharing them
        overlap = self.opts.overlap and self.cfg.target.backend != "vllm"
        i = 0
        try:
            while i < len(active):
                stage = active[i]
                action, why, parts = self.decide(stage)
                if action == "fresh":
                    self._tailers_saw(stage, "replaced")
                self.log(f"{stage.name}: {'skipped' if action == 'skip' else 'running'} ({why})")
                if action == "skip":
                    i += 1
                    continue
                wave = [(stage, action, parts)]
                partner = active[i + 1] if i + 1 < len(active) else None
                if partner and partner.tails == stage.name and overlap and len(self.pool) >= 2:
                    p_action, p_why, p_parts = self.decide(partner)
                    self.log(f"{partner.name}: running alongside {stage.name}, tailing its output ({p_why})")
                    wave.append((partner, p_action, p_parts))
                if any(self._uses_engine(s) for s, _, _ in wave):
                    self._start_engine()
                elif self.engine is not None:  # no later stage needs the target: its GPUs go to training
                    self._stop_engine()
                self.run_wave(wave)
                i += len(wave)
        finally:
            self._stop_engine()

    def run_wave(self, wave: list[tuple[Stage, str, dict[str, str]]]) -> None:
        self.jobs = []
        for n, (stage, action, parts) in enumerate(wave):
            devices = self.devices_for(stage, n, len(wave))
            ctx = Ctx(self.cfg, self.run, len(devices), action == "resume", tail=n > 0)
            cmds = [c for c in stage.commands(ctx) if not (action == "resume" and c.out and Path(c.out).exists())]
            if self.engine is not None and self._uses_engine(stage):
                cmds = [Cmd([*c.argv, "--engine-socket", str(self.engine_socket())], c.out) for c in cmds]
                self.engine_load["served"].append(stage.name)
            ownership.claim(self.run / stage.writes, stage.kind, self.run_id)
            rec = self.state.setdefault(stage.name, {})
            if n > 0:  # tailing wave[0]'s output, which grows meanwhile
                parts = {**parts, wave[0][0].writes: GROWING}
            rec.update(status="running", parts=parts, config_values=config_values(stage, self.cfg), devices=devices,
                       started_at=time.time(), log=str(self.layout.log(stage.name)))
            rec["attempts"] = rec.get("attempts", 0) + 1
            self.jobs.append(Job(stage, cmds, devices))
        self._save_state()
        try:
            for job in self.jobs:
                self._next_command(job)
            while any(job.proc for job in self.jobs):
                for job in self.jobs:
                    self._echo(job)
                    if job.proc and job.proc.exited():
                        self._end_command(job, "exit")
                    elif job.proc and time.monotonic() > job.deadline:
                        self._end_command(job, "timeout")
                time.sleep(POLL_S)
        except BaseException as e:
            status = "interrupted" if isinstance(e, (KeyboardInterrupt, procs.Terminated)) else "failed"
            self._teardown_all(status, e)
            raise

    def _next_command(self, job: Job) -> None:
        if not job.cmds:
            self._finish(job)
            return
        cmd = job.cmds.pop(0)
        self._check_gpus(job)
        job.baseline = nvml.used_mib(job.devices) if self.nvml else {}
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.pool:
            env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, job.devices)), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        log = self.layout.log(job.stage.name)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd.argv)}\n")
        job.log_pos = log.stat().st_size
        with procs.signals_deferred():  # a Ctrl-C now must not leave a started process unrecorded
            job.proc = procs.launch(job.stage.name, cmd.argv, env, log, job.devices)
            self.records.append(job.proc.record())
            self._save_records()
        timeout = job.stage.timeout_s or self.opts.stage_timeout
        job.deadline = time.monotonic() + timeout if timeout else math.inf

    # -- the run's engine: the target loaded once for the stages that need it
    def _uses_engine(self, stage: Stage) -> bool:
        if self.cfg.target.backend != "vllm":
            return False
        return stage.name == "capture" or (stage.name == "prepare" and self.cfg.data.regenerate == "local")

    def engine_socket(self) -> Path:
        """RUN/.engine.sock, or where a run directory's path is too long for a Unix socket (about 107 bytes), a
        socket in a private directory of the system's temporary directory."""
        sock = self.layout.engine_socket.absolute()
        if len(str(sock)) <= 100:
            return sock
        if getattr(self, "_short_socket", None) is None:
            import tempfile

            self._short_socket = Path(tempfile.mkdtemp(prefix="eyas-engine-")) / "engine.sock"
        return self._short_socket

    def _start_engine(self) -> None:
        """Start `eyas engine` in its own process group (recorded like a stage: a later runner ends an orphan)
        and wait until it serves; the load's figures go to RUN/stages.json for the report."""
        if self.engine is not None:
            return
        sock, log = self.engine_socket(), self.layout.log("engine")
        argv = [sys.executable, "-m", "eyas", "engine", "--config", str(self.layout.config), "--socket", str(sock)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.pool:
            env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, self.pool)), CUDA_DEVICE_ORDER="PCI_BUS_ID")
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n")
        job = Job(Stage("engine", (), "", (), "all", lambda ctx: []), [], list(self.pool))
        job.log_pos = log.stat().st_size
        self.log(f"engine: loading the target into vLLM once for the stages that need it (log: {log})")
        with procs.signals_deferred():
            self.engine = job.proc = procs.launch("engine", argv, env, log, list(self.pool))
            self.records.append(self.engine.record())
            self._save_records()
        t0 = time.monotonic()
        self.engine_load = {"started_at": time.time(), "ready_s": None, "engine_start_s": None, "served": []}
        self.engine_loads.append(self.engine_load)
        deadline = t0 + (self.opts.stage_timeout or math.inf)
        while not sock.exists():
            self._echo(job)
            if self.engine.exited() or time.monotonic() > deadline:
                self._echo(job)
                why = "timed out" if not self.engine.exited() else "exited before it served"
                self._stop_engine()
                raise StageFailed(f"the vLLM engine {why}; log: {log}" + _log_tail(log))
            time.sleep(POLL_S)
        self._echo(job)
        # the engine writes SOCKET.json (eyas.target.vllm.service) before it serves: the runner reads it, it never
        # talks to the engine (the stage commands do)
        info = read_json(Path(f"{sock}.json"))
        self.engine_load.update(ready_s=round(time.monotonic() - t0, 3), engine_start_s=round(info["start_s"], 3))
        self._save_state()
        self.log(f"engine: serving on {sock} after {self.engine_load['ready_s']:.1f} s (vLLM's start "
                 f"{self.engine_load['engine_start_s']:.1f} s)")

    def _stop_engine(self) -> None:
        """End the engine's process group (SIGTERM, then SIGKILL after the grace) and wait for its GPU memory."""
        proc, self.engine = self.engine, None
        if proc is None:
            return
        with procs.signals_deferred():
            result = procs.teardown(proc, self.opts.grace_s)
            if not result.left:
                self._mark_ended(proc)
        if result.killed or result.left:
            self.log(result.message())
        self.engine_load["stopped_at"] = time.time()
        self._save_state()
        short = getattr(self, "_short_socket", None)
        if short is not None:  # the private directory made for the socket: the engine removed what it held
            import shutil

            shutil.rmtree(short.parent, ignore_errors=True)
            self._short_socket = None
        leak = nvml.wait_released(proc.devices, proc.seen, None, 0.0, self.opts.release_timeout_s) if self.nvml else None
        if leak:
            raise EyasError(f"the vLLM engine was ended but its GPU memory was not released:\n{leak}")
        self.log("engine: stopped")

    def _check_gpus(self, job: Job) -> None:
        if not job.devices or not self.nvml:
            return
        ours = {os.getpid()} | {p for j in self.jobs if j.proc for p in j.proc.seen | {j.proc.pid}}
        if self.engine is not None:
            self.engine.seen.update(procs.members(self.engine.pid, self.engine.start, self.engine.token))
            ours |= self.engine.seen
        foreign = [h for h in nvml.holders(job.devices) if h.pid not in ours]
        if foreign and self.opts.wait_for_gpus > 0:
            self.log(f"{job.stage.name}: waiting up to {self.opts.wait_for_gpus:.0f} s for other processes "
                     f"to leave GPUs {job.devices}:\n{nvml.format_holders(foreign)}")
            foreign = nvml.wait_for_free(job.devices, ours, self.opts.wait_for_gpus)
        if foreign:
            raise EyasError(f"{job.stage.name}: GPUs {job.devices} hold memory of processes eyas did not start "
                            f"(they are never touched); free them or pass --wait-for-gpus SECONDS:\n"
                            f"{nvml.format_holders(foreign)}")

    def _end_command(self, job: Job, why: str) -> None:
        proc = job.proc
        with procs.signals_deferred():  # a Ctrl-C waits until the group is ended and that is recorded
            result = procs.teardown(proc, self.opts.grace_s)
            if not result.left:  # a process still alive keeps its record open: the next runner ends it
                self._mark_ended(proc)
            job.proc = None
        self._echo(job, proc)
        if result.killed or result.left:
            self.log(result.message())
        leak = nvml.wait_released(job.devices, proc.seen, job.baseline, self.opts.tolerance_mib,
                                  self.opts.release_timeout_s)
        if why == "timeout" or result.returncode != 0 or leak:
            status = "timeout" if why == "timeout" else "failed"
            self.state[job.stage.name].update(status=status, returncode=result.returncode, ended_at=time.time())
            self._teardown_all(status, None)
            detail = (f"timed out after {job.stage.timeout_s or self.opts.stage_timeout:.0f} s" if why == "timeout"
                      else f"exited with code {result.returncode}")
            raise StageFailed(f"{job.stage.name} {detail}; log: {proc.log}" + (f"\n{leak}" if leak else "")
                              + _log_tail(proc.log))
        self._next_command(job)

    def _finish(self, job: Job) -> None:
        rec = self.state[job.stage.name]
        out = self.run / job.stage.writes
        if not manifest(out):  # recorded done, its missing output would match forever: never run again
            rec.update(status="failed", returncode=0, ended_at=time.time())
            self._teardown_all("failed", None)
            raise StageFailed(f"{job.stage.name} exited with code 0 but did not write {out}; check its log "
                              f"{rec['log']} and rerun" + _log_tail(Path(rec["log"])))
        wall = time.monotonic() - job.t0
        # the inputs as they were when the stage started: one edited while it ran was not what it used, so the
        # next run must see it changed; only an input it tailed (still GROWING) is taken as it is now, final
        parts = dict(rec["parts"])
        growing = [k for k, v in parts.items() if v == GROWING]
        if growing:
            now = fingerprint_parts(job.stage, self.cfg, self.run)
            parts.update({k: now[k] for k in growing})
        rec.update(status="done", returncode=0, ended_at=time.time(), wall_s=round(wall, 3),
                   total_s=round(rec.get("total_s", 0.0) + wall, 3), parts=parts,
                   outputs=sha256_json(manifest(out)))
        self._tailers_saw(job.stage, rec["outputs"])
        self._save_state()
        self.log(f"{job.stage.name}: done in {wall:.1f} s")

    def _tailers_saw(self, stage: Stage, value: str) -> None:
        """Records of stages that tailed `stage`'s output while it grew now hold `value` for it instead."""
        for s in self.stages:
            parts = self.state.get(s.name, {}).get("parts") or {}
            if s.tails == stage.name and parts.get(stage.writes) == GROWING:
                parts[stage.writes] = value

    def _mark_ended(self, proc: procs.StageProcess) -> None:
        for rec in self.records:
            if rec["pid"] == proc.pid and rec["token"] == proc.token:
                rec.update(ended=True, returncode=proc.returncode)
        self._save_records()

    def _teardown_all(self, status: str, exc: BaseException | None) -> None:
        """End every live stage, then say so (a closed terminal fails the lines, never the ending); further
        Ctrl-C/SIGTERM are ignored until that is done."""
        with procs.signals_ignored():
            for job in self.jobs:
                if job.proc is None:
                    continue
                proc, job.proc = job.proc, None
                result = procs.teardown(proc, self.opts.grace_s)
                if not result.left:  # a process still alive keeps its record open: the next runner ends it
                    self._mark_ended(proc)
                if exc is not None:
                    self.log(f"{job.stage.name}: {status} ({exc or type(exc).__name__}); its process group ended")
                self.log(result.message())
                leak = nvml.wait_released(job.devices, proc.seen, job.baseline, self.opts.tolerance_mib,
                                          self.opts.release_timeout_s)
                if leak:
                    self.log(leak)
                rec = self.state[job.stage.name]
                if rec.get("status") == "running":
                    rec.update(status=status, returncode=result.returncode, ended_at=time.time())
            self._save_state()

    def _echo(self, job: Job, proc: procs.StageProcess | None = None) -> None:
        """Copy what the stage wrote to its log since the last call to the terminal."""
        proc = proc or job.proc
        if not (self.opts.echo and proc):
            return
        try:
            with open(proc.log, "rb") as f:
                f.seek(job.log_pos)
                data = f.read()
        except OSError:
            return
        job.log_pos += len(data)
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        except OSError:  # a closed terminal: the log file has it all
            pass


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n--- last lines of the log ---\n" + "\n".join(tail)


def check_inputs_outside(cfg: RunConfig, run: Path, stages=STAGES) -> None:
    """Inputs must not lie where the stages write: a stage replaces its output when its inputs change, so a
    data file in RUN/prepared would be removed before prepare read it. A draft to fine-tune must not lie in
    the run directory at all (setting train.init_from changes the train stage's inputs: RUN/train would go
    before training read it, an export in RUN/export after)."""
    root = run.expanduser().resolve()
    if cfg.train.init_from and Path(cfg.train.init_from).expanduser().resolve().is_relative_to(root):
        raise EyasError(f"train.init_from={cfg.train.init_from!r} lies in the run directory {run}, whose stages "
                        f"replace their outputs: copy the draft elsewhere first (or export it: `eyas export "
                        f"{RunLayout(run).train} --to speculators --out DIR`), or use another --run-dir")
    outputs = [root / s.writes for s in stages]
    for name in cfg.data.data:
        path = Path(name).expanduser()
        if not path.exists():  # a hub dataset name
            continue
        path = path.resolve()
        inside = [o for o in outputs if path.is_relative_to(o)]
        if inside:
            raise EyasError(f"data.data file {name} lies in {inside[0]}, which the run replaces when its inputs "
                            f"change: move it out of {run}'s stage directories")


def run_pipeline(cfg: RunConfig, run: Path, opts: RunOptions | None = None, stages=STAGES) -> Runner:
    """Run the stage table in `run`; raises StageFailed/EyasError, KeyboardInterrupt or procs.Terminated.
    `run` must be absent, empty or a run directory eyas made (its marker, eyas.ownership); nothing else is
    touched."""
    layout = RunLayout(ownership.check_output_path(run, "run directory (--run-dir)"))
    check_inputs_outside(cfg, layout.run, stages)
    ownership.check_claimable(layout.run, "run", fix="use another --run-dir")
    fix = "another `eyas run` works there; wait for it or use another --run-dir"
    with ownership.exclusive(layout.lock, f"the run directory {run}", fix), procs.signals_raise():
        run_id = ownership.claim(layout.run, "run")["run_id"]
        runner = Runner(cfg, layout.run, opts or RunOptions(), stages, run_id)
        try:
            runner.execute()
        finally:
            runner.summary = write_report(layout.run, cfg, runner.state, stages, runner.engine_loads)
    return runner
