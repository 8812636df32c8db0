"""The training loop: setup, resume, loop (accumulate, clip, step, log, save), finish. Reads top to bottom.

`train(cfg, out_dir, source)` is the Python entry (used by `eyas train` and the pipeline); `source` is a
TrainSource (eyas/train/source.py), so the loop does not care whether features come from a store or
from the target running in this process.

A step whose loss or any gradient is not finite is skipped: no optimizer update (weights and AdamW moments
stay as they were), gradients dropped, but the step counter, the data position and the learning-rate
schedule advance as for any step, so the run keeps its planned length and schedule and a resume replays
it exactly. Skipped steps are counted (`nonfinite_steps` in the records and the summary); train.max_bad_steps
of them in a row stop training with an error, keeping the last checkpoint (weights holding NaN or inf are
never saved). Under DDP/FSDP the ranks agree on skipping, on a wall-clock save (train.save_every_minutes)
and on stopping for a signal (eyas/train/guards.py) through one all-reduce per step.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eyas.common import REPEAT_NGRAM, EyasError, print0, repeated_contexts, seed_all, warn
from eyas.config import RunConfig
from eyas.identity import check_target
from eyas.draft import DraftConfig, Eagle3Draft
from eyas.train import checkpoint as ckpt
from eyas.train import dist, guards
from eyas.train.data import pad_rows
from eyas.train.metrics import MetricsLogger, peak_memory_gib
from eyas.train.source import TrainSource
from eyas.train.ttt import LossSpec, TTTResult, draft_step, simulated_tau, ttt_forward


class TTTModule(nn.Module):
    """The draft plus its TTT loss as one module, so DDP/FSDP see one forward per micro-batch."""

    def __init__(self, draft: Eagle3Draft, ttt: int, loss_decay: float, features: str, *,
                 impl: str = "fast", attention: str = "dense", compile: bool = False, batch_tokens: int = 0,
                 compile_backend: str = "inductor", compile_loss: bool = False, loss: LossSpec = LossSpec()):
        super().__init__()
        self.draft = draft
        self.ttt, self.loss_decay, self.features, self.loss = ttt, loss_decay, features, loss
        self.impl, self.attention = impl, attention
        # a compiled step pads small batches with empty rows to >= 2 rows and half the token budget (never
        # past the budget), so that the packer's leftover batches do not compile every unrolled step again
        # (eyas.train.data.pad_rows)
        self.batch_tokens = batch_tokens if compile else 0
        # compile the per-step layer function, not the module: checkpoints keep the plain draft's keys.
        # Steps mark their batch and length dimensions dynamic before the first call (ttt._dynamic);
        # a flex step's length is tied to its block mask's int lengths, so it is compiled dynamic from the
        # start: on the H200 the first change of batch shape otherwise compiled all K steps again
        dynamic = True if attention == "flex" else None
        self.step_fn = torch.compile(draft_step, backend=compile_backend, dynamic=dynamic) if compile else None
        # the soft cross-entropy's passes over the [N, Vd] logits (train.compile_loss); only inductor fuses
        # them (the other backends are for tracing tests)
        self.compiled_ce = compile and compile_loss and compile_backend == "inductor"
        if compile:
            # the unrolled steps make four graphs (steps 0, 1 and 2 have 0, 0 and 1 earlier diagonal keys, the
            # later ones a dynamic count), plus variants of the backward and of the last, shorter batch: dynamo's default
            # limit of 8 graphs per function sent the later steps of K = 7 back to eager mode on the H200 when
            # each step was its own graph; the limit stays generous
            import torch._dynamo as dynamo

            dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 4 * (ttt + 1))

    def forward(self, batch: dict, lm_head_weight: torch.Tensor) -> TTTResult:
        if self.batch_tokens:
            batch = pad_rows(batch, self.batch_tokens // 2, self.batch_tokens)
        return ttt_forward(self.draft, batch, lm_head_weight, self.ttt, self.loss_decay, self.features,
                           impl=self.impl, attention=self.attention, step_fn=self.step_fn,
                           compiled_ce=self.compiled_ce, loss=self.loss)


def lr_lambda(total_steps: int, warmup_steps: int, min_lr_ratio: float):
    """Linear warmup to 1, then cosine decay to min_lr_ratio at the last step."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def feature_layers(source: TrainSource, features: str) -> list[int]:
    """The aux layers (HF ids) the draft's features come from: all of them fused, or the highest alone."""
    return list(source.aux_layers[-1:] if features == "last" else source.aux_layers)


