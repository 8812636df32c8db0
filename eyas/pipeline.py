"""The stage table and `eyas run`: what each stage reads, writes and needs, and a runner that skips
what is done, resumes what was interrupted, reruns what changed, and ends every process it started.

Each stage is one or more `python -m eyas <command> --config RUN/config.yaml ...` subprocesses, each in
its own process group (eyas/gpu/procs.py). A stage's fingerprint covers the config keys it depends on
and a manifest (name, size, mtime) of each input; RUN/stages.json keeps the fingerprint and a manifest
of the output of every finished stage, so a rerun of a finished run only reads the file system. It also keeps
the config values, so that a field added to eyas later (at its default) or dropped does not count as a change.
With two or more GPUs, capture and training run at once on disjoint halves, training tailing the store.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eyas.common import EyasError, atomic_write_json, read_json, save_config, sha256_json
from eyas.config import BUILTIN_TARGETS, RunConfig
from eyas.gpu import nvml, procs

POLL_S = 0.1
# a tailing stage's record of the output it tails while that still grows (see Runner.decide)
GROWING = "growing"


@dataclass(frozen=True)
class Cmd:
    argv: list[str]
    out: str | None = None  # the file this command writes last: when present, a resumed stage skips it


@dataclass(frozen=True)
class Ctx:
    """What a stage's command builder may use."""

    cfg: RunConfig
    run: Path
    num_devices: int
    resume: bool  # the stage ran before with the same inputs and left partial output
    tail: bool  # this stage starts while the stage it tails still writes its output


@dataclass(frozen=True)
class Stage:
    name: str
    reads: tuple[str, ...]  # run-dir paths (outputs of earlier stages)
    writes: str  # the run-dir path it writes
    config: tuple[str, ...]  # config sections or section.key it depends on
    gpus: str | Callable[[RunConfig], str]  # none | one | all
    commands: Callable[[Ctx], list[Cmd]]
    when: Callable[[RunConfig], bool] = lambda cfg: True
    tails: str | None = None  # may run alongside this stage, reading its output as it grows
    external: Callable[[RunConfig], list[str]] = lambda cfg: []  # files outside the run dir it reads
    timeout_s: float = 0.0  # 0 = the runner's --stage-timeout
    unread: Callable[[RunConfig], tuple[str, ...]] = lambda cfg: ()  # of `reads`, those this config does not read


def eyas(ctx: Ctx, command: str, *args: str, dist: bool = False) -> list[str]:
    """argv of a stage command; a distributed one on several devices goes through torchrun."""
    head = [sys.executable, "-m"]
    if dist and ctx.num_devices > 1:
        head += ["torch.distributed.run", "--standalone", f"--nproc-per-node={ctx.num_devices}", "-m"]
    return head + ["eyas", command, "--config", str(ctx.run / "config.yaml"), *args]


def _prepare(ctx: Ctx) -> list[Cmd]:
    # regeneration (data.regenerate) runs inside prepare: it shares the tokenizer and its resume file
    return [Cmd(eyas(ctx, "prepare", "--out", str(ctx.run / "prepared")))]


def _capture(ctx: Ctx) -> list[Cmd]:
    return [Cmd(eyas(ctx, "capture", "--data", str(ctx.run / "prepared"), "--out", str(ctx.run / "store"), dist=True))]


def _train(ctx: Ctx) -> list[Cmd]:
    if ctx.cfg.capture.mode == "store":
        source = ["--store", str(ctx.run / "store")] + (["--tail"] if ctx.tail else [])
    else:
        source = ["--source", "online", "--data", str(ctx.run / "prepared")]
    resume = ["--resume"] if ctx.resume else []
    return [Cmd(eyas(ctx, "train", *source, "--out", str(ctx.run / "train"), *resume, dist=True))]


def _eval(ctx: Ctx) -> list[Cmd]:
    ev = ctx.cfg.eval
    # one process per benchmark, running every setting of the config (eval.steps, eval.tree) so that the
    # plain-decoding baseline is timed once per benchmark; RUN/eval/<bench>-<setting>.json (+ .png) each.
    # A benchmark whose last setting's result exists is done: a resume skips it.
    last = f"tree-{ev.tree.replace(',', 'x')}" if ev.tree else f"chain-{ev.steps[-1]}"
    cmds = []
    for bench in ev.benches:
        out = ctx.run / "eval" / f"{Path(bench).stem}-{last}.json"
        cmds.append(Cmd(eyas(ctx, "eval", "--draft", str(ctx.run / "train"), "--bench", bench,
                             "--out-dir", str(ctx.run / "eval")), out=str(out)))
    return cmds


