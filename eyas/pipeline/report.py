"""The run report: RUN/report.md from what the stages wrote, and the short summary `eyas run` prints.

What it reads, one schema each (a value that is missing shows as "?", a section without its file is left
out; the report never fails on a stage's output):
    RUN/<output>/summary.json  a stage's rate: tokens_per_s (capture, train, eval) or samples_per_s (prepare);
                               capture's also the whole store: store_samples, store_tokens, num_shards,
                               store_bytes, dtype
    RUN/train/                 metrics.jsonl (its last line), curves.png, latest/draft.json (init_from)
    RUN/eval/<result>.json     its "summary": tau_pooled, tau_per_request, repeat_token_share, tau_elsewhere,
                               ngram_tau, speedup_vs_plain, num_requests; its "settings": limit (the prompts
                               taken from the benchmark, 0 = all); its plot beside it (.png)
    RUN/export/<format>/       README.md: the launch line, the first line of its bash block
"""

from __future__ import annotations

import json
from pathlib import Path

from eyas.common import atomic_write_text, format_bytes, read_json
from eyas.config import RunConfig
from eyas.layout import RunLayout
from eyas.pipeline.table import STAGES

RATES = (("tokens_per_s", "tok/s"), ("samples_per_s", "samples/s"))  # the key a stage's summary gives its rate in
ENGINES = {"sglang": "SGLang", "vllm": "vLLM", "speculators": "vLLM (speculators format)"}  # who serves each format