def loss_spec(tc) -> LossSpec:
    """The TTT loss that train.loss, train.lk_eta, train.mask_oov_target, train.loss_mask_token and
    train.loss_norm describe."""
    return LossSpec(kind=tc.loss, lk_eta=tc.lk_eta, mask_oov_target=tc.mask_oov_target,
                    mask_token=tc.loss_mask_token, norm=tc.loss_norm)


def draft_config(source: TrainSource, features: str, fc_norm: bool = False, norm_output: bool = False,
                 rope: str = "target") -> DraftConfig:
    """The config of a new draft for this source (its draft vocabulary the data's, else the target's), with the
    EAGLE 3.1 layout switches train.fc_norm and train.norm_output and the rotary embedding of train.rope."""
    vocab = source.lm_head_weight.shape[0]
    draft_vocab = len(source.d2t) if source.d2t is not None else vocab
    try:
        cfg = DraftConfig.from_target_config(source.target_config, draft_vocab, len(feature_layers(source, features)),
                                             fc_norm=fc_norm, norm_output=norm_output, rope=rope)
    except ValueError as e:  # the target's config asks for a draft eyas cannot build: the message names the fix
        raise EyasError(f"the draft for this store's target: {e}") from None
    if (cfg.vocab_size, cfg.hidden_size) != tuple(source.embed_weight.shape):
        raise EyasError(f"the target config says vocab {cfg.vocab_size} x hidden {cfg.hidden_size} but its embedding is "
                        f"{tuple(source.embed_weight.shape)}; the store's target_head does not belong to its manifest")
    return cfg


def build_draft(source: TrainSource, features: str, fc_norm: bool = False, norm_output: bool = False,
                rope: str = "target") -> Eagle3Draft:
    draft = Eagle3Draft(draft_config(source, features, fc_norm, norm_output, rope))
    draft.embed_tokens.weight.data.copy_(source.embed_weight.float())
    if source.d2t is not None:
        draft.set_vocab(source.d2t, source.t2d)
    return draft


def _same(a, b) -> bool:
    """Equal, floats to fp32 precision (an export may write 1e-5 as 9.999999747378752e-06)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def init_draft(init: tuple[Eagle3Draft, dict], path: str, source: TrainSource, features: str,
               fc_norm: bool = False, norm_output: bool = False, rope: str = "target") -> Eagle3Draft:
    """The draft loaded from `path` (train.init_from; `init` is what eyas.formats.load_draft returned for it),
    checked against what this run trains on, to fine-tune.

    It keeps its own draft vocabulary (its head is trained on it), whatever the prepared data's is; its
    architecture, aux layers, features and target must be this run's, or the error names the difference."""
    draft, meta = init
    where = f"train.init_from={path!r}"
    ours, theirs = draft_config(source, features, fc_norm, norm_output, rope).to_dict(), draft.cfg.to_dict()
    differ = [f"{k} {theirs.get(k)!r} (this run: {v!r})" for k, v in ours.items()
              if k != "draft_vocab_size" and not _same(theirs.get(k), v)]
    if differ:
        raise EyasError(f"{where}: that draft was built differently from the one this run trains: "
                        f"{', '.join(differ)}; give a draft trained for this target and features, or drop "
                        f"train.init_from to train a new one")
    aux = feature_layers(source, features)
    if meta.get("aux_layers") is not None and list(meta["aux_layers"]) != aux:
        raise EyasError(f"{where}: that draft reads aux layers {meta['aux_layers']} (HF numbering), this run's "
                        f"features come from {aux}; capture at its layers (capture.aux_layers) or drop train.init_from")
    if meta.get("features") and meta["features"] != features:
        raise EyasError(f"{where}: that draft was trained with train.features={meta['features']!r}, this run uses "
                        f"{features!r}")
    known, target = meta.get("target") or {}, source.target or {}
    check_target(known, target, what=where,
                 fix="a draft only fits the target whose hidden states it read; drop train.init_from or train on "
                     "that target's data")
    if not known.get("config_hash"):
        warn(f"{where}: that draft does not record its target; its shapes match {target.get('name')!r}, so "
             f"training goes on, assuming it was trained for this target")
    draft.embed_tokens.weight.data.copy_(source.embed_weight.float())
    if source.d2t is not None and not torch.equal(source.d2t, draft.d2t):
        shared = int((source.t2d & draft.t2d).sum())
        print0(f"{where}: the draft keeps its vocabulary of {draft.cfg.draft_vocab_size} tokens; it holds {shared} "
               f"of the {len(source.d2t)} this data would have chosen")
    return draft.train()


