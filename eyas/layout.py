"""Where everything lies in a run directory of `eyas run`: the one place that names its paths.

    RUN/config.yaml        the resolved config every stage command reads
    RUN/prepared/          prepare: the dataset, vocab.safetensors, prepare.json, summary.json
    RUN/store/             capture: shards, manifest.json, summary.json
    RUN/train/             train: step checkpoints, latest/, metrics.jsonl, curves.png, summary.json
    RUN/eval/              eval: <bench>-<setting>.json (+ .png) per benchmark and setting, summary.json
    RUN/export/<format>/   export: one directory per format, each with a README.md holding its launch line
    RUN/train-dflash/, RUN/eval-dflash/, RUN/export-dflash/<format>/
                           the same three for a DFlash draft (train.method lists dflash) trained on the same store
    RUN/stages.json        the runner's record of each stage (fingerprints, status, times)
    RUN/processes.json     every stage process the runner started (pid, start time, devices)
    RUN/logs/<stage>.log   each stage's output
    RUN/report.md          the run report
    RUN/.runner.lock       held by the one runner working in RUN (gone when it ends)
    RUN/.engine.sock       the run's vLLM engine (target.backend=vllm) while it serves (+ .key, its key)
    RUN/.eyas.json         the marker of a directory eyas made; each stage's output carries one too (eyas.ownership)
    RUN/.<output>.eyas.lock  held by the one process writing that stage output (gone when it ends)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SUMMARY = "summary.json"  # every stage's own figures, in its output directory


def eval_result_name(bench: str, setting: str) -> str:
    """The file name of one benchmark's result for one setting; its plot lies beside it as .png. `bench` is a
    benchmark's name (a JSONL file's stem), `setting` chain-K or tree-TOPKxDEPTHxTOTAL."""
    return f"{bench}-{setting}.json"


@dataclass(frozen=True)
class RunLayout:
    run: Path
    method: str = "eagle3"  # the draft family whose train/eval/export directories this layout names

    @property
    def _family(self) -> str:
        return "" if self.method == "eagle3" else f"-{self.method}"

    def family(self, method: str) -> "RunLayout":
        """The same run's layout for another draft family (train.method)."""
        return RunLayout(self.run, method)

    @property
    def config(self) -> Path:
        return self.run / "config.yaml"

    @property
    def prepared(self) -> Path:
        return self.run / "prepared"

    @property
    def vocab(self) -> Path:
        """The draft vocabulary prepare builds from the data (d2t, t2d); training from a store reads it."""
        return self.prepared / "vocab.safetensors"

    @property
    def store(self) -> Path:
        return self.run / "store"

    @property
    def train(self) -> Path:
        return self.run / f"train{self._family}"

    @property
    def train_metrics(self) -> Path:
        return self.train / "metrics.jsonl"

    @property
    def train_curves(self) -> Path:
        return self.train / "curves.png"

    @property
    def latest_draft(self) -> Path:
        """The self-description of the last checkpoint (config, vocabulary, train.init_from)."""
        return self.train / "latest" / "draft.json"

    @property
    def eval(self) -> Path:
        return self.run / f"eval{self._family}"

    def eval_result(self, bench: str, setting: str) -> Path:
        """One benchmark's result for one setting, written by `eyas eval --out-dir RUN/eval`."""
        return self.eval / eval_result_name(bench, setting)

    def eval_results(self) -> list[Path]:
        """The eval results present, sorted by name (every JSON file in RUN/eval but the stage's summary and
        hidden files such as eyas's ownership marker)."""
        return sorted(p for p in self.eval.glob("*.json") if p.name != SUMMARY and not p.name.startswith("."))

    @property
    def export(self) -> Path:
        return self.run / f"export{self._family}"

    def exported(self, fmt: str) -> Path:
        """The export in one format (sglang, vllm, speculators)."""
        return self.export / fmt

    def export_readme(self, fmt: str) -> Path:
        """The export's README.md, which holds the engine's launch line."""
        return self.exported(fmt) / "README.md"

    def summary(self, output: str | Path) -> Path:
        """The summary.json of a stage's output: its path, or its name relative to RUN (e.g. "store")."""
        return self.run / output / SUMMARY

    @property
    def stages(self) -> Path:
        return self.run / "stages.json"

    @property
    def processes(self) -> Path:
        return self.run / "processes.json"

    def log(self, stage: str) -> Path:
        return self.run / "logs" / f"{stage}.log"

    @property
    def report(self) -> Path:
        return self.run / "report.md"

    @property
    def lock(self) -> Path:
        return self.run / ".runner.lock"

    @property
    def engine_socket(self) -> Path:
        return self.run / ".engine.sock"


def eval_result_name(bench: str, setting: str) -> str:
    """The file name of one benchmark's result for one setting, in RUN/eval or any eval output directory."""
    return f"{bench}-{setting}.json"
