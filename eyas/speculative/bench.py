"""Benchmarks: MT-bench, HumanEval or a user JSONL, through the engine, with baselines and results.

Drafts of either method (EAGLE-3, DFlash: `method` in each result and its summary); a DFlash draft runs
chains only (`block_settings`).

A benchmark is a list of requests `{"id", "turns": [user message, ...]}`. Each turn is encoded with
the chat template over the conversation so far, whose assistant turns are the model's own answers
(MT-bench's second turn follows the first answer). The same contexts, each setting's own, are then decoded
by plain decoding in the same engine and by transformers `generate`, after a warm-up, for the speedups.
At temperature 0 the speculative tokens must equal plain decoding's; mismatches are counted, and for each
differing turn the first differing position and the plain path's top-2 logit margin there are recorded
(`plain_divergence`), with their distribution in the summary.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from eyas.common import EyasError, atomic_write_json, print0, progress, sha256_json
from eyas.speculative.engine import SpecEngine
from eyas.speculative.stats import (first_difference, format_margins, format_summary, is_near_tie, logit_steps,
                                    margin_summary, ngram_summary, plot_acceptance, repeat_summary, summarize)

BUILTIN = ("mt-bench", "mt-bench-1", "humaneval")  # mt-bench-1: the 80 first turns alone


def bench_name(bench: str) -> str:
    return bench if bench in BUILTIN else Path(bench).stem


def load_bench(bench: str, limit: int = 0) -> list[dict]:
    """-> [{"id": str, "turns": [str, ...]}] for a built-in benchmark name or a JSONL file."""
    if bench in ("mt-bench", "mt-bench-1"):
        from eyas.data.benchmarks import mtbench_questions

        keep = 1 if bench == "mt-bench-1" else None
        items = [{"id": q["id"], "turns": list(q["turns"])[:keep]} for q in mtbench_questions()]
    elif bench == "humaneval":
        from eyas.data.benchmarks import humaneval_prompts

        items = [{"id": q["id"], "turns": [q["prompt"]]} for q in humaneval_prompts()]
    else:
        items = _read_jsonl(Path(bench))
    return items[:limit] if limit else items


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise EyasError(f"--bench {path}: not mt-bench, mt-bench-1, humaneval or an existing JSONL file")
    items = []
    with open(path, encoding="utf-8") as f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{num}"
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise EyasError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(rec, dict):
                raise EyasError(f"{where}: expected a JSON object with id and prompt or conversations/messages")
            turns = _user_turns(rec, where)
            items.append({"id": str(rec.get("id", num)), "turns": turns})
    if not items:
        raise EyasError(f"{path}: no prompts in the file")
    return items


def _user_turns(rec: dict, where: str) -> list[str]:
    if isinstance(rec.get("prompt"), str):
        return [rec["prompt"]]
    msgs = rec.get("conversations", rec.get("messages"))
    if not isinstance(msgs, list):
        raise EyasError(f"{where}: needs a string 'prompt' or a list 'conversations'/'messages'")
    turns = []
    for m in msgs:
        role = m.get("role", m.get("from")) if isinstance(m, dict) else None
        text = m.get("content", m.get("value")) if isinstance(m, dict) else None
        if role in ("user", "human") and isinstance(text, str):
            turns.append(text)
    if not turns:
        raise EyasError(f"{where}: the conversation has no user turn")
    return turns


def encode_turn(tokenizer, history: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation ending with a user turn, ready for the assistant's answer;
    `chat_template_kwargs`: the template's variables (data.chat_template_kwargs, as the data was prepared)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                            **(chat_template_kwargs or {}))
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    text = "\n\n".join(m["content"] for m in history) + "\n\n"
    return tokenizer(text)["input_ids"]


def parse_tree(tree: str | None):
    return tuple(int(x) for x in tree.split(",")) if tree else None


def settings_of(steps: list[int], tree: str | None) -> list[tuple[str, dict]]:
    out = [(f"chain-{k}", {"steps": k}) for k in steps]
    if tree:
        out.append(("tree-" + "x".join(tree.split(",")), {"tree": parse_tree(tree)}))
    return out


def block_settings(settings: list[tuple[str, dict]], block_size: int) -> list[tuple[str, dict]]:
    """The settings a DFlash draft of `block_size` can run: the chains of at most block_size - 1 guesses, plus
    that chain itself (the draft's natural block), shortest first; what is dropped is said in one line each."""
    natural = block_size - 1
    kept = []
    for name, setting in settings:
        if "tree" in setting:
            print0(f"{name}: skipped, a DFlash draft proposes one chain per cycle (its block); DFlash defines no tree")
        elif setting["steps"] > natural:
            print0(f"{name}: skipped, a DFlash draft of block_size {block_size} guesses at most {natural} tokens "
                   f"per cycle")
        else:
            kept.append((name, setting))
    if all(setting["steps"] != natural for _, setting in kept):
        kept.append((f"chain-{natural}", {"steps": natural}))
    return sorted(kept, key=lambda s: s[1]["steps"])


def _generator(engine, seed: int):
    import torch

    return torch.Generator(device=engine.device).manual_seed(seed)


class RequestJournal:
    """The finished requests of one benchmark setting, one JSON line each, beside its result
    (RESULT.requests.jsonl): an eval that is killed or runs out of time keeps what it decoded, and a
    rerun with the same settings (same key: benchmark, setting, target, draft weights, limits) decodes
    only the rest. Lines of another key are ignored. Removed once the result JSON is written.
    At temperature > 0 a resumed run draws the remaining requests from a fresh generator.
    """

    def __init__(self, path: Path, key: str):
        from eyas.data.regenerate import ResultsFile, read_results

        self.path, self.key = Path(path), key
        self.done = {i: r for i, r in read_results(self.path).items() if r.get("key") == key}
        self.sink = ResultsFile(self.path)

    def add(self, slot: str, record: dict, stats: dict) -> None:
        self.sink.append([{"id": slot, "key": self.key, "record": record, "stats": stats}])

    def finish(self) -> None:
        self.sink.close()
        self.path.unlink(missing_ok=True)


def run_spec(engine: SpecEngine, tokenizer, requests: list[dict], setting: dict, temperature: float,
             max_new_tokens: int, eos: list[int], seed: int = 0, desc: str = "",
             journal: RequestJournal | None = None,
             chat_template_kwargs: dict | None = None) -> tuple[list[dict], list[dict]]:
    """-> (per-request records for the JSON, per-request stats for `summarize`); requests already in
    `journal` are taken from it, new ones are added to it as they finish."""
    gen = _generator(engine, seed)
    records, stats = [], []
    resumed = 0
    for i, req in enumerate(progress(requests, desc=desc, unit="req")):
        slot = f"{i}:{req['id']}"  # ids of a user's file may repeat; positions do not
        if journal is not None and slot in journal.done:
            records.append(journal.done[slot]["record"])
            stats.append(journal.done[slot]["stats"])
            resumed += 1
            continue
        history, turns = [], []
        st = {"accepted": [], "num_tokens": 0, "draft_s": 0.0, "verify_s": 0.0, "prefill_s": 0.0, "total_s": 0.0}
        for text in req["turns"]:
            history.append({"role": "user", "content": text})
            ids = encode_turn(tokenizer, history, chat_template_kwargs)
            res = engine.generate(ids, max_new_tokens, temperature=temperature, eos_token_ids=eos, generator=gen,
                                  **setting)
            answer = tokenizer.decode(res.tokens, skip_special_tokens=True)
            history.append({"role": "assistant", "content": answer})
            turns.append({"prompt_ids": ids, "tokens": res.tokens, "text": answer, "num_cycles": res.num_cycles,
                          "accepted": res.accepted_per_cycle})
            st["accepted"] += res.accepted_per_cycle
            st["num_tokens"] += len(res.tokens)
            for k in ("draft_s", "verify_s", "prefill_s", "total_s"):
                st[k] += getattr(res, k)
        records.append({"id": req["id"], "turns": turns})
        stats.append(st)
        if journal is not None:
            journal.add(slot, records[-1], st)
    if resumed:
        print0(f"{desc}: {resumed} of {len(requests)} requests taken from {journal.path.name} (an earlier, "
               f"interrupted run with the same settings)")
    return records, stats


class Baselines:
    """Plain decoding (same engine) and transformers generate on the contexts of a setting's turns, each context
    decoded once per benchmark. A later setting's turns may have other contexts (MT-bench's second turn follows
    that setting's own first answer, which may differ by a near-tie in low precision): those are decoded too, so
    each setting is compared, timed and given its n-gram baseline on its own contexts, never another's."""

    def __init__(self, engine: SpecEngine, model, temperature: float, max_new_tokens: int, eos: list[int],
                 hf: bool = True, pad_id=None, seed: int = 0):
        self.engine, self.model, self.hf, self.pad_id = engine, model, hf, pad_id
        self.temperature, self.max_new_tokens, self.eos = temperature, max_new_tokens, eos
        self.gen = _generator(engine, seed)
        self.plain: dict[tuple, tuple[list[int], float]] = {}  # context -> (tokens, seconds)
        self.generate: dict[tuple, tuple[int, float]] = {}  # context -> (new tokens, seconds)

    def of(self, records: list[dict]) -> dict:
        """-> {"plain_tokens" (one list per turn, in order), "plain_tokens_per_s", "plain_total_s",
        "plain_num_tokens", "plain_contexts_decoded" (new for this call), and hf_* likewise with `hf`}."""
        contexts = [tuple(t["prompt_ids"]) for r in records for t in r["turns"]]
        new = list(dict.fromkeys(c for c in contexts if c not in self.plain))
        for ids in progress(new, desc="plain decoding", unit="turn"):
            res = self.engine.plain_generate(list(ids), self.max_new_tokens, temperature=self.temperature,
                                             eos_token_ids=self.eos, generator=self.gen)
            self.plain[ids] = (res.tokens, res.total_s)
        plain = [self.plain[c] for c in contexts]
        n, sec = sum(len(t) for t, _ in plain), sum(s for _, s in plain)
        out = {"plain_tokens": [t for t, _ in plain], "plain_tokens_per_s": n / sec if sec else 0.0,
               "plain_total_s": sec, "plain_num_tokens": n, "plain_contexts_decoded": len(new)}
        if self.hf:
            self._hf_generate([c for c in dict.fromkeys(contexts) if c not in self.generate])
            n, sec = sum(self.generate[c][0] for c in contexts), sum(self.generate[c][1] for c in contexts)
            out.update(hf_tokens_per_s=n / sec if sec else 0.0, hf_total_s=sec, hf_num_tokens=n)
        return out

    def _hf_generate(self, contexts: list[tuple]) -> None:
        import torch

        kwargs = dict(do_sample=self.temperature > 0, max_new_tokens=self.max_new_tokens,
                      eos_token_id=self.eos or None, pad_token_id=self.pad_id)
        if self.temperature > 0:
            kwargs.update(temperature=self.temperature, top_k=0, top_p=1.0)
        for ids in progress(contexts, desc="transformers generate", unit="turn"):
            x = torch.tensor([list(ids)], device=self.engine.device)
            self.engine._sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                y = self.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            self.engine._sync()
            self.generate[ids] = (y.shape[1] - x.shape[1], time.perf_counter() - t0)


def plain_divergence(model, device, prompt_ids: list[int], plain: list[int], tokens: list[int]) -> dict | None:
    """Where a greedy turn's tokens first differ from plain decoding's, and how close the plain path's choice
    was there: None for an equal turn, else {"position" (in the answer), "plain_token", "spec_token" (None past
    the end of either), "margin" (its top-1 minus top-2 logit), "top_logit", "plain_is_top1", "spec_token_rank"
    (1 = the target's top-1), "near_tie"}. The logits come from one teacher-forced forward of the target over the
    context and the plain answer's first `position` tokens (not the incremental pass that decoded it, so a tiny
    rounding difference from that pass is possible: `plain_is_top1` says whether they agree)."""
    import torch

    i = first_difference(tokens, plain)
    if i is None:
        return None
    spec_token = tokens[i] if i < len(tokens) else None
    out = {"position": i, "plain_token": plain[i] if i < len(plain) else None, "spec_token": spec_token}
    try:
        with torch.no_grad():
            x = torch.tensor([list(prompt_ids) + list(plain[:i])], device=device)
            raw = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1]  # [V], the target's dtype
            logits = raw.float()
    except (AttributeError, TypeError, RuntimeError) as e:  # a target without an HF forward: position only
        return {**out, "margin": None, "error": f"{type(e).__name__}: {e}"[:200]}
    top = logits.topk(2)
    margin, top_logit = float(top.values[0] - top.values[1]), float(top.values[0])
    out.update(margin=margin, top_logit=top_logit,
               margin_steps=logit_steps(margin, top_logit, torch.finfo(raw.dtype).eps),
               plain_is_top1=out["plain_token"] == int(top.indices[0]) if out["plain_token"] is not None else None,
               spec_token_rank=int((logits > logits[spec_token]).sum()) + 1 if spec_token is not None else None,
               near_tie=is_near_tie(margin, top_logit))
    return out