def draft_meta(draft: Eagle3Draft, source: TrainSource, cfg: RunConfig) -> dict:
    if getattr(draft, "method", "eagle3") == "dflash":
        return {"method": "dflash", "draft_config": draft.cfg.to_dict(), "aux_layers": list(draft.cfg.target_layers),
                "features": "fused", "target": source.target, "target_model": source.target_model,
                "store": source.store, "ttt": None, "target_num_layers": source.num_layers,
                "init_from": cfg.train.init_from or None, "target_architectures": source.target_config.get("architectures")}
    return {"method": "eagle3", "draft_config": draft.cfg.to_dict(), "aux_layers": feature_layers(source, cfg.train.features),
            "features": cfg.train.features,
            "target": source.target, "target_model": source.target_model, "store": source.store, "ttt": cfg.train.ttt,
            "target_num_layers": source.num_layers, "init_from": cfg.train.init_from or None,
            "target_architectures": source.target_config.get("architectures")}


def train(cfg: RunConfig, out_dir: str | Path, source: TrainSource, *, resume: bool = False,
          device: str = "auto", method: str | None = None) -> dict:
    """Train a draft into out_dir (checkpoints, metrics, curves); returns a summary dict. With
    train.init_from set, the run fine-tunes that draft (a run, step or export directory) instead.
    `method`: eagle3 or dflash (default: train.method, which must then name one)."""
    if method is None:
        if len(cfg.train.method) != 1:
            raise EyasError(f"train.method={cfg.train.method} names {len(cfg.train.method)} draft families; `eyas train` "
                            f"trains one: pass --set train.method=eagle3 or --set train.method=dflash (eyas run trains each)")
        method = cfg.train.method[0]
    info = dist.init_distributed(device)
    try:
        return _train(cfg, Path(out_dir), source, resume, info, method)
    finally:
        dist.cleanup(info)


def _first_draft(tc, source: TrainSource, dflash_cfg=None) -> Eagle3Draft:
    """A new draft for this source, or the one train.init_from names, checked against it."""
    if dflash_cfg is not None:
        from eyas.train.dflash import build_dflash_draft

        return build_dflash_draft(source, dflash_cfg, tc.init_from, tc.rope)
    if not tc.init_from:
        return build_draft(source, tc.features, tc.fc_norm, tc.norm_output, tc.rope)
    from eyas.formats import load_draft

    draft = init_draft(load_draft(tc.init_from, embed_tokens=source.embed_weight), tc.init_from, source, tc.features,
                       tc.fc_norm, tc.norm_output, tc.rope)
    print0(f"fine-tuning the draft of {tc.init_from} (train.init_from): a fresh optimizer and schedule")
    return draft