def _export(ctx: Ctx) -> list[Cmd]:
    formats = ctx.cfg.export.formats  # with several formats, eyas export writes OUT/<format>/ for each
    out = ctx.run / "export" / formats[0] if len(formats) == 1 else ctx.run / "export"
    return [Cmd(eyas(ctx, "export", str(ctx.run / "train"), "--to", ",".join(formats), "--out", str(out)))]


def _store_mode(cfg: RunConfig) -> bool:
    return cfg.capture.mode == "store"


def _target_files(cfg: RunConfig) -> list[str]:
    """The target's files when target.model is a local model directory or .gguf file: weights replaced there
    make the stages that run the target stale. A hub id or a built-in name is named by the config alone."""
    spec = cfg.target.model
    if spec in BUILTIN_TARGETS:
        return []
    path = Path(spec).expanduser()
    return [str(path)] if (path.is_dir() and (path / "config.json").is_file()) or (
        spec.endswith(".gguf") and path.is_file()) else []


def _regen_gpu(cfg: RunConfig) -> str:
    return "one" if cfg.data.regenerate == "local" else "none"  # a URL: the server has the GPUs


STAGES = (
    #     name       reads                   writes      depends on config                     gpus        commands
    Stage("prepare", (),                     "prepared", ("target.model", "target.dtype", "data"), _regen_gpu, _prepare,
          external=lambda cfg: [*cfg.data.data, *_target_files(cfg)]),
    Stage("capture", ("prepared",),          "store",    ("target", "capture"),                "all",      _capture,
          when=_store_mode, external=_target_files),
    Stage("train",   ("prepared", "store"),  "train",    ("target", "capture.mode", "train"),  "all",      _train,
          tails="capture", external=lambda cfg: ([cfg.train.init_from] if cfg.train.init_from else [])
          + ([] if _store_mode(cfg) else _target_files(cfg)),
          unread=lambda cfg: () if _store_mode(cfg) else ("store",)),
    Stage("eval",    ("train",),             "eval",     ("target", "eval"),                   "one",      _eval,
          external=_target_files),
    Stage("export",  ("train",),             "export",   ("export",),                          "none",     _export),
)


# ---------------------------------------------------------------- fingerprints

def manifest(path: Path) -> list | None:
    """[relative name, size, mtime_ns] of every file under `path` (temporary and hidden files left out)."""
    if not path.exists():
        return None
    if path.is_file():
        st = path.stat()
        return [[path.name, st.st_size, st.st_mtime_ns]]
    rows = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith(".") or name.endswith((".tmp", ".lock")):
                continue
            p = Path(root) / name
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            rows.append([str(p.relative_to(path)), st.st_size, st.st_mtime_ns])
    return rows


def _config_value(cfg: RunConfig, key: str):
    section, _, name = key.partition(".")
    value = getattr(cfg, section)
    value = getattr(value, name) if name else value
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def config_values(stage: Stage, cfg: RunConfig) -> dict:
    """{config key: value} of the keys a stage depends on (a section as a dict of its fields)."""
    return {k: _config_value(cfg, k) for k in stage.config}


# fields added to config sections since the last eyas that recorded only a config hash in stages.json: its
# records match the hash of today's values without them (at their defaults). A new field goes here too
ADDED_SINCE_HASH_ONLY_RECORDS = ("data.self_prompt_openers", "data.self_prompt_opener_share", "train.init_from",
                                 "data.chat_template_kwargs")


def _defaults(cfg: RunConfig, section: str) -> dict:
    return dataclasses.asdict(type(getattr(cfg, section))())


def config_changes(stage: Stage, cfg: RunConfig, recorded: dict) -> list[str]:
    """The config keys or fields (section.field) whose current values differ from those a stage's record
    holds (written by this or an earlier eyas). A field eyas added since the record counts only when it is
    not at its default, and a field it dropped not at all: a new key must not make a resumed run remove
    its outputs."""
    changes = []
    for key, value in config_values(stage, cfg).items():
        old = recorded.get(key)
        if not (isinstance(value, dict) and isinstance(old, dict)):
            if key not in recorded or value != old:
                changes.append(key)
            continue
        defaults = _defaults(cfg, key.partition(".")[0])
        changes += [f"{key}.{name}" for name, v in value.items()
                    if (old[name] if name in old else defaults.get(name)) != v]
    return changes


