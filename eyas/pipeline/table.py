"""The stage table: what each stage reads, writes, depends on and needs, and the command lines that run it;
and each stage's fingerprint (the config keys it depends on and a manifest of each input).

Each stage is one or more `python -m eyas <command> --config RUN/config.yaml ...` subprocesses. Paths in
the run directory come from eyas.layout; `reads` and `writes` name them relative to RUN.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eyas.common import sha256_json
from eyas.config import BUILTIN_TARGETS, RunConfig
from eyas.layout import RunLayout


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

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run)


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
    command: str = ""  # the eyas command whose kind of output it writes (eyas.ownership); "" = its name

    @property
    def kind(self) -> str:
        return self.command or self.name


def eyas_argv(ctx: Ctx, command: str, *args: str, dist: bool = False) -> list[str]:
    """argv of a stage command; a distributed one on several devices goes through torchrun."""
    head = [sys.executable, "-m"]
    if dist and ctx.num_devices > 1:
        head += ["torch.distributed.run", "--standalone", f"--nproc-per-node={ctx.num_devices}", "-m"]
    return head + ["eyas", command, "--config", str(ctx.layout.config), *args]


def _prepare(ctx: Ctx) -> list[Cmd]:
    # regeneration (data.regenerate) runs inside prepare: it shares the tokenizer and its resume file
    return [Cmd(eyas_argv(ctx, "prepare", "--out", str(ctx.layout.prepared)))]


def _capture(ctx: Ctx) -> list[Cmd]:
    layout = ctx.layout
    # through vLLM one process captures: the engine spreads the target over the GPUs itself
    dist = ctx.cfg.target.backend != "vllm"
    return [Cmd(eyas_argv(ctx, "capture", "--data", str(layout.prepared), "--out", str(layout.store), dist=dist))]


def _train(ctx: Ctx, method: str = "eagle3") -> list[Cmd]:
    layout = ctx.layout.family(method)
    if _store_mode(ctx.cfg):
        source = ["--store", str(layout.store)] + (["--tail"] if ctx.tail else [])
        # the draft vocabulary prepare built; a draft to fine-tune keeps its own (train refuses --vocab then)
        source += [] if ctx.cfg.train.init_from else ["--vocab", str(layout.vocab)]
    else:
        source = ["--source", "online", "--data", str(layout.prepared)]
    resume = ["--resume"] if ctx.resume else []
    # config.yaml may list both families: each train stage trains its own
    return [Cmd(eyas_argv(ctx, "train", *source, "--out", str(layout.train), *resume, "--set", f"train.method={method}",
                          dist=True))]


def _eval(ctx: Ctx, method: str = "eagle3") -> list[Cmd]:
    ev, layout = ctx.cfg.eval, ctx.layout.family(method)
    # one process per benchmark, running every setting of the config (eval.steps, eval.tree) so that the
    # plain-decoding baseline is timed once per benchmark. A benchmark whose last setting's result exists
    # is done: a resume skips it. A DFlash draft runs chains only, its whole block (block_size - 1) last.
    if method == "dflash":
        last = f"chain-{ctx.cfg.dflash.block_size - 1}"
    else:
        last = f"tree-{ev.tree.replace(',', 'x')}" if ev.tree else f"chain-{ev.steps[-1]}"
    return [Cmd(eyas_argv(ctx, "eval", "--draft", str(layout.train), "--bench", bench, "--out-dir", str(layout.eval)),
                out=str(layout.eval_result(Path(bench).stem, last)))
            for bench in ev.benches]


def _export(ctx: Ctx, method: str = "eagle3") -> list[Cmd]:
    formats, layout = export_formats(ctx.cfg, method), ctx.layout.family(method)
    # eyas export writes one format to --out itself, several to OUT/<format>/: each lands in RUN/export/<format>
    out = layout.exported(formats[0]) if len(formats) == 1 else layout.export
    return [Cmd(eyas_argv(ctx, "export", str(layout.train), "--to", ",".join(formats), "--out", str(out)))]


def export_formats(cfg: RunConfig, method: str = "eagle3") -> list[str]:
    """export.formats, less speculators for a DFlash draft (its format holds EAGLE-3 drafts only)."""
    return [f for f in cfg.export.formats if method == "eagle3" or f != "speculators"]


def _family(method: str) -> Callable[[RunConfig], bool]:
    return lambda cfg: method in cfg.train.method


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


def _train_files(cfg: RunConfig) -> list[str]:
    """A draft to fine-tune, and the target's files when the train stage runs the target (online)."""
    return ([cfg.train.init_from] if cfg.train.init_from else []) + ([] if _store_mode(cfg) else _target_files(cfg))


def _regen_gpu(cfg: RunConfig) -> str:
    return "one" if cfg.data.regenerate == "local" else "none"  # a URL: the server has the GPUs


_REL = RunLayout(Path())  # the run directory's paths relative to RUN: the table's names for outputs
PREPARED, STORE, TRAIN, EVAL, EXPORT = (str(p) for p in (_REL.prepared, _REL.store, _REL.train, _REL.eval, _REL.export))
_DF = _REL.family("dflash")
TRAIN_DF, EVAL_DF, EXPORT_DF = (str(p) for p in (_DF.train, _DF.eval, _DF.export))

