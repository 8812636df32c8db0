"""`prepare`: conversations -> (optionally regenerated) -> token ids + loss masks -> dataset + vocab.

Writes OUT/dataset/ (HF Arrow), OUT/vocab.safetensors and, last, OUT/prepare.json: a directory
with prepare.json is complete. Regeneration results live in OUT/regen-<settings hash>.jsonl and
survive a crash, so a rerun continues where it stopped.

Length policy: the default is `drop` (data.on_long): a truncated sample trains the draft on a
response without its end-of-turn token, and keeping the data clean costs only the long tail.
`truncate` keeps the first max_length tokens if any assistant token is left.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections import Counter
from pathlib import Path

from eyas.common import EyasError, atomic_write_json, print0, sha256_json
from eyas.config import RunConfig
from eyas.data.readers import EDITS, REASONS, Conversation, Skip, read_sources
from eyas.data.regenerate import answers, pending, read_results, repeated_tail, repetition
from eyas.data.template import ChatTemplate, ResponseRewritten, TemplateMismatch, stop_token_ids
from eyas.ownership import claim

CHUNK = 512  # conversations per batched tokenizer call
# skip reasons of the tokenizing step, besides those of the readers
TOKENIZE_REASONS = {
    "template_rewrites_response": "the chat template does not render the regenerated response as the target wrote "
                                  "it (e.g. it adds or drops a <think> block); set data.chat_template_kwargs as the "
                                  "responses were generated (e.g. {enable_thinking: false} for a server that does "
                                  "not think), or give the target a template that renders its responses verbatim",
    "repetition_loop": "the regenerated answer ends in a repetition loop and data.regen_loops=drop; "
                       "data.regen_loops=keep trains on it as written, mask keeps it as context only",
}
SKIP_REASONS = {**REASONS, **TOKENIZE_REASONS}


class _Report:
    """Counts per skip reason and the first place each one happened."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.first: dict[str, str] = {}
        self.details: dict[str, str] = {}

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        assert reason in SKIP_REASONS, reason
        self.counts[reason] += 1
        if reason not in self.first:
            self.first[reason] = where
            self.details[reason] = detail

    def line(self) -> str:
        def first(r: str) -> str:
            detail = self.details[r]
            return f"{self.first[r]}: {detail[:200]}" if detail else self.first[r]

        return "; ".join(f"{r}: {n} (first at {first(r)})" for r, n in sorted(self.counts.items()))