def _config_hash_before_values(stage: Stage, cfg: RunConfig) -> str:
    """The config fingerprint an eyas that recorded no values gave these values: without the keys added
    since, when they are at their defaults."""
    values = config_values(stage, cfg)
    for added in ADDED_SINCE_HASH_ONLY_RECORDS:
        section, _, name = added.partition(".")
        if isinstance(values.get(section), dict) and values[section].get(name) == _defaults(cfg, section).get(name):
            values[section].pop(name, None)
    return sha256_json(values)


# 2: a stage's record names every input it had (the target's local files since); older records are completed
INPUTS_VERSION = 2


def fingerprint_parts(stage: Stage, cfg: RunConfig, run: Path) -> dict[str, str]:
    parts = {"config": sha256_json(config_values(stage, cfg))}
    unread = stage.unread(cfg)
    for name in stage.reads:
        # an input this config does not read counts as absent, whatever is there (a store left from an earlier
        # run does not make an online train stale); an online run's store never existed, so its records match
        parts[name] = sha256_json(None if name in unread else manifest(run / name))
    for path in stage.external(cfg):
        parts[path] = sha256_json(manifest(Path(path)))  # a hub name is not a path: its name is in config
    return parts


# ---------------------------------------------------------------- runner

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


def parse_gpus(text: str, option: str = "--gpus") -> list[int]:
    """'0,1,3' -> [0, 1, 3]; anything else is an EyasError that says what the option takes."""
    items = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in items if not (v.isascii() and v.isdigit())]
    if bad or len(set(items)) != len(items):
        what = f"{', '.join(repr(v) for v in bad)} is not a device index" if bad else "a device is named twice"
        raise EyasError(f"{option} {text!r}: {what}; give device indices separated by commas, e.g. 0,1 "
                        f"(`eyas gpus` lists them)")
    return [int(v) for v in items]