STAGES = (
    #     name       reads                writes    depends on config                          gpus        commands
    Stage("prepare", (),                  PREPARED, ("target.model", "target.dtype", "data"), _regen_gpu, _prepare,
          external=lambda cfg: [*cfg.data.data, *_target_files(cfg)]),
    Stage("capture", (PREPARED,),         STORE,    ("target", "capture"),                    "all",      _capture,
          when=_store_mode, external=_target_files),
    Stage("train",   (PREPARED, STORE),   TRAIN,    ("target", "capture.mode", "train"),      "all",      _train,
          when=_family("eagle3"), tails="capture", external=_train_files,
          unread=lambda cfg: () if _store_mode(cfg) else (STORE,)),
    # a DFlash draft from the same store (train.method lists dflash), trained right after the EAGLE-3 one so that
    # both drafts exist before either is evaluated, then evaluated and exported beside it
    Stage("train-dflash", (PREPARED, STORE), TRAIN_DF, ("target", "capture.mode", "train", "dflash"), "all",
          lambda ctx: _train(ctx, "dflash"), when=_family("dflash"), external=_train_files,
          unread=lambda cfg: () if _store_mode(cfg) else (STORE,), command="train"),
    Stage("eval",    (TRAIN,),            EVAL,     ("target", "eval"),                       "one",      _eval,
          when=_family("eagle3"), external=_target_files),
    Stage("export",  (TRAIN,),            EXPORT,   ("export",),                              "none",     _export,
          when=_family("eagle3")),
    Stage("eval-dflash", (TRAIN_DF,),     EVAL_DF,  ("target", "eval"),                       "one",
          lambda ctx: _eval(ctx, "dflash"), when=_family("dflash"), external=_target_files, command="eval"),
    Stage("export-dflash", (TRAIN_DF,),   EXPORT_DF, ("export",),                             "none",
          lambda ctx: _export(ctx, "dflash"), command="export",
          when=lambda cfg: "dflash" in cfg.train.method and bool(export_formats(cfg, "dflash"))),
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
    value = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    if key == "train":  # each family's train stage trains one method: listing another does not make it stale
        value.pop("method", None)
    return value


def config_values(stage: Stage, cfg: RunConfig) -> dict:
    """{config key: value} of the keys a stage depends on (a section as a dict of its fields)."""
    return {k: _config_value(cfg, k) for k in stage.config}


def config_changes(stage: Stage, cfg: RunConfig, recorded: dict) -> list[str]:
    """The config keys, or fields of a section (section.field), whose current values differ from the
    values a stage's record holds: what the log names as the change."""
    changes = []
    for key, value in config_values(stage, cfg).items():
        old = recorded.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            changes += [f"{key}.{name}" for name in {**old, **value} if old.get(name) != value.get(name)]
        elif key not in recorded or value != old:
            changes.append(key)
    return changes


def _section_defaults(cfg: RunConfig, section: str) -> dict:
    """{field: its default} of a config section's dataclass (not the preset's value: a key's default is what
    keeps the behaviour eyas had before the key existed)."""
    value = getattr(cfg, section, None)
    return vars(type(value)()) if dataclasses.is_dataclass(value) else {}  # every section builds from its defaults


def only_new_keys_at_default(stage: Stage, cfg: RunConfig, recorded: dict | None, recorded_hash: str | None) -> bool:
    """True when a stage's config equals the values its record holds except for fields the record lacks (keys
    that a later eyas added) left at their defaults: upgrading eyas does not redo finished stages, while a new
    key set to another value, or any recorded value changed, still does. `recorded_hash` must be the hash of
    `recorded` (the record is whole)."""
    if not isinstance(recorded, dict) or not recorded_hash or sha256_json(recorded) != recorded_hash:
        return False
    current = config_values(stage, cfg)
    if set(current) != set(recorded):
        return False
    trimmed = {}
    for key, value in current.items():
        old = recorded[key]
        if isinstance(value, dict) and isinstance(old, dict):
            defaults = _section_defaults(cfg, key)
            added = [name for name in value if name not in old]
            if any(name not in defaults or sha256_json(value[name]) != sha256_json(defaults[name]) for name in added):
                return False
            value = {name: v for name, v in value.items() if name in old}
        trimmed[key] = value
    return sha256_json(trimmed) == recorded_hash


def fingerprint_parts(stage: Stage, cfg: RunConfig, run: Path) -> dict[str, str]:
    """{"config": hash of the config values, each input (a run-dir name or an outside path): hash of its manifest}."""
    parts = {"config": sha256_json(config_values(stage, cfg))}
    unread = stage.unread(cfg)
    for name in stage.reads:
        # an input this config does not read counts as absent, whatever is there: a store left from an earlier
        # run does not make an online train stale
        parts[name] = sha256_json(None if name in unread else manifest(run / name))
    for path in stage.external(cfg):
        parts[path] = sha256_json(manifest(Path(path)))  # a hub name is not a path: its name is in config
    return parts