def warm_up(engine: SpecEngine, model, tokenizer, settings, eos, hf: bool,
            chat_template_kwargs: dict | None = None) -> None:
    import torch

    ids = encode_turn(tokenizer, [{"role": "user", "content": "Say hello."}], chat_template_kwargs)
    for _, setting in settings:
        engine.generate(ids, 8, eos_token_ids=eos, **setting)
    engine.plain_generate(ids, 8, eos_token_ids=eos)
    if hf:
        with torch.no_grad():
            x = torch.tensor([ids], device=engine.device)
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False)


def bench_one(engine, target, bench: str, settings, temperature: float, max_new_tokens: int, limit: int,
              out_paths: dict, hf: bool = True, extra_settings: dict | None = None,
              chat_template_kwargs: dict | None = None, baselines: dict | None = None) -> dict:
    """Run every setting on one benchmark; write JSON and PNG per setting. -> {setting: summary}; each
    summary's `wall_s` covers that setting and the baseline contexts it added (Baselines).
    `chat_template_kwargs` render the prompts as the data was prepared (data.chat_template_kwargs).
    `baselines`: a dict kept across calls for one benchmark (another draft's eval of it against the same target):
    its Baselines, made on the first call, is reused, so a context already decoded plainly is not decoded again
    and every draft is timed against the same plain runs; new contexts are decoded by this call's engine."""
    from eyas.data.template import stop_token_ids

    tok = target.tokenizer
    eos = stop_token_ids(tok, getattr(target.model, "generation_config", None))
    requests = load_bench(bench, limit)
    method = getattr(engine, "method", None) or "eagle3"
    warm_up(engine, target.model, tok, settings, eos, hf, chat_template_kwargs)
    shared = {} if baselines is None else baselines
    if "baselines" not in shared:
        shared["baselines"] = Baselines(engine, target.model, temperature, max_new_tokens, eos, hf=hf,
                                        pad_id=tok.pad_token_id)
    baselines, summaries = shared["baselines"], {}
    baselines.engine = engine  # plain decoding is the target's alone; the current engine runs what is new
    for name, setting in settings:
        started = time.perf_counter()
        depth = setting.get("steps") or setting["tree"][1]
        run_settings = {"bench": bench, "setting": name, **{k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in setting.items()},
                        "temperature": temperature, "max_new_tokens": max_new_tokens, "limit": limit,
                        "target": target.identity, "device": str(engine.device), "dtype": str(target.dtype),
                        # how this setting was decoded (part of the journal's key: requests decoded another way
                        # are not mixed in); greedy trees were eager before they were graphed
                        "decoding": "cuda-graphs" if engine.static and temperature == 0 else "eager",
                        "host": platform.node(), **(extra_settings or {}),
                        **({"chat_template_kwargs": chat_template_kwargs} if chat_template_kwargs else {})}
        json_path, png_path = out_paths[(bench, name)]
        journal = RequestJournal(json_path.with_name(json_path.stem + ".requests.jsonl"),
                                 sha256_json({k: v for k, v in run_settings.items() if k != "host"})[:16])
        records, stats = run_spec(engine, tok, requests, setting, temperature, max_new_tokens, eos,
                                  desc=f"{bench_name(bench)} {name}", journal=journal,
                                  chat_template_kwargs=chat_template_kwargs)
        baseline = baselines.of(records)  # plain decoding of this setting's own contexts
        summary = summarize(stats, depth)
        summary["speedup_vs_plain"] = summary["tokens_per_s"] / baseline["plain_tokens_per_s"]
        summary["plain_tokens_per_s"] = baseline["plain_tokens_per_s"]
        if hf:
            summary["hf_tokens_per_s"] = baseline["hf_tokens_per_s"]
            summary["speedup_vs_hf"] = summary["tokens_per_s"] / baseline["hf_tokens_per_s"]
        turns = [t for r in records for t in r["turns"]]
        summary.update(repeat_summary(turns))  # how much of tau comes from the target repeating itself
        if temperature == 0:
            summary["plain_mismatches"] = sum(t["tokens"] != p for t, p in zip(turns, baseline["plain_tokens"]))
            divergences = []
            for t, p in zip(turns, baseline["plain_tokens"]):  # per differing turn, in the result JSON too
                if t["tokens"] != p:
                    t["divergence"] = plain_divergence(target.model, engine.device, t["prompt_ids"], p, t["tokens"])
                    divergences.append(t["divergence"])
            summary["plain_mismatch_margins"] = margin_summary(divergences)
            summary.update(ngram_summary(turns, baseline["plain_tokens"], depth))  # what copying alone gives
        summary["wall_s"] = time.perf_counter() - started  # this setting's decoding and the baselines it ran
        for r in records:  # the context ids stay in the file: with them anyone can re-run plain decoding
            for t in r["turns"]:
                t["num_prompt_tokens"] = len(t["prompt_ids"])
        summary["method"] = method
        result = {
            "method": method,
            "settings": run_settings,
            "summary": summary,
            "baseline": {k: v for k, v in baseline.items() if k != "plain_tokens"},
            "prompts": records,
        }
        atomic_write_json(json_path, result)
        journal.finish()
        plot_acceptance(summary, f"{bench_name(bench)} {name}", png_path)
        print0(format_summary(f"{bench_name(bench)} {name}", summary))
        if summary.get("plain_mismatches"):
            print0(f"  warning: {summary['plain_mismatches']} turns differ from plain greedy decoding "
                   f"(expected 0 in fp32; low precision can flip near-ties)")
            print0(format_margins(summary["plain_mismatch_margins"]))
        summaries[name] = summary
    return summaries