def _default_pool() -> list[int]:
    """The GPUs CUDA_VISIBLE_DEVICES names (indices or GPU-UUIDs, as CUDA reads it: up to the first entry
    that names no device), as NVML indices; without it every GPU NVML sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [g.index for g in nvml.gpus()]
    known = nvml.gpus()
    pool = []
    for entry in (v.strip() for v in visible.split(",")):
        if entry.isascii() and entry.isdigit():
            pool.append(int(entry))
            continue
        if entry.startswith("MIG-"):
            raise EyasError(f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}); eyas run schedules whole GPUs: "
                            f"give their indices with --gpus")
        # CUDA takes any unique prefix of a GPU's UUID
        match = [g.index for g in known if g.uuid and entry.startswith("GPU-") and g.uuid.startswith(entry)]
        if len(match) != 1:
            break  # CUDA ignores this entry and every one after it
        pool.append(match[0])
    return pool


class Runner:
    def __init__(self, cfg: RunConfig, run: Path, opts: RunOptions, stages=STAGES):
        self.cfg, self.run, self.opts, self.stages = cfg, Path(run), opts, stages
        self.pool = opts.gpus if opts.gpus is not None else _default_pool()
        self.nvml = nvml.available()
        known = {g.index for g in nvml.gpus()} if self.nvml else set(self.pool)
        if set(self.pool) - known:
            raise EyasError(f"GPUs {sorted(set(self.pool) - known)} do not exist; NVML sees {sorted(known)}")
        self.state: dict = {}
        self.records: list[dict] = []
        self.jobs: list[Job] = []
        self.summary: list[str] = []

    # -- bookkeeping files
    def _save_state(self) -> None:
        atomic_write_json(self.run / "stages.json", self.state)

    def _save_records(self) -> None:
        atomic_write_json(self.run / "processes.json",
                          {"runner": {"pid": os.getpid(), "start_ticks": procs.start_time(os.getpid())},
                           "stages": self.records})

    def _clean_orphans(self) -> None:
        try:
            old = read_json(self.run / "processes.json").get("stages", [])
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
        """('skip'|'resume'|'fresh', why, the stage's fingerprint): run_wave records the fingerprint, so its
        inputs' manifests are walked once per decision, not again at the start."""
        parts = fingerprint_parts(stage, self.cfg, self.run)
        rec = self.state.get(stage.name, {})
        out = self.run / stage.writes
        old, changes = rec.get("parts") or {}, None
        # A stage that tailed an output records it as GROWING, not as the manifest it saw then: the output
        # grew under it by design. While the same output is written (its stage resumes), GROWING matches it.
        # Its stage's end turns GROWING into the final manifest, a fresh start of it (output removed) into a
        # mark that never matches (_tailers_saw): a store rewritten with other settings still reruns train.
        tailed = next((s.writes for s in self.stages if s.name == stage.tails), None)
        if tailed in old and old[tailed] == GROWING:
            old[tailed] = parts[tailed]
        if old.get("config") not in (None, parts["config"]):
            # another hash for the same values (fields added to eyas since, at their defaults, or dropped)?
            if "config_values" in rec:
                changes = config_changes(stage, self.cfg, rec["config_values"])
                same = not changes
            else:
                same = old["config"] == _config_hash_before_values(stage, self.cfg)
            if same:
                old["config"] = parts["config"]
        if old and old.get("config") == parts["config"] and rec.get("inputs_version", 1) < INPUTS_VERSION:
            # inputs a newer eyas fingerprints (the target's local files) are missing from older records: under
            # the same config values they are the inputs the stage ran with (a new input from a config change,
            # such as train.init_from, comes with another config). A newer record names every input it had.
            for key in parts.keys() - old.keys():
                old[key] = parts[key]
        for key in stage.unread(self.cfg):  # never read, so never stale (an older eyas recorded a store there)
            if key in old:
                old[key] = parts[key]
        if rec.get("parts") == parts:
            if rec.get("status") == "done" and rec.get("outputs") == sha256_json(manifest(out)):
                if rec.get("inputs_version", 1) < INPUTS_VERSION:  # completed above: kept, so that a later
                    rec["inputs_version"] = INPUTS_VERSION  # change of the inputs it lacked is seen
                    self._save_state()
                return "skip", "done, inputs unchanged", parts
            if out.exists():
                return "resume", f"resuming after '{rec.get('status', 'unfinished')}'", parts
            return "fresh", "output missing", parts
        if rec.get("parts") and out.exists():
            changed = [k for k in parts if rec["parts"].get(k) != parts[k]]
            if "config" in changed and changes:
                changed[changed.index("config")] = f"config: {', '.join(changes)}"
            shutil.rmtree(out) if out.is_dir() else out.unlink()
            return "fresh", f"inputs changed ({', '.join(changed)}): old output removed", parts
        if out.exists():
            return "resume", "output present without a record: resuming", parts
        return "fresh", "first run", parts

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
        save_config(self.cfg, self.run / "config.yaml")
        try:
            self.state = read_json(self.run / "stages.json")
        except (OSError, ValueError):
            self.state = {}
        self._clean_orphans()
        active = [s for s in self.stages if s.when(self.cfg)]
        i = 0
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
            if partner and partner.tails == stage.name and self.opts.overlap and len(self.pool) >= 2:
                p_action, p_why, p_parts = self.decide(partner)
                self.log(f"{partner.name}: running alongside {stage.name}, tailing its output ({p_why})")
                wave.append((partner, p_action, p_parts))
            self.run_wave(wave)
            i += len(wave)

    def run_wave(self, wave: list[tuple[Stage, str, dict[str, str]]]) -> None:
        self.jobs = []
        for n, (stage, action, parts) in enumerate(wave):
            devices = self.devices_for(stage, n, len(wave))
            ctx = Ctx(self.cfg, self.run, len(devices), action == "resume", tail=n > 0)
            cmds = [c for c in stage.commands(ctx) if not (action == "resume" and c.out and Path(c.out).exists())]
            rec = self.state.setdefault(stage.name, {})
            if n > 0:  # tailing wave[0]'s output, which grows meanwhile
                parts = {**parts, wave[0][0].writes: GROWING}
            rec.update(status="running", parts=parts, inputs_version=INPUTS_VERSION,
                       config_values=config_values(stage, self.cfg), devices=devices,
                       started_at=time.time(), log=str(self.run / "logs" / f"{stage.name}.log"))
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
        log = self.run / "logs" / f"{job.stage.name}.log"
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

    def _check_gpus(self, job: Job) -> None:
        if not job.devices or not self.nvml:
            return
        ours = {os.getpid()} | {p for j in self.jobs if j.proc for p in j.proc.seen | {j.proc.pid}}
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
        if not out.exists():  # recorded done, its missing output would match forever: never run again
            rec.update(status="failed", returncode=0, ended_at=time.time())
            self._teardown_all("failed", None)
            raise StageFailed(f"{job.stage.name} exited with code 0 but did not write {out}; check its log "
                              f"{rec['log']} and rerun" + _log_tail(Path(rec["log"])))
        wall = time.monotonic() - job.t0
        # the inputs as they were when the stage started: one edited while it ran was not what it used, so the
        # next run must see it changed; only an input it tailed (still GROWING) is taken as it is now, final
        parts = dict(rec.get("parts") or fingerprint_parts(job.stage, self.cfg, self.run))
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
                        f"{run / 'train'} --to speculators --out DIR`), or use another --run-dir")
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
    """Run the stage table in `run`; raises StageFailed/EyasError, KeyboardInterrupt or procs.Terminated."""
    run = Path(run)
    check_inputs_outside(cfg, run, stages)
    what = f"the run directory {run} (another `eyas run` works there; wait for it or use another --run-dir)"
    with procs.exclusive(run / ".runner.lock", what), procs.signals_raise():
        runner = Runner(cfg, run, opts or RunOptions(), stages)
        try:
            runner.execute()
        finally:
            runner.summary = write_report(run, cfg, runner.state)
    return runner