def _resume(run_dir: Path, draft: Eagle3Draft, meta: dict, state: dict, cfg: RunConfig) -> dict | None:
    """The newest checkpoint of run_dir loaded into `draft` and `state` (None without one); its draft and the
    shape of its training must be this run's."""
    tc = cfg.train
    resumed = ckpt.latest_step_dir(run_dir)
    loaded = ckpt.load_checkpoint(resumed) if resumed else None
    if not loaded:
        return None
    guards.check_resume_config(resumed, cfg)
    old = loaded["draft_meta"]
    # a checkpoint written before a draft config field existed has that field's default
    if old.get("method", "eagle3") != meta.get("method", "eagle3"):
        raise EyasError(f"cannot resume from {resumed}: it trains a {old.get('method', 'eagle3')} draft, this run a "
                        f"{meta.get('method')} one (train.method); use a new --out directory")
    config_class = type(draft.cfg)  # DraftConfig or DFlashConfig
    old = {**old, "draft_config": config_class.from_dict(old.get("draft_config") or {}).to_dict()
           if old.get("draft_config") else None}
    for key in ("draft_config", "aux_layers", "features"):
        if old.get(key) != meta[key]:
            raise EyasError(f"cannot resume from {resumed}: its {key} ({old.get(key)}) differs from this run's "
                            f"({meta[key]}); use a new --out directory")
    missing, unexpected = draft.load_state_dict(loaded["model"], strict=False)
    frozen = ["embed_tokens.weight", "lm_head.weight"] if meta.get("method") == "dflash" else ["embed_tokens.weight"]
    assert sorted(missing) == frozen and not unexpected, (missing, unexpected)
    total_steps = state["total_steps"]
    state.update(loaded["trainer_state"])
    if not tc.steps and state.get("total_steps"):  # keep the schedule of the run we resume
        total_steps = state["total_steps"]
    state["total_steps"] = total_steps
    print0(f"resuming from {resumed} (step {state['step']}, epoch {state['epoch']}, batch {state['batch_index']})")
    return loaded


def _attention(tc, draft: Eagle3Draft, device: torch.device) -> str:
    """train.attention, or dense where FlexAttention cannot run (said once)."""
    if tc.attention == "flex" and device.type != "cuda":
        print0(f"train.attention=flex needs CUDA (its backward has no CPU kernel); using dense on {device}")
        return "dense"
    if tc.attention == "flex" and draft.cfg.head_dim < 16:
        print0(f"train.attention=flex needs a head_dim of at least 16 (FlexAttention's CUDA kernel); the draft's is "
               f"{draft.cfg.head_dim}: using dense")
        return "dense"
    return tc.attention


@dataclass
class _Session:
    """What the loop steps: the wrapped TTT module, its optimizer and schedule, and how it runs."""

    model: nn.Module
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    autocast: object  # () -> a context manager
    compiled: bool