def _read(path: Path) -> dict:
    """A JSON object a stage wrote, or {} when it is missing or unreadable."""
    try:
        doc = read_json(path)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _num(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "?"


def throughput(layout: RunLayout, output: str) -> str:
    """The rate in the summary.json of a stage's output, with its unit; "" when it gives none."""
    summary = _read(layout.summary(output))
    rates = [f"{summary[key]:.4g} {unit}" for key, unit in RATES if isinstance(summary.get(key), (int, float))]
    return rates[0] if rates else ""


def _stages(layout: RunLayout, state: dict, stages) -> tuple[list[str], list[str]]:
    writes = {s.name: s.writes for s in stages}
    md = ["| stage | status | wall time | throughput | devices |", "|---|---|---|---|---|"]
    summary = []
    for name, rec in state.items():
        wall = rec.get("wall_s")
        took = f"{wall:.1f} s" if wall is not None else ""
        rate = throughput(layout, writes[name]) if name in writes else ""
        md.append(f"| {name} | {rec.get('status', '?')} | {took} | {rate} | "
                  f"{','.join(map(str, rec.get('devices', []))) or 'cpu'} |")
        summary.append(f"{name:<8} {rec.get('status', '?'):<11} {took}")
    return md, summary


def _store(layout: RunLayout) -> tuple[list[str], list[str]]:
    s = _read(layout.summary(layout.store))
    if not s:
        return [], []
    size = format_bytes(s["store_bytes"]) if isinstance(s.get("store_bytes"), (int, float)) else "?"
    md = ["", "## Store", "", f"{s.get('store_samples', '?')} samples, {s.get('store_tokens', '?')} tokens, "
          f"{s.get('num_shards', '?')} shards, {size} on disk ({s.get('dtype', '?')})."]
    return md, [f"store    {size}"]


def last_metrics(layout: RunLayout) -> dict:
    """The last line of RUN/train/metrics.jsonl, {} when there is none."""
    try:
        doc = json.loads(layout.train_metrics.read_text().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return {}
    return doc if isinstance(doc, dict) else {}


FAMILIES = {"eagle3": "EAGLE-3", "dflash": "DFlash"}


def _training(layout: RunLayout, titled: bool = False) -> list[str]:
    if not layout.train.exists():
        return []
    md = ["", f"## Training ({FAMILIES[layout.method]})" if titled else "## Training", ""]
    init = _read(layout.latest_draft).get("init_from")
    if init:
        md += [f"Fine-tuned from `{init}` (train.init_from): the draft kept its weights and vocabulary.", ""]
    last = last_metrics(layout)
    if last:
        md.append("Last logged step: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in last.items()))
    if layout.train_curves.exists():
        md += ["", f"![training curves]({layout.train_curves.relative_to(layout.run)})"]
    return md


def eval_results(layout: RunLayout) -> list[dict]:
    """One row per eval result (benchmark x setting) with the figures of its "summary"."""
    rows = []
    for path in layout.eval_results():
        doc = _read(path)
        s, settings = (doc.get(key) if isinstance(doc.get(key), dict) else {} for key in ("summary", "settings"))
        png = path.with_suffix(".png")
        limit = settings.get("limit")
        rows.append({"name": path.stem, "tau": s.get("tau_pooled"), "tau_request": s.get("tau_per_request"),
                     "repeats": s.get("repeat_token_share"), "tau_elsewhere": s.get("tau_elsewhere"),
                     "ngram_tau": s.get("ngram_tau"), "speedup": s.get("speedup_vs_plain"),
                     "requests": s.get("num_requests"), "limited": isinstance(limit, int) and limit > 0,
                     "png": png if png.exists() else None})
    return rows


def _speculative(layouts: list[RunLayout]) -> tuple[list[str], list[str]]:
    """One table for every family's eval results: with several families (train.method), side by side by draft."""
    rows = [(lay, r) for lay in layouts for r in eval_results(lay)]
    if not rows:
        return [], []
    both = len({lay.method for lay, _ in rows}) > 1
    # "repeated context": the 8 tokens before a cycle already stood in the answer (eyas.speculative.stats)
    md = ["", "## Speculative decoding", "",
          ("| draft " if both else "") + "| benchmark-setting | prompts | tau | tau per request | tokens after a "
          "repeated context | tau elsewhere | n-gram lookup alone: tau | speedup |",
          ("|---" if both else "") + "|---|---|---|---|---|---|---|---|"]
    summary = []
    for lay, r in sorted(rows, key=lambda x: (x[1]["name"], x[0].method)) if both else rows:
        share = f"{100 * r['repeats']:.0f} %" if isinstance(r["repeats"], (int, float)) else "?"
        family = FAMILIES[lay.method]
        prompts = r["requests"] if isinstance(r["requests"], int) else "?"
        md.append((f"| {family} " if both else "") + f"| {r['name']} | {prompts}"
                  f"{' (eval.limit)' if r['limited'] else ''} | {_num(r['tau'])} | {_num(r['tau_request'])} | "
                  f"{share} | {_num(r['tau_elsewhere'])} | {_num(r['ngram_tau'])} | {_num(r['speedup'])} |")
        summary.append(f"eval     {family + ' ' if both else ''}{r['name']}: tau {_num(r['tau'])}, speedup "
                       f"{_num(r['speedup'])}" + (f" (the first {prompts} prompts)" if r["limited"] else ""))
    partial = [lay for lay in layouts if any(r["limited"] for la, r in rows if la is lay)]
    if partial:  # a benchmark's first prompts are not the benchmark
        md += ["", "Rows marked eval.limit cover a benchmark's first prompts only, and their figures can be far from "
               "the whole benchmark's. Every prompt: " + "; ".join(
                   f"`eyas eval --config {lay.config} --draft {lay.train} --limit 0`" for lay in partial)]
    rows = [r for _, r in rows]
    layout = layouts[0]
    md += [""] + [f"![per-position acceptance]({r['png'].relative_to(layout.run)})" for r in rows if r["png"]]
    return md, summary


def launch_line(readme: Path) -> str | None:
    """The launch command an export's README.md holds: the first line of its bash block."""
    try:
        lines = readme.read_text().splitlines()
    except OSError:
        return None
    fence = next((i for i, line in enumerate(lines) if line.strip() == "```bash"), None)
    return lines[fence + 1].strip() if fence is not None and fence + 1 < len(lines) else None


def _export(layout: RunLayout, cfg: RunConfig, titled: bool = False) -> tuple[list[str], list[str]]:
    formats = [f for f in cfg.export.formats if layout.exported(f).exists()]
    if not formats:
        return [], []
    md = ["", f"## Export ({FAMILIES[layout.method]})" if titled else "## Export", ""] + \
        [f"- `{layout.exported(f)}`" for f in formats]
    summary = [f"export   {layout.exported(f)}" for f in formats]
    for fmt in formats:
        line = launch_line(layout.export_readme(fmt))
        if line:
            md += ["", f"Serve with {ENGINES.get(fmt, fmt)}:", "", "```bash", line, "```"]
            summary.append(f"{ENGINES.get(fmt, fmt)}: {line}")
    return md, summary


def _loads(cfg: RunConfig, state: dict, engine_loads: list[dict]) -> tuple[list[str], list[str]]:
    """How often the run loaded the target, and how long each load took: the run's vLLM engine (one load for
    the stages it served, each `eyas run` in this directory that needed it) and the stages that load it with
    transformers themselves."""
    ran = [name for name, rec in state.items() if rec.get("status") in ("done", "running", "failed")]
    served = {name for load in engine_loads for name in load.get("served", [])}
    own = [name for name in ran if name not in served and name in _RUNS_TARGET(cfg)]
    if not engine_loads and not own:
        return [], []
    md = ["", "## Target loads", "", "| loaded by | for the stages | time to serve |", "|---|---|---|"]
    summary = []
    for load in engine_loads:
        ready, start = load.get("ready_s"), load.get("engine_start_s")
        took = f"{ready:.1f} s (vLLM's start {start:.1f} s)" if isinstance(ready, (int, float)) and \
            isinstance(start, (int, float)) else "did not serve"
        md.append(f"| the run's vLLM engine | {', '.join(load.get('served', [])) or 'none'} | {took} |")
    if engine_loads:
        summary.append(f"target   loaded {len(engine_loads)}x into vLLM for {', '.join(sorted(served)) or 'nothing'}")
    for name in own:
        md.append(f"| transformers, in the stage's process | {name} | (in the stage's wall time) |")
    return md, summary


def _RUNS_TARGET(cfg: RunConfig) -> set[str]:
    """The stages that run the target themselves (with transformers) under this config."""
    stages = {"eval", "eval-dflash"}
    if cfg.target.backend != "vllm":
        stages |= {"prepare", "capture"}
    if cfg.capture.mode == "online":
        stages |= {"train", "train-dflash"}
    return stages


def write_report(run: Path, cfg: RunConfig, state: dict, stages=STAGES, engine_loads: list[dict] | None = None) -> list[str]:
    """RUN/report.md from the stage records `state` (stages.json's), this run's engine loads (the runner's) and
    the stages' outputs; returns the short terminal summary."""
    layout = RunLayout(Path(run))
    md = [f"# eyas run `{cfg.name}`", "", f"Target `{cfg.target.model}`, run directory `{run}`.", ""]
    summary: list[str] = []
    families = [layout.family(m) for m in cfg.train.method]
    titled = len(families) > 1
    sections = [_stages(layout, state, stages), _loads(cfg, state, engine_loads or []), _store(layout)]
    sections += [(_training(lay, titled), []) for lay in families]
    sections += [_speculative(families)] + [_export(lay, cfg, titled) for lay in families]
    for section_md, section_summary in sections:
        md += section_md
        summary += section_summary
    atomic_write_text(layout.report, "\n".join(md) + "\n")
    return summary