# ---------------------------------------------------------------- the run report

def _read(path: Path):
    """A stage's JSON output, or None when it is missing or unreadable (the report never fails on it)."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


def _first(doc, *keys):
    return next((doc[k] for k in keys if isinstance(doc, dict) and doc.get(k) is not None), None)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _throughput(run: Path, name: str, wall: float | None) -> str:
    """From OUT/summary.json (tokens_per_s or samples_per_s), else derived from what the stage wrote."""
    out = {"prepare": "prepared", "capture": "store"}.get(name, name)
    summary = _read(run / out / "summary.json")
    for key, unit in (("tokens_per_s", "tok/s"), ("samples_per_s", "samples/s")):
        if isinstance(rate := _first(summary, key), (int, float)):
            return f"{rate:.4g} {unit}"
    derived = {"prepare": (_first(_read(run / "prepared" / "prepare.json"), "num_kept", "num_samples"), "samples/s"),
               "capture": (_first(_read(run / "store" / "manifest.json"), "num_tokens"), "tok/s"),
               "train": (_first(_last_metrics(run), "step"), "steps/s")}
    n, unit = derived.get(name, (None, ""))
    return f"{n / wall:.4g} {unit}" if wall and isinstance(n, (int, float)) else ""


def _last_metrics(run: Path) -> dict:
    import json

    try:
        doc = json.loads((run / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return {}
    return doc if isinstance(doc, dict) else {}


def eval_results(run: Path) -> list[dict]:
    rows = []
    for path in sorted((run / "eval").glob("*.json")):
        if path.name == "summary.json":  # the stage's own summary, not a benchmark result
            continue
        doc = _read(path) or {}
        s = doc.get("summary", doc) if isinstance(doc, dict) else {}
        rows.append({"name": path.stem, "tau": _first(s, "tau_pooled", "tau"),
                     "tau_request": _first(s, "tau_per_request"),
                     "per_position": _first(s, "accept_at_position", "per_position") or [],
                     "speedup": _first(s, "speedup_vs_plain", "speedup"),
                     "repeats": _first(s, "repeat_token_share"), "tau_elsewhere": _first(s, "tau_elsewhere"),
                     "ngram_tau": _first(s, "ngram_tau"),
                     "png": path.with_suffix(".png") if path.with_suffix(".png").exists() else None})
    return rows


def launch_lines(run: Path, cfg: RunConfig) -> dict[str, str]:
    """The export README's launch line per engine, else one built from REFERENCE.md section 6."""
    target = "HuggingFaceTB/SmolLM2-135M-Instruct" if cfg.target.model == "smollm2" else cfg.target.model
    k = cfg.eval.steps[0] if cfg.eval.steps else 3
    lines = {
        "vllm": f"vllm serve {target} --speculative-config '{{\"model\": \"{run / 'export' / 'vllm'}\", "
                f"\"method\": \"eagle3\", \"num_speculative_tokens\": {k}}}'",
        "sglang": f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                  f"--speculative-draft-model-path {run / 'export' / 'sglang'} --speculative-num-steps {k} "
                  f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
    }
    for engine, marker in (("vllm", "vllm serve"), ("sglang", "sglang.launch_server")):
        try:
            readme = (run / "export" / engine / "README.md").read_text()
        except OSError:
            continue
        found = [ln.strip() for ln in readme.splitlines() if marker in ln]
        if found:
            lines[engine] = found[0]
    return lines