def _session(tc, draft: Eagle3Draft, info: dist.DistInfo, total_steps: int, loaded: dict | None,
             module: nn.Module | None = None) -> _Session:
    draft.to(info.device)
    compile_step = tc.compile and info.device.type == "cuda" and module is None  # inductor on CPU costs more than it saves
    model = dist.wrap(module if module is not None else TTTModule(draft, tc.ttt, tc.loss_decay, tc.features, attention=_attention(tc, draft, info.device),
                                compile=compile_step, batch_tokens=tc.batch_tokens,
                                compile_loss=tc.compile_loss, loss=loss_spec(tc)), info, tc.fsdp)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, tc.adam_beta2), weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, tc.warmup_steps, tc.min_lr_ratio))
    if loaded:
        dist.load_optimizer_state(model, optimizer, loaded["optim"]["optimizer"], tc.fsdp)
        scheduler.load_state_dict(loaded["optim"]["scheduler"])
        ckpt.set_rng_state(loaded["rng"])
    amp_dtype = {"bf16": torch.bfloat16, "fp32": None}.get(tc.dtype, torch.bfloat16 if info.device.type == "cuda" else None)
    autocast = (lambda: torch.autocast(info.device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    return _Session(model, params, optimizer, scheduler, autocast, compile_step)


def _train(cfg: RunConfig, run_dir: Path, source: TrainSource, resume: bool, info: dist.DistInfo,
           method: str = "eagle3") -> dict:
    # ---- setup
    tc = cfg.train
    seed_all(tc.seed)
    if info.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    module = None
    if method == "dflash":
        from eyas.train.dflash import DFlashModule, blocks_per_micro_batch, dflash_train_config

        draft = _first_draft(tc, source, cfg.dflash)
        tc = dflash_train_config(tc, cfg.dflash)  # the loop's K is the block's guesses, its decay the slot weights
        block_tokens = cfg.dflash.block_tokens or tc.batch_tokens
        module = DFlashModule(draft, source.aux_layers, cfg.dflash.gamma, cfg.dflash.anchors, block_tokens)
        print0(f"draft: DFlash, {draft.num_trainable_params() / 1e6:.2f}M trainable parameters (H {draft.cfg.hidden_size}, "
               f"{draft.cfg.num_layers} layer(s), block {draft.cfg.block_size}, target layers {draft.cfg.target_layers} "
               f"fused, mask token {draft.cfg.mask_token_id}, lr {tc.lr:g}, at most {cfg.dflash.anchors} blocks a sample and "
               f"{blocks_per_micro_batch(block_tokens, draft.cfg.block_size)} a micro-batch)")
    else:
        draft = _first_draft(tc, source)  # its shape and vocabulary; a resumed run then loads its own weights over it
        print0(f"draft: {draft.num_trainable_params() / 1e6:.2f}M trainable parameters "
               f"(H {draft.cfg.hidden_size}, Vd {draft.cfg.draft_vocab_size}, fc {draft.cfg.num_aux_layers}*H -> H, "
               f"features {tc.features}, TTT {tc.ttt})")
        guards.check_memory(draft, tc, source.lm_head_weight, draft.cfg.num_aux_layers, info.device)
    batcher, val_batcher = source.batchers(tc.batch_tokens, tc.seed, info.rank, info.world_size, tc.val_samples,
                                           sort=tc.batching == "sorted")
    batches_per_epoch = batcher.batches_per_epoch()  # an estimate while tailing a store being captured
    total_steps = tc.steps or max(1, math.ceil(tc.epochs * batches_per_epoch / tc.grad_accum))
    meta = draft_meta(draft, source, cfg)
    state = {"step": 0, "epoch": 0, "batch_index": 0, "tokens": 0, "elapsed_s": 0.0, "last_metrics": None,
             "total_steps": total_steps, "nonfinite_steps": 0, "bad_in_a_row": 0}
    loaded = _resume(run_dir, draft, meta, state, cfg) if resume else None
    total_steps = state["total_steps"]
    sess = _session(tc, draft, info, total_steps, loaded, module)
    logger = MetricsLogger(run_dir, info.rank == 0, resume_step=state["step"] if loaded else None)
    stream = batcher.stream(state["epoch"], state["batch_index"], info.device)
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)

    def save(step: int) -> Path:
        model_state = dist.model_state(sess.model, tc.fsdp)
        model_state = {k.removeprefix("module.").removeprefix("draft."): v for k, v in model_state.items()}
        if method == "dflash":  # the target's lm_head, frozen like the embedding, is not the draft's to keep
            model_state.pop("lm_head.weight", None)
        ckpt.check_finite(model_state, f"step {step}")  # on every rank, so that all stop together
        optim = {"optimizer": dist.optimizer_state(sess.model, sess.optimizer, tc.fsdp),
                 "scheduler": sess.scheduler.state_dict()}
        if info.rank == 0:
            ckpt.save_checkpoint(run_dir, step, model_state, optim, dict(state), meta, cfg, tc.keep_last)
        return run_dir / ckpt.step_dir_name(step)

    # ---- loop
    print0(f"training {total_steps} steps ({batches_per_epoch} batches/epoch/rank, {info.world_size} rank(s), "
           f"grad_accum {tc.grad_accum}, {tc.batch_tokens} tokens/micro-batch) -> {run_dir}")
    if tc.warmup_steps * 4 > total_steps and info.rank == 0:
        warn(f"train.warmup_steps={tc.warmup_steps} is {tc.warmup_steps / total_steps:.0%} of the {total_steps} steps: "
             f"the learning rate reaches train.lr only near the end; about 5-10 % of the steps is usual")
    lm_head_weight = source.lm_head_weight.to(info.device)
    try:
        with guards.StopSignals() as stop:
            _loop(tc, sess, stream, val_batcher, lm_head_weight, state, total_steps, info, logger, save, stop)
    finally:
        stream.close()  # stops and joins the batch-reading thread, also when a step raised
        source.close()

    # ---- finish
    return _finish(tc, run_dir, draft, state, logger, total_steps, batches_per_epoch, info)


def _loop(tc, sess: _Session, stream, val_batcher, lm_head_weight, state: dict, total_steps: int,
          info: dist.DistInfo, logger: MetricsLogger, save, stop: guards.StopSignals) -> None:
    """Optimizer steps until total_steps: accumulate, clip, step (or skip), log (and score the held-out samples),
    save (every train.save_every steps, every train.save_every_minutes, on a stop signal)."""
    window = _Window(tc.ttt)
    t_start = time.perf_counter() - state["elapsed_s"]
    clock = guards.SaveClock(tc.save_every_minutes)
    while state["step"] < total_steps:
        results = _accumulate(tc, sess, stream, lm_head_weight, state, info)
        norm = torch.nn.utils.clip_grad_norm_(sess.params, tc.grad_clip)
        flags = [float(not _finite(norm, results)), float(stop.requested is not None), float(clock.due())]
        bad, stopping, due = (v > 0 for v in dist.all_reduce_max(flags, info))
        _update(sess, bad)
        state["step"] += 1
        step = state["step"]
        _count_bad(bad, step, state, tc, logger.path.parent)
        for res, tokens in results if not bad else ():
            window.add(res, tokens)
        val_due = val_batcher is not None and (step % tc.val_every == 0 or step == total_steps)
        if step % tc.log_every == 0 or step == total_steps or val_due:
            rec = window.record(step, sess.scheduler.get_last_lr()[0], tc.loss_decay, info)
            if val_due:
                rec.update(score_held_out(sess.model, val_batcher, lm_head_weight, sess.autocast, info, tc,
                                          sess.compiled))
                window.t0 = time.perf_counter()  # tokens_per_s counts training only
            rec["peak_mem_GiB"] = peak_memory_gib(info.device)
            rec["nonfinite_steps"] = state["nonfinite_steps"]
            state["tokens"] += rec.pop("_tokens")
            state["elapsed_s"] = rec["elapsed_s"] = time.perf_counter() - t_start
            state["last_metrics"] = rec
            logger.log(rec, total_steps, tc.ttt)
        if step % tc.save_every == 0 or step == total_steps or due or stopping:
            state["elapsed_s"] = time.perf_counter() - t_start
            saved = save(step)
            clock.saved()
            if stopping and step < total_steps:
                raise guards.stopped_error(stop.requested or "a stop signal (on another rank)", step, total_steps,
                                           saved)


def _accumulate(tc, sess: _Session, stream, lm_head_weight, state: dict, info: dist.DistInfo) -> list:
    """Forward and backward of train.grad_accum micro-batches; -> [(TTTResult, real tokens)] of each."""
    results = []
    for micro in range(tc.grad_accum):
        state["epoch"], state["batch_index"], batch = next(stream)
        last = micro == tc.grad_accum - 1
        no_sync = info.enabled and not tc.fsdp and not last
        with sess.model.no_sync() if no_sync else contextlib.nullcontext():
            with sess.autocast():
                res = sess.model(batch, lm_head_weight)
            (res.loss / tc.grad_accum).backward()
        results.append((res, int(batch["attention_mask"].sum())))
    return results


def _finite(norm: torch.Tensor, results: list) -> bool:
    """Whether the gradients' total norm and every micro-batch's loss are finite (one host sync)."""
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    losses = torch.stack([res.loss.detach().float().reshape(()) for res, _ in results])  # [grad_accum]
    return bool(torch.isfinite(norm) & torch.isfinite(losses).all())


def _update(sess: _Session, skip: bool) -> None:
    """The optimizer step (none when `skip`), the schedule's step, gradients dropped."""
    if not skip:
        sess.optimizer.step()
        sess.scheduler.step()
    else:
        with warnings.catch_warnings():  # a first step skipped: torch warns of a schedule stepped before its optimizer
            warnings.simplefilter("ignore", UserWarning)
            sess.scheduler.step()
    sess.optimizer.zero_grad(set_to_none=True)


def _count_bad(bad: bool, step: int, state: dict, tc, run_dir: Path) -> None:
    """Count a skipped step; train.max_bad_steps in a row stop training, naming the last good checkpoint."""
    if not bad:
        state["bad_in_a_row"] = 0
        return
    state["nonfinite_steps"] += 1
    state["bad_in_a_row"] += 1
    in_a_row = state["bad_in_a_row"]
    warn(f"step {step}: the loss or a gradient is NaN or inf; the step is skipped, no weight changes "
         f"({in_a_row} in a row, {state['nonfinite_steps']} in this run)")
    if in_a_row >= tc.max_bad_steps:
        kept = ckpt.latest_step_dir(run_dir)
        raise EyasError(f"training stopped at step {step}: {in_a_row} steps in a row had a NaN or inf loss or gradient "
                        f"(train.max_bad_steps={tc.max_bad_steps}); the last good checkpoint is "
                        f"{kept or 'none (none was written yet)'}; likely causes: a learning rate too high "
                        f"(train.lr={tc.lr:g}) or corrupt data (check the store with `eyas verify STORE`)")


def _finish(tc, run_dir: Path, draft: Eagle3Draft, state: dict, logger: MetricsLogger, total_steps: int,
            batches_per_epoch: int, info: dist.DistInfo) -> dict:
    """Curves, RUN/summary.json and the closing line; -> the summary."""
    curves = logger.close(tc.ttt)
    last = state["last_metrics"] or {}
    wall = state["elapsed_s"]  # training time of all sessions of this run (resumes add up)
    summary = {
        **{k: v for k, v in last.items() if k not in ("step", "tokens_per_s", "elapsed_s")},  # last window's metrics
        "run_dir": str(run_dir), "steps": total_steps,
        # passes over the data: the data position after the last batch is (epoch, index of the next batch)
        "epochs": round(state["epoch"] + state["batch_index"] / max(1, batches_per_epoch), 3), "tokens": state["tokens"],
        "wall_s": round(wall, 3), "tokens_per_s": round(state["tokens"] / wall, 1) if wall > 0 else 0.0,
        "last_window_tokens_per_s": last.get("tokens_per_s"), "world_size": info.world_size,
        "checkpoint": str(run_dir / "latest"), "curves": str(curves) if curves else None,
        "trainable_params": draft.num_trainable_params(), "nonfinite_steps": state["nonfinite_steps"],
    }
    if info.rank == 0:
        ckpt.write_summary(run_dir, summary)
        accs = " ".join(f"{last.get(f'acc_{k}', 0):.2f}" for k in range(tc.ttt))
        held = ""
        if "val_acc_0" in last:
            held = (f"; on {tc.val_samples} held-out samples acc_0..{tc.ttt - 1} "
                    + " ".join(f"{last[f'val_acc_{k}']:.2f}" for k in range(tc.ttt))
                    + f", simulated tau {last['val_tau_sim']:.2f} ({last['val_tau_fresh']:.2f} outside repeats, "
                      f"{last['val_fresh_share']:.0%} of the tokens)")
        print0(f"trained {total_steps} steps in {summary['wall_s']:.0f} s ({summary['tokens_per_s']:,.0f} tok/s); "
               f"final loss {last.get('loss', float('nan')):.3f}, acc_0..{tc.ttt - 1} {accs} on the last training "
               f"batches, simulated tau {last.get('tau_sim', float('nan')):.2f}{held}; checkpoint {run_dir / 'latest'}")
    return summary


def score_held_out(model, val_batcher, lm_head_weight, autocast, info, tc, compiled: bool) -> dict:
    """val_loss, val_acc_k and val_tau_sim of the draft on the held-out samples (every rank scores its share).

    A compiled draft step keeps autograd on here: its graphs were traced for training, and a no-grad call
    would compile them all again. Nothing is backpropagated; DDP's wrapper is bypassed for the same reason.

    A second pass scores the same samples with the loss mask cut to the tokens outside repeats (`repeat_mask`):
    a draft predicts a repeated stretch, such as a loop of the target's, almost perfectly, so the figure over all
    tokens depends on how much of the held-out text repeats; `val_tau_fresh` compares with the tau eval reports
    outside repeats, and `val_fresh_share` is the share of loss tokens it covers.
    """
    window, fresh = _Window(tc.ttt), _Window(tc.ttt)
    loss_tokens = [0.0, 0.0]  # [all, outside repeats] over this rank's samples
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    with torch.enable_grad() if compiled else torch.no_grad():
        for indices in val_batcher.plan(0):
            batch = val_batcher.collate(indices, info.device)
            for win, cut in ((window, False), (fresh, True)):
                if cut:
                    keep = ~repeat_mask(batch["input_ids"], batch["loss_mask"])
                    batch = {**batch, "loss_mask": batch["loss_mask"] * keep.to(batch["loss_mask"].dtype)}
                loss_tokens[cut] += float((batch["loss_mask"] > 0).sum())
                with autocast():
                    res = module(batch, lm_head_weight)
                win.add(res, int(batch["attention_mask"].sum()))  # reads the statistics only
                del res  # frees the autograd graph of a compiled step
            del batch
    rec, rec_fresh = window.record(0, 0.0, tc.loss_decay, info), fresh.record(0, 0.0, tc.loss_decay, info)
    total, outside = dist.all_reduce_sum(loss_tokens, info)
    out = {"val_loss": rec["loss"], "val_tau_sim": rec["tau_sim"], "val_tau_fresh": rec_fresh["tau_sim"],
           "val_fresh_share": outside / total if total else 0.0}
    out.update({f"val_acc_{k}": rec[f"acc_{k}"] for k in range(tc.ttt)})
    return out


def repeat_mask(input_ids: torch.Tensor, loss_mask: torch.Tensor, n: int = REPEAT_NGRAM) -> torch.Tensor:
    """bool [B, T]: token t of a row is in a repeat when its n preceding tokens, all of the answer (loss mask),
    form an n-gram of answer tokens that ended before t in the same row; eval's split of tau inside and outside
    repeats (speculative/stats.py repeat_split) uses the same rule on a turn's output."""
    rows = [repeated_contexts(seq, ans, n) for seq, ans in zip(input_ids.tolist(), (loss_mask > 0).tolist())]
    return torch.tensor(rows, dtype=torch.bool).view(input_ids.shape).to(input_ids.device)


class _Window:
    """Sums over one logging interval (micro-batches of all ranks), turned into a record."""

    def __init__(self, ttt: int):
        self.ttt = ttt
        self.reset()

    def reset(self):
        self.loss_sum = [0.0] * self.ttt
        self.correct = [0.0] * self.ttt
        self.count = [0.0] * self.ttt
        self.tokens = 0.0
        self.t0 = time.perf_counter()

    def add(self, res: TTTResult, tokens: int):
        for k in range(self.ttt):
            self.loss_sum[k] += res.loss_k[k] * res.count_k[k]
            self.correct[k] += res.correct_k[k]
            self.count[k] += res.count_k[k]
        self.tokens += tokens

    def record(self, step: int, lr: float, decay: float, info) -> dict:
        k_ = self.ttt
        sums = dist.all_reduce_sum(self.loss_sum + self.correct + self.count + [self.tokens], info)
        loss_sum, correct, count, tokens = sums[:k_], sums[k_:2 * k_], sums[2 * k_:3 * k_], sums[-1]
        seconds = time.perf_counter() - self.t0
        loss_k = [loss_sum[k] / max(count[k], 1) for k in range(k_)]
        acc_k = [correct[k] / max(count[k], 1) for k in range(k_)]
        rec = {"step": step, "loss": sum(decay ** k * loss_k[k] for k in range(k_))}
        rec.update({f"loss_{k}": loss_k[k] for k in range(k_)})
        rec.update({f"acc_{k}": acc_k[k] for k in range(k_)})
        rec.update({"tau_sim": simulated_tau(acc_k), "lr": lr, "tokens_per_s": tokens / max(seconds, 1e-9),
                    "_tokens": int(tokens)})
        self.reset()
        return rec
