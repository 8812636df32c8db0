"""`eyas eval --engine vllm`: a draft's acceptance length and speedup measured by vLLM itself.

A second opinion beside eyas's own engine, taken where the model is served. The draft goes to vLLM as an
EAGLE-3 speculator (`speculative_config` {"method": "eagle3", "model": EXPORT, "num_speculative_tokens": k});
a checkpoint is first exported in the `vllm` format to a temporary directory. `target.engine` is passed to
`vllm.LLM` unchanged. Benchmark turns are rendered as `eyas eval` renders them (eyas.speculative.bench), and
`batch_size` requests go to the engine at once; a conversation's next turn follows the engine's own answer.

vLLM's counters (drafts, accepted draft tokens, accepted per position; the `vllm:spec_decode_*` metrics of the
engine's own Prometheus logger), read before and after each generate call, give the pooled figures: tau = 1 +
accepted / drafts, tokens per verification, as eyas's tau_pooled. Each request's accepted drafts per verification
come with its output (`per_request_spec_decode_metrics="detailed"`, vLLM 0.32): the per-request tau, and turns in
the same schema as eyas eval's. A plain engine (no draft), started once the speculative ones are shut down, then
decodes each setting's contexts in that setting's batches (a batch an earlier setting already had is not decoded
again): tokens/s without the draft, the speedup, and at temperature 0 the turns and requests whose output differs
from it, each on the setting's own contexts.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from eyas.common import EyasError, print0, read_json, warn

# vLLM's counter names (vllm.v1.spec_decode.metrics): per engine, summed over its labels
DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def chain_settings(steps: list[int]) -> list[tuple[str, dict]]:
    """The settings vLLM runs, named apart from eyas's own results (BENCH-vllm-chain-K.json)."""
    return [(f"vllm-chain-{k}", {"steps": k}) for k in steps]


def served_draft(draft: str | Path, tmp: Path) -> tuple[Path, dict]:
    """(the directory vLLM loads as the speculator, the draft's meta): an eyas export in the vllm or
    speculators format as it is, anything else eyas reads exported to `tmp` in the vllm format (fp32: vLLM
    casts the weights to the engine's dtype)."""
    from eyas.formats import export, load_draft, resolve_draft_dir

    d = resolve_draft_dir(draft)
    _, meta = load_draft(d)
    if meta.get("method") == "dflash":
        raise EyasError(f"{draft} is a DFlash draft: `eyas eval --engine vllm` measures EAGLE-3 drafts (vLLM's CPU build "
                        f"cannot run DFlash's non-causal draft attention); measure it with `eyas eval` (engine eyas), or "
                        f"serve its vllm export on a GPU with speculative_config {{\"method\": \"dflash\", \"model\": "
                        f"EXPORT, \"num_speculative_tokens\": {meta['draft_config']['block_size'] - 1}}} (docs/FORMATS.md)")
    side = d / "eyas.json"
    if side.is_file() and read_json(side).get("format") in ("vllm", "speculators"):
        return d, meta
    return export(d, tmp / "vllm", "vllm", dtype="fp32")["vllm"], meta


def engine_kwargs(model_dir: str, dtype: str, engine: dict, draft_dir: str | Path | None = None,
                  k: int = 0) -> dict:
    """`vllm.LLM`'s keyword arguments: the user's `engine` dict, the dtype (unless it names one), the counters
    on, and with a draft the EAGLE-3 speculative config."""
    if "speculative_config" in engine:
        raise EyasError("target.engine.speculative_config is set by eyas eval --engine vllm (from --draft and "
                        "--steps); remove it from target.engine")
    kwargs = {"model": model_dir, "seed": 0, **engine, "disable_log_stats": False}
    if dtype in _DTYPES and "dtype" not in engine:
        kwargs["dtype"] = _DTYPES[dtype]
    if draft_dir is not None:
        kwargs["speculative_config"] = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
        # each request's accepted drafts per verification, returned with its output (vLLM >= 0.32)
        kwargs.setdefault("per_request_spec_decode_metrics", "detailed")
    return kwargs