def _acceptance_png(run: Path, rows: list[dict]) -> Path | None:
    """One PNG of per-position acceptance for all eval settings (drawn once)."""
    path = run / "acceptance.png"
    if path.exists() or not any(r["per_position"] for r in rows):
        return path if path.exists() else None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in rows:
        if r["per_position"]:
            ax.plot(range(1, len(r["per_position"]) + 1), r["per_position"], marker="o", label=r["name"])
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="per-position acceptance")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(run: Path, cfg: RunConfig, state: dict) -> list[str]:
    """RUN/report.md; returns the short terminal summary."""
    from eyas.common import atomic_write_text, format_bytes

    md = [f"# eyas run `{cfg.name}`", "", f"Target `{cfg.target.model}`, run directory `{run}`.", "",
          "| stage | status | wall time | throughput | devices |", "|---|---|---|---|---|"]
    summary = []
    for name, rec in state.items():
        wall = rec.get("wall_s")
        took = f"{wall:.1f} s" if wall is not None else ""
        md.append(f"| {name} | {rec.get('status', '?')} | {took} | {_throughput(run, name, wall)} | "
                  f"{','.join(map(str, rec.get('devices', []))) or 'cpu'} |")
        summary.append(f"{name:<8} {rec.get('status', '?'):<11} {took}")
    store = _read(run / "store" / "manifest.json")
    if store:
        size = _dir_bytes(run / "store")
        md += ["", "## Store", "", f"{store.get('num_samples', '?')} samples, {store.get('num_tokens', '?')} tokens, "
               f"{len(store.get('shards', []))} shards, {format_bytes(size)} on disk ({store.get('dtype', '?')})."]
        summary.append(f"store    {format_bytes(size)}")
    if (run / "train").exists():
        md += ["", "## Training", ""]
        init = (_read(run / "train" / "latest" / "draft.json") or {}).get("init_from")
        if init:
            md += [f"Fine-tuned from `{init}` (train.init_from): the draft kept its weights and vocabulary.", ""]
        last = _last_metrics(run)
        if last:
            md.append("Last logged step: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in last.items()))
        if (run / "train" / "curves.png").exists():
            md += ["", "![training curves](train/curves.png)"]
    rows = eval_results(run)
    if rows:  # "repeated context": the 8 tokens before a cycle already stood in the answer (eyas.speculative.stats)
        md += ["", "## Speculative decoding", "",
               "| benchmark-setting | tau | tau per request | tokens after a repeated context | tau elsewhere "
               "| n-gram lookup alone: tau | speedup |",
               "|---|---|---|---|---|---|---|"]
        for r in rows:
            fmt = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "?"  # noqa: E731
            share = f"{100 * r['repeats']:.0f} %" if isinstance(r["repeats"], (int, float)) else "?"
            md.append(f"| {r['name']} | {fmt(r['tau'])} | {fmt(r['tau_request'])} | {share} | "
                      f"{fmt(r['tau_elsewhere'])} | {fmt(r['ngram_tau'])} | {fmt(r['speedup'])} |")
            summary.append(f"eval     {r['name']}: tau {fmt(r['tau'])}, speedup {fmt(r['speedup'])}")
        pngs = [r["png"] for r in rows if r["png"]] or [p for p in [_acceptance_png(run, rows)] if p]
        md += [""] + [f"![per-position acceptance]({p.relative_to(run)})" for p in pngs]
    exports = [run / "export" / f for f in cfg.export.formats if (run / "export" / f).exists()]
    if exports:
        lines = launch_lines(run, cfg)
        md += ["", "## Export", ""] + [f"- `{p}`" for p in exports]
        md += ["", "Serve with vLLM:", "", "```bash", lines["vllm"], "```", "", "Serve with SGLang:", "",
               "```bash", lines["sglang"], "```"]
        summary += [f"export   {p}" for p in exports] + [f"vLLM:   {lines['vllm']}", f"SGLang: {lines['sglang']}"]
    atomic_write_text(run / "report.md", "\n".join(md) + "\n")
    return summary