def _extra_stop_ids(tokenizer, tokens: list[str]) -> list[int]:
    """data.stop_tokens as ids; each must be one token of the target's vocabulary."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise EyasError(f"data.stop_tokens: {missing} are not single tokens of the target's tokenizer; give tokens "
                        f"such as {tokenizer.eos_token!r} exactly as the tokenizer spells them")
    return [int(vocab[t]) for t in tokens]


def _strict_check(cfg: RunConfig, report: _Report) -> None:
    if cfg.data.strict and report.counts:
        raise EyasError(f"--strict: {sum(report.counts.values())} record(s) would be skipped: {report.line()}")


def _load_conversations(cfg: RunConfig, report: _Report) -> tuple[list[Conversation], dict]:
    dc = cfg.data
    if dc.data:
        convs, repaired = [], Counter()
        for item in read_sources(dc.data, dc.format, need_assistant=dc.regenerate is None,
                                 max_record_mb=dc.max_record_mb):
            if isinstance(item, Skip):
                report.skip(item.reason, item.where, item.detail)
            else:
                convs.append(item)
                repaired.update(item.edits)
        # records kept with a repair (readers.EDITS): counted, so that none goes unnoticed
        return convs, {"kind": "files", "paths": list(dc.data), "format": dc.format,
                       "repaired": {EDITS[e]: n for e, n in sorted(repaired.items())}}
    from eyas.data.corpus import default_prompts

    if not dc.regenerate:
        raise EyasError("the built-in corpus holds prompts only; add --regenerate local (or a server URL), "
                        "or give conversations with --data")
    if dc.num_prompts == 0 and dc.self_prompts == 0:
        raise EyasError("data.num_prompts=0 and data.self_prompts=0 leave nothing to train on; give --data, "
                        "--num-prompts N or --self-prompts N")

    prompts = default_prompts(dc.num_prompts, dc.seed) if dc.num_prompts else []
    if len(prompts) < dc.num_prompts:
        print0(f"the built-in corpus holds {len(prompts)} prompts; data.num_prompts={dc.num_prompts} asked for more")
    convs = [Conversation(p["id"], [{"role": "user", "content": p["prompt"]}], f"builtin:{p['id']}")
             for p in prompts]
    digest = hashlib.sha256("\n".join(p["prompt"] for p in prompts).encode()).hexdigest()[:16]
    return convs, {"kind": "builtin-corpus", "num_prompts": len(prompts), "seed": dc.seed, "corpus_hash": digest}


def _results_file(out: Path, prefix: str, cfg: RunConfig, template: ChatTemplate, settings: dict) -> tuple[dict, Path]:
    """(settings, OUT/PREFIX-<settings hash>.jsonl): the append-only results file of a generation with these
    settings, which a rerun with the same settings resumes. Extra stop tokens and chat template variables
    join the settings only when set, so that results files of earlier runs keep their names."""
    if cfg.data.stop_tokens:
        settings = {**settings, "stop_ids": template.stop_ids}
    if cfg.data.chat_template_kwargs:
        settings = {**settings, "chat_template_kwargs": cfg.data.chat_template_kwargs}
    return settings, out / f"{prefix}-{sha256_json(settings)[:12]}.jsonl"


def _self_prompts(cfg: RunConfig, target, template: ChatTemplate, out: Path) -> tuple[list[Conversation], dict]:
    """data.self_prompts user requests written by the target (eyas/data/self_prompts.py), as conversations."""
    from eyas.data.self_prompts import write_self_prompts

    dc = cfg.data
    if not dc.regenerate:
        raise EyasError("data.self_prompts: the target's own prompts have no responses yet; add --regenerate local "
                        "(or a server URL)")
    # only when set: earlier runs' files keep their names; "share_of" since the share is of the kept requests
    steer = {"openers": dc.self_prompt_openers, "opener_share": dc.self_prompt_opener_share, "share_of": "kept"} \
        if dc.self_prompt_openers else {}
    settings, path = _results_file(out, "self-prompts", cfg, template,
                                   {"target": target.identity, "temperature": dc.self_prompt_temperature,
                                    "max_new_tokens": dc.self_prompt_max_tokens, "seed": dc.seed, **steer})
    try:
        prompts, summary = write_self_prompts(target, template, dc.self_prompts, path,
                                              temperature=dc.self_prompt_temperature,
                                              max_new_tokens=dc.self_prompt_max_tokens,
                                              batch_size=dc.regen_batch_size, seed=dc.seed,
                                              cuda_graphs=dc.regen_cuda_graphs, openers=dc.self_prompt_openers,
                                              opener_share=dc.self_prompt_opener_share)
    except ValueError as e:
        raise EyasError(f"data.self_prompts: {e}") from None
    convs = [Conversation(p["id"], [{"role": "user", "content": p["prompt"]}], f"{path.name}:{p['id']}")
             for p in prompts]
    return convs, {**summary, "file": path.name, "settings": settings}


def _regenerate(cfg: RunConfig, target, template: ChatTemplate, convs: list[Conversation], out: Path,
                report: _Report, engine=None) -> tuple[list[Conversation], dict]:
    """Replace the last assistant turn of each conversation by the target's own response.

    Earlier assistant turns of a multi-turn conversation stay as given (and are trained on): each
    turn regenerated in sequence would cost one generation per turn for a small gain.
    """
    dc = cfg.data
    prompts = []
    for c in convs:
        msgs = c.messages[:-1] if c.messages[-1]["role"] == "assistant" else c.messages
        prompts.append({"id": c.sample_id, "messages": msgs})
    through = {"backend": "vllm"} if dc.regenerate == "local" and cfg.target.backend == "vllm" else {}
    settings, path = _results_file(out, "regen", cfg, template,
                                   {"target": target.identity, "mode": dc.regenerate,
                                    "max_new_tokens": dc.regen_max_new_tokens, "temperature": dc.regen_temperature,
                                    "seed": dc.seed, **through})
    todo_ids = {p["id"] for p in pending(prompts, read_results(path))}  # a resumed run generates only these
    t0 = time.perf_counter()
    if through:
        from eyas.data.regenerate import regenerate_engine

        if engine is None:
            raise EyasError("target.backend=vllm regenerates through a vLLM engine, and none was given")
        results = regenerate_engine(engine, target.tokenizer, prompts, path, template=template,
                                    max_new_tokens=dc.regen_max_new_tokens, temperature=dc.regen_temperature,
                                    seed=dc.seed, chunk=max(64, dc.regen_batch_size))
    elif dc.regenerate == "local":
        from eyas.data.regenerate import regenerate_local

        results = regenerate_local(target, prompts, path, template=template, max_new_tokens=dc.regen_max_new_tokens,
                                   temperature=dc.regen_temperature, batch_size=dc.regen_batch_size, seed=dc.seed,
                                   threads=dc.regen_threads, cuda_graphs=dc.regen_cuda_graphs)
    else:
        from eyas.data.endpoint import regenerate_endpoint

        results = regenerate_endpoint(dc.regenerate, prompts, path, max_new_tokens=dc.regen_max_new_tokens,
                                      temperature=dc.regen_temperature, concurrency=dc.regen_concurrency,
                                      timeout_s=dc.regen_timeout_s, retries=dc.regen_retries,
                                      stop_token_ids=template.stop_ids if dc.stop_tokens else None,
                                      chat_template_kwargs=dc.chat_template_kwargs or None)
    seconds = time.perf_counter() - t0
    kept, num_masked_loops = [], 0
    for c, p in zip(convs, prompts):
        rec = results.get(c.sample_id)
        if not answers(rec, p["messages"]):
            rec = None  # none, or an answer to an earlier version of this prompt that this run failed to replace
        if rec is None or not str(rec.get("response", "")).strip():
            report.skip("regeneration_failed", c.where, "no response" if rec is None else "empty response")
            continue
        response, loss_chars = str(rec["response"]), None
        tail = repeated_tail(response) if dc.regen_loops != "keep" else 0
        if tail and dc.regen_loops == "drop":
            report.skip("repetition_loop", c.where, f"its last {tail} of {len(response)} characters repeat")
            continue
        if tail:  # mask: what precedes the loop and its first copy count in the loss
            loss_chars = len(response) - tail
            num_masked_loops += 1
        elif rec.get("finish") == "length":  # cut by the token cap: the target did not end its turn there, so the
            loss_chars = len(response)  # end of turn the template adds is context, not something to predict
        kept.append(Conversation(c.sample_id, p["messages"] + [{"role": "assistant", "content": response}],
                                 c.where, loss_chars=loss_chars))
    num_tokens = sum(int(results[c.sample_id].get("num_tokens") or 0) for c in kept)
    fresh = [results[p["id"]] for p in prompts if p["id"] in todo_ids and answers(results.get(p["id"]), p["messages"])]
    new_tokens = sum(int(r.get("num_tokens") or 0) for r in fresh)
    finishes = Counter(str(results[c.sample_id].get("finish")) for c in kept)
    # data.regen_loops=keep trains on loops as written (the target loops in decoding too): they are counted
    loops = repetition(results[c.sample_id] for c in kept)
    loops.update(policy=dc.regen_loops, masked_responses=num_masked_loops,
                 dropped_responses=report.counts.get("repetition_loop", 0))
    return kept, {"mode": dc.regenerate, "results": path.name, "settings": settings, "num_responses": len(kept),
                  "num_tokens": num_tokens, "finish": dict(finishes), "repetition_loops": loops,
                  "seconds_this_run": round(seconds, 2),
                  "num_responses_this_run": len(fresh), "num_tokens_this_run": new_tokens}


def _tokenize(cfg: RunConfig, template: ChatTemplate, convs: list[Conversation], report: _Report) -> tuple[dict, dict]:
    """Ids and masks of the conversations; with regeneration their last assistant turn is the target's own
    response, which the template must render as written."""
    max_len, truncate = cfg.data.max_length, cfg.data.on_long == "truncate"
    regenerated = cfg.data.regenerate is not None
    cols = {"sample_id": [], "input_ids": [], "loss_mask": []}
    num_truncated = num_tokens = num_masked = num_unmasked_turns = num_loop_masked = num_cut_turn_ends = 0
    for start in range(0, len(convs), CHUNK):
        chunk = convs[start:start + CHUNK]
        for c, tok in zip(chunk, template.tokenize_many([c.messages for c in chunk], verbatim_last=regenerated)):
            if isinstance(tok, ResponseRewritten):
                report.skip("template_rewrites_response", c.where, str(tok)[:200])
                continue
            if isinstance(tok, TemplateMismatch):
                report.skip("template_mismatch", c.where, str(tok)[:200])
                continue
            ids, mask = tok.input_ids, tok.loss_mask
            if c.loss_chars is not None:
                taken = _mask_from(template, c, ids, mask)
                if c.loss_chars < len(c.messages[-1]["content"]):
                    num_loop_masked += taken
                else:
                    num_cut_turn_ends += taken > 0
            if not any(mask):
                report.skip("no_assistant_tokens", c.where)
                continue
            if len(ids) > max_len:
                if not truncate:
                    report.skip("too_long", c.where, f"{len(ids)} tokens")
                    continue
                ids, mask = ids[:max_len], mask[:max_len]
                if not any(mask):
                    report.skip("no_assistant_tokens", c.where)
                    continue
                num_truncated += 1
            cols["sample_id"].append(c.sample_id)
            cols["input_ids"].append(ids)
            cols["loss_mask"].append(mask)
            num_tokens += len(ids)
            num_masked += sum(mask)
            num_unmasked_turns += tok.num_unmasked_turns
    if num_unmasked_turns:
        print0(f"{num_unmasked_turns} earlier assistant turn(s) stay out of the loss: the chat template renders them "
               f"differently once later turns follow (Qwen3 drops their reasoning)")
    policy = {"max_length": max_len, "on_long": cfg.data.on_long, "num_truncated": num_truncated,
              "num_dropped_too_long": report.counts.get("too_long", 0)}
    # num_unmasked_turns: earlier assistant turns of kept samples that are context only
    # num_loop_masked: tokens of repetition loops kept as context only (data.regen_loops=mask); num_cut_turn_ends:
    # regenerated answers stopped by the token cap, whose end of turn is kept out of the loss
    return cols, {"length_policy": policy, "num_tokens": num_tokens, "num_loss_tokens": num_masked,
                  "num_unmasked_turns": num_unmasked_turns, "num_loop_masked_tokens": num_loop_masked,
                  "num_cut_turn_ends": num_cut_turn_ends}


def _mask_from(template: ChatTemplate, c: Conversation, ids: list[int], mask: list[int]) -> int:
    """Take the last assistant turn's tokens after its first c.loss_chars characters, and its end of turn, out of
    the loss (in place); -> how many. With the whole answer kept, that is the turn's closing stop tokens. Else the
    kept text is counted in tokens alone, less one: where its last tokens merge otherwise inside the sample, the
    cut falls a token or two before the loop."""
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    content = c.messages[-1]["content"]
    if c.loss_chars >= len(content):
        cut = end
        while cut > start and ids[cut - 1] in template.stop_ids:
            cut -= 1
    else:
        kept = len(template.tokenizer(content[:c.loss_chars], add_special_tokens=False)["input_ids"])
        cut = min(end, start + max(0, kept - 1))
    mask[cut:end] = [0] * (end - cut)
    return end - cut


def _write_dataset(cols: dict, out: Path) -> None:
    import datasets

    features = datasets.Features({"sample_id": datasets.Value("string"),
                                  "input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    ds = datasets.Dataset.from_dict(cols, features=features)
    tmp, final = out / ".dataset.tmp", out / "dataset"
    shutil.rmtree(tmp, ignore_errors=True)
    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bar for a write of a second or two is noise in the stage's log
    try:
        ds.save_to_disk(str(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk leaves no half-written copy behind
        raise
    finally:
        if was_on:
            datasets.enable_progress_bars()
    # out is eyas's (prepare claimed it), so its dataset/ is eyas's own earlier output
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def prepare(cfg: RunConfig, out_dir: str | Path, target, engine=None) -> dict:
    """Run the whole data stage into `out_dir` with a loaded target; returns the prepare.json summary.
    `engine` (with target.backend=vllm: an engine with `generate`, eyas.target.vllm) regenerates instead of
    the target's transformers model.

    `data` sits below `target` in the layering, so the caller loads the target
    (eyas.stages.prepare.run does it from cfg.target).
    """
    from eyas.data.vocab import build_vocab, count_tokens, save_vocab

    t0 = time.perf_counter()
    out = Path(out_dir)
    claim(out, "prepare")  # a directory eyas did not make is refused before anything in it is removed
    (out / "prepare.json").unlink(missing_ok=True)  # the directory is incomplete until it is rewritten
    (out / "summary.json").unlink(missing_ok=True)
    tok = target.tokenizer
    stop_ids = stop_token_ids(tok, getattr(target.model, "generation_config", None))
    stop_ids += [i for i in _extra_stop_ids(tok, cfg.data.stop_tokens) if i not in stop_ids]
    try:
        template = ChatTemplate(tok, stop_ids, cfg.data.chat_template_kwargs)
    except ValueError as e:
        raise EyasError(str(e)) from None
    report = _Report()
    convs, source = _load_conversations(cfg, report)
    if cfg.data.self_prompts:
        own, source["self_prompts"] = _self_prompts(cfg, target, template, out)
        taken = {c.sample_id for c in convs}
        for c in own:
            if c.sample_id in taken:  # an input record already named self-NNNNNNN
                report.skip("duplicate_id", c.where, f"id {c.sample_id!r} is taken by an input record")
            else:
                convs.append(c)
    num_read = len(convs) + sum(report.counts.values())
    _strict_check(cfg, report)
    regen = None
    if cfg.data.regenerate:
        convs, regen = _regenerate(cfg, target, template, convs, out, report, engine)
    t1 = time.perf_counter()
    cols, token_stats = _tokenize(cfg, template, convs, report)
    tokenize_s = time.perf_counter() - t1
    _strict_check(cfg, report)
    num_kept = len(cols["sample_id"])
    if num_kept == 0:
        why = report.line() or "the input holds no conversation"
        raise EyasError(f"no usable conversation in the input ({why}); see `eyas prepare --help` for the formats")
    _write_dataset(cols, out)
    counts = count_tokens(zip(cols["input_ids"], cols["loss_mask"]), target.vocab_size)
    vocab_meta = save_vocab(build_vocab(counts, cfg.data.draft_vocab), out / "vocab.safetensors")
    vocab_meta["num_seen_tokens"] = int((counts > 0).sum())
    seconds = time.perf_counter() - t0
    summary = {
        "source": source,
        "target": target.identity,
        "target_model": cfg.target.model,
        "template_hash": hashlib.sha256(str(tok.chat_template).encode()).hexdigest()[:16],
        "tokenizer_hash": target.identity.get("tokenizer_hash"),
        "stop_token_ids": template.stop_ids,
        "num_read": num_read,
        "num_kept": num_kept,
        "num_dropped": sum(report.counts.values()),
        "dropped": dict(sorted(report.counts.items())),
        "first_at": dict(sorted(report.first.items())),
        "reasons": {r: SKIP_REASONS[r] for r in sorted(report.counts)},
        **token_stats,
        "regeneration": regen,
        "vocab": vocab_meta,
        "seconds": round(seconds, 2),
        "tokenize_conversations_per_s": round(len(convs) / tokenize_s, 1) if tokenize_s > 0 else None,
        "data_config": cfg.data.__dict__.copy(),
    }
    atomic_write_json(out / "prepare.json", summary)
    return summary


def load_prepared(path: str | Path):
    """The prepared dataset (datasets.Dataset with sample_id, input_ids, loss_mask) of a prepare directory."""
    import datasets

    path = Path(path)
    if not (path / "prepare.json").is_file() or not (path / "dataset").is_dir():
        raise EyasError(f"{path} is not a complete prepared-data directory (no prepare.json); run `eyas prepare --out {path}`")
    return datasets.load_from_disk(str(path / "dataset"))