class ServingEngine:
    """A started `vllm.LLM` (with a draft or plain) that decodes token ids and reports vLLM's speculative
    counters per call. A context manager: leaving it shuts the engine down."""

    def __init__(self, model_dir: str, *, dtype: str, engine: dict, draft_dir=None, k: int = 0):
        from eyas.target.vllm.engine import _cpu_thread_binding, cpu_fixes, on_cpu, require_vllm

        vllm = require_vllm()
        self.k = k
        t0 = time.perf_counter()
        try:
            with _cpu_thread_binding(engine):
                kwargs = engine_kwargs(model_dir, dtype, engine, draft_dir, k)
                self.llm = vllm.LLM(**(cpu_fixes(kwargs) if on_cpu() else kwargs))
        except Exception as e:  # noqa: BLE001 - vLLM reports bad arguments with many types
            text = str(e).strip().splitlines()
            what = f"the draft {draft_dir} (k={k})" if draft_dir else "no draft"
            raise EyasError(f"vLLM could not start on {model_dir} with {what} ({type(e).__name__}: "
                            f"{text[-1][:300] if text else ''}); check target.engine and the log above") from e
        print0(f"vLLM {vllm.__version__} engine started in {time.perf_counter() - t0:.1f} s: "
               f"{f'EAGLE-3 draft {draft_dir}, {k} tokens a cycle' if draft_dir else 'plain decoding'}")
        self.spec_prom = _spec_prom(self.llm)
        if self.spec_prom is None:
            warn("vLLM's engine has no Prometheus logger where eyas looks for it: its counters are read from the "
                 "process-wide registry, which holds the newest engine's only")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        from eyas.target.vllm.engine import shutdown

        llm, self.llm = getattr(self, "llm", None), None
        shutdown(llm)

    def counters(self) -> dict:
        """{"drafts", "accepted", "per_position" [k]} so far (zeros without a draft): this engine's own counters.

        `llm.get_metrics()` reads prometheus' process-wide registry, from which every engine start removes the
        earlier engines' metrics: with two engines alive in one process it reports the newest one's. So the
        counters are read from this engine's own Prometheus logger (`spec_prom`, found at the start), and from the
        registry only where vLLM has no such logger (another vLLM release; the start warned of it)."""
        if self.spec_prom is not None:
            return _own_counters(self.spec_prom, self.k)
        out = {"drafts": 0, "accepted": 0, "per_position": [0] * self.k}
        for m in self.llm.get_metrics():
            if m.name == DRAFTS:
                out["drafts"] += int(m.value)
            elif m.name == ACCEPTED:
                out["accepted"] += int(m.value)
            elif m.name == PER_POSITION:
                out["per_position"] = [a + int(b) for a, b in zip(out["per_position"], m.values)]
        return out

    def generate(self, prompts: list[list[int]], params) -> tuple[list[dict], float, dict]:
        """-> (per prompt {"tokens": new ids, "accepted": accepted drafts per verification or None where vLLM
        does not report them per request}, seconds, the counters' increase over this call)."""
        before = self.counters()
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = self.counters()
        delta = {"drafts": after["drafts"] - before["drafts"], "accepted": after["accepted"] - before["accepted"],
                 "per_position": [a - b for a, b in zip(after["per_position"], before["per_position"])]}
        return [_output(o.outputs[0]) for o in outs], seconds, delta


def _spec_prom(llm):
    """The speculative-decoding metrics of the engine's own Prometheus logger (vLLM 0.32:
    llm_engine.logger_manager.stat_loggers holds a PrometheusStatLogger whose spec_decoding_prom keeps one labelled
    counter per engine index), or None where that structure is not there."""
    try:
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        loggers = llm.llm_engine.logger_manager.stat_loggers
        return next(lg for lg in loggers if isinstance(lg, PrometheusStatLogger)).spec_decoding_prom
    except (AttributeError, ImportError, StopIteration):
        return None


def _own_counters(prom, k: int) -> dict:
    """{"drafts", "accepted", "per_position" [k]} from an engine's spec_decoding_prom (zeros without a draft)."""
    if not getattr(prom, "spec_decoding_enabled", False):
        return {"drafts": 0, "accepted": 0, "per_position": [0] * k}

    def total(counter) -> int:  # a labelled counter's value, through its public collect()
        return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))

    per_engine = [[total(c) for c in children]
                  for children in prom.counter_spec_decode_num_accepted_tokens_per_pos.values()]
    return {"drafts": sum(total(c) for c in prom.counter_spec_decode_num_drafts.values()),
            "accepted": sum(total(c) for c in prom.counter_spec_decode_num_accepted_tokens.values()),
            "per_position": ([sum(col) for col in zip(*per_engine)] + [0] * k)[:k]}


def _output(completion) -> dict:
    """A completion's new token ids and, where vLLM reports them per request (its `detailed` level), the accepted
    drafts of each verification."""
    metrics = getattr(completion, "spec_decode_metrics", None)
    steps = getattr(metrics, "per_step_accepted", None) if metrics is not None else None
    if steps is not None and len(steps) != sum(metrics.histogram):  # the `summary` level: counts, not the order
        steps = None
    return {"tokens": list(completion.token_ids), "accepted": None if steps is None else list(steps)}


def sampling(temperature: float, max_new_tokens: int, eos: list[int]):
    """Greedy at temperature 0, else the full distribution at `temperature` (no top-k, no top-p), as eyas eval."""
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                          stop_token_ids=list(eos), detokenize=False, seed=0 if temperature > 0 else None)


def decode_bench(engine: ServingEngine, tokenizer, requests: list[dict], batch_size: int, params,
                 chat_template_kwargs: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Every turn of every request, `batch_size` requests a call -> (records [{"id", "turns": [{"prompt_ids",
    "tokens", "text", "num_cycles", "accepted" (per cycle, where vLLM reports it per request)}]}], calls
    [{"turns": [(request, turn)], "seconds", "num_tokens", "drafts", "accepted", "per_position"}])."""
    from eyas.speculative.bench import encode_turn

    records = [{"id": r["id"], "turns": []} for r in requests]
    histories: list[list[dict]] = [[] for _ in requests]
    calls = []
    for start in range(0, len(requests), batch_size):
        group = range(start, min(start + batch_size, len(requests)))
        for j in range(max(len(requests[i]["turns"]) for i in group)):
            live = [i for i in group if j < len(requests[i]["turns"])]
            prompts = []
            for i in live:
                histories[i].append({"role": "user", "content": requests[i]["turns"][j]})
                prompts.append(encode_turn(tokenizer, histories[i], chat_template_kwargs))
            outputs, seconds, counts = engine.generate(prompts, params)
            for i, ids, out in zip(live, prompts, outputs):
                text = tokenizer.decode(out["tokens"], skip_special_tokens=True)
                histories[i].append({"role": "assistant", "content": text})
                turn = {"prompt_ids": ids, "num_prompt_tokens": len(ids), "tokens": out["tokens"], "text": text}
                if out["accepted"] is not None:
                    turn.update(num_cycles=len(out["accepted"]), accepted=out["accepted"])
                records[i]["turns"].append(turn)
            calls.append({"turns": [(i, j) for i in live], "seconds": seconds,
                          "num_tokens": sum(len(o["tokens"]) for o in outputs), **counts})
    return records, calls


def replay(engine: ServingEngine, records: list[dict], calls: list[dict], params, done: dict | None = None) -> dict:
    """The contexts of `calls` decoded in the same batches -> {"tokens": {(request, turn): ids}, "seconds",
    "num_tokens", "calls_decoded"}. `done` ({batch of contexts: (outputs, seconds)}, filled here) holds the batches
    an earlier setting's replay decoded: a call of the same contexts is taken from it, so each setting is compared
    and timed on its own contexts (a second turn follows that setting's own first answer) at no extra cost where
    they are the same."""
    done = {} if done is None else done
    tokens, seconds, num, decoded = {}, 0.0, 0, 0
    for call in calls:
        key = tuple(tuple(records[i]["turns"][j]["prompt_ids"]) for i, j in call["turns"])
        if key not in done:
            outputs, s, _ = engine.generate([list(c) for c in key], params)
            done[key] = ([o["tokens"] for o in outputs], s)
            decoded += 1
        outputs, s = done[key]
        tokens.update(zip(call["turns"], outputs))
        seconds += s
        num += sum(len(o) for o in outputs)
    return {"tokens": tokens, "seconds": seconds, "num_tokens": num, "calls_decoded": decoded}


def summarize(records: list[dict], calls: list[dict], plain: dict, k: int, batch_size: int,
              temperature: float) -> dict:
    """The headline figures of one benchmark and chain length, named as eyas eval names them."""
    drafts = sum(c["drafts"] for c in calls)
    accepted = sum(c["accepted"] for c in calls)
    per_position = [sum(c["per_position"][p] for c in calls) for p in range(k)]
    tokens, seconds = sum(c["num_tokens"] for c in calls), sum(c["seconds"] for c in calls)
    per_request = None
    turns = [t for r in records for t in r["turns"]]
    if turns and all("accepted" in t for t in turns):  # vLLM reported each request's cycles
        if sum(t["num_cycles"] for t in turns) != drafts or sum(sum(t["accepted"]) for t in turns) != accepted:
            warn(f"vLLM's per-request acceptance ({sum(t['num_cycles'] for t in turns)} cycles) disagrees with its "
                 f"counters ({drafts} drafts); tau is the counters'")
        mine = [[a for t in r["turns"] for a in t["accepted"]] for r in records]
        taus = [1 + sum(a) / len(a) for a in mine if a]
        per_request = sum(taus) / len(taus) if taus else 0.0
    reached = [drafts, *per_position]
    summary = {
        "engine": "vllm", "batch_size": batch_size, "num_requests": len(records), "num_tokens": tokens,
        "num_cycles": drafts, "num_accepted": accepted,
        "tau_pooled": 1 + accepted / drafts if drafts else 0.0, "tau_per_request": per_request,
        "accepted_per_position": per_position,
        "accept_at_position": [n / drafts if drafts else 0.0 for n in per_position],
        "accept_at_position_conditional": [reached[p + 1] / reached[p] if reached[p] else 0.0 for p in range(k)],
        "total_s": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
        "plain_total_s": plain["seconds"], "plain_num_tokens": plain["num_tokens"],
        "plain_tokens_per_s": plain["num_tokens"] / plain["seconds"] if plain["seconds"] else 0.0,
    }
    summary["speedup_vs_plain"] = (summary["tokens_per_s"] / summary["plain_tokens_per_s"]
                                   if summary["plain_tokens_per_s"] else 0.0)
    if temperature == 0:
        differ = {(i, j) for i, r in enumerate(records) for j, t in enumerate(r["turns"])
                  if plain["tokens"].get((i, j)) != t["tokens"]}
        summary["plain_mismatches"] = len(differ)  # turns, as eyas eval counts them
        summary["plain_mismatched_requests"] = len({i for i, _ in differ})
    return summary


def format_table(rows: list[tuple[str, str, dict]]) -> str:
    head = f"{'bench':<14} {'setting':<14} {'tau':>5} {'accept by position':<24} {'tok/s':>8} {'plain':>8} " \
           f"{'speedup':>7} {'differ':>6}"
    lines = [head]
    for bench, name, s in rows:
        pos = " ".join(f"{x:.2f}" for x in s["accept_at_position"])
        differ = s.get("plain_mismatched_requests")
        lines.append(f"{bench:<14} {name:<14} {s['tau_pooled']:>5.2f} {pos:<24} {s['tokens_per_s']:>8.1f} "
                     f"{s['plain_tokens_per_s']:>8.1f} {s['speedup_vs_plain']:>6.2f}x "
                     f"{'-' if differ is None else differ:>6}")
    return "\n".join(lines)


def _check_fits(meta: dict, target, draft) -> None:
    from eyas.identity import check_target

    dc = meta["draft_config"]
    if dc["hidden_size"] != target.hidden_size or dc["vocab_size"] != target.vocab_size:
        raise EyasError(f"draft {draft} was built for hidden size {dc['hidden_size']} and vocab {dc['vocab_size']}, "
                        f"the target {target.name} has {target.hidden_size} and {target.vocab_size}; "
                        f"pass the draft's own target with --target")
    check_target(meta.get("target"), target.identity, what=f"the draft {draft}",
                 fix="pass the draft's own target with --target")


def run(cfg, draft: str | Path, settings: list[tuple[str, dict]], result_path, *, batch_size: int = 1,
        started: float | None = None) -> dict:
    """Every benchmark of cfg.eval with every chain setting through vLLM -> RESULT.json at
    `result_path(bench name, setting)` and summary.json beside it; -> {bench name: {setting: summary}}.
    One engine per chain length, then one plain engine for all benchmarks."""
    from eyas.data.template import stop_token_ids
    from eyas.speculative.bench import bench_name, encode_turn, load_bench
    from eyas.stages.eval import update_summary
    from eyas.target import load_target
    from eyas.target.vllm.capture import engine_dtype, model_dir
    from eyas.target.vllm.engine import require_vllm

    started = time.perf_counter() if started is None else started
    require_vllm()
    trees = [name for name, s in settings if "steps" not in s]
    if trees or not settings:
        raise EyasError(f"--engine vllm measures chains only (settings {trees or 'none'} given); trees are eyas-only: "
                        f"drop --tree or use --engine eyas")
    if batch_size < 1:
        raise EyasError(f"--batch-size {batch_size}: give at least 1")
    dtype = engine_dtype(cfg)
    # the tokenizer, the identity and the directory vLLM loads: the decoder layers stay unread (vLLM loads them)
    target = load_target(cfg.target.model, device="cpu", dtype=dtype, trust_remote_code=cfg.target.trust_remote_code,
                         weights="head")
    model, tok = model_dir(target), target.tokenizer
    eos = stop_token_ids(tok, getattr(target.model, "generation_config", None))
    params = sampling(cfg.eval.temperature, cfg.eval.max_new_tokens, eos)
    kwargs = cfg.data.chat_template_kwargs
    benches = {bench_name(b): load_bench(b, cfg.eval.limit) for b in cfg.eval.benches}
    hello = [encode_turn(tok, [{"role": "user", "content": "Say hello."}], kwargs)]
    warm = sampling(0.0, 8, eos)
    print0(f"target {target.name} (vLLM, {dtype}) | draft {draft} | chains {', '.join(n for n, _ in settings)} | "
           f"batch size {batch_size} | temperature {cfg.eval.temperature} | max new tokens {cfg.eval.max_new_tokens}")
    spec, wall = {}, {}
    with tempfile.TemporaryDirectory(prefix="eyas-vllm-draft-") as tmp:
        draft_dir, meta = served_draft(draft, Path(tmp))
        served = "a temporary vllm export" if Path(tmp).resolve() in draft_dir.resolve().parents else str(draft_dir)
        _check_fits(meta, target, draft)
        for name, setting in settings:
            t0 = time.perf_counter()
            with ServingEngine(model, dtype=dtype, engine=cfg.target.engine, draft_dir=draft_dir,
                               k=setting["steps"]) as engine:
                engine.generate(hello, warm)
                spec[name] = {b: decode_bench(engine, tok, reqs, batch_size, params, kwargs)
                              for b, reqs in benches.items()}
            wall[name] = time.perf_counter() - t0
    plain: dict = {}  # {setting: {bench: replay}}, each setting's own contexts in its own batches
    with ServingEngine(model, dtype=dtype, engine=cfg.target.engine) as engine:
        engine.generate(hello, warm)
        done = {b: {} for b in benches}
        for name, _ in settings:
            t0 = time.perf_counter()
            plain[name] = {b: replay(engine, *spec[name][b], params, done[b]) for b in benches}
            wall[name] += time.perf_counter() - t0
    about = {"engine": "vllm", "batch_size": batch_size, "temperature": cfg.eval.temperature,
             "max_new_tokens": cfg.eval.max_new_tokens, "limit": cfg.eval.limit, "target": target.identity,
             "dtype": dtype, "target_engine": cfg.target.engine, "draft": str(draft), "served_draft": served,
             "aux_layers": meta.get("aux_layers"), "vllm_version": _vllm_version(),
             **({"chat_template_kwargs": kwargs} if kwargs else {})}
    results, rows = {}, []
    for bench in benches:
        summaries, paths = {}, {}
        for name, setting in settings:
            records, calls = spec[name][bench]
            summary = summarize(records, calls, plain[name][bench], setting["steps"], batch_size,
                                cfg.eval.temperature)
            summary["wall_s"] = wall[name] / len(benches)
            path = Path(result_path(bench, name))
            _write_result(path, {"bench": bench, "setting": name, "steps": setting["steps"], **about}, summary,
                          records, calls)
            summaries[name], paths[(bench, name)] = summary, (path, path.with_suffix(".png"))
            rows.append((bench, name, summary))
        started = update_summary(bench, summaries, paths, cfg, str(draft), started)
        results[bench] = summaries
    print0(format_table(rows))
    if any(r[2].get("plain_mismatched_requests") for r in rows):
        print0("  warning: some requests differ from plain greedy decoding in vLLM (expected 0 in fp32; low "
               "precision and batching can flip near-ties)")
    print0(f"results: {', '.join(str(p) for p in (result_path(b, n) for b, n, _ in rows))}")
    return results


def _write_result(path: Path, settings: dict, summary: dict, records: list[dict], calls: list[dict]) -> None:
    """RESULT.json in eval's layout (settings, summary, prompts) plus each generate call, and its plot."""
    from eyas.common import atomic_write_json
    from eyas.speculative.stats import plot_acceptance

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"engine": "vllm", "settings": settings, "summary": summary,
                             "calls": [{**c, "turns": [list(t) for t in c["turns"]]} for c in calls],
                             "prompts": records})
    if summary["tau_per_request"] is not None:  # the plot's title names it
        plot_acceptance(summary, f"{settings['bench']} {settings['setting']} (vLLM)", path.with_suffix(".png"))


def _vllm_version() -> str:
    import vllm

    return vllm.__version__
