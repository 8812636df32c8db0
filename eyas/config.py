"""Typed configs for every stage, presets, YAML files and `--set section.key=value` overrides.

A run's config is one `RunConfig` with a section per stage. Presets are plain functions that
return a `RunConfig`. A YAML file either names a preset to extend (`preset: demo`) and overrides
some keys, or spells out sections in full. Every key and value is checked against the dataclass
field types; errors are one line that names the key and lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user error in a config: unknown key, bad value or bad combination."""


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {', '.join(map(str, allowed))}")


def _at_least(name: str, value: float, minimum: float, note: str = "") -> None:
    if value < minimum:
        raise ConfigError(f"{name}={value!r} must be >= {minimum}{note}")


def _in_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{name}={value!r} must lie in [{low}, {high}]")


def _json_mapping(name: str, value: dict) -> None:
    """A mapping that goes into a hash and into JSON bodies or engine arguments: strings, finite numbers,
    true/false, null, lists and mappings only."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}={value!r}: {e}; give JSON values (strings, finite numbers, true/false, lists, "
                          f"mappings)") from None


def _check_fields(section: str, obj) -> None:
    """Every field of a section checked against its type, as a value read from YAML or --set is (and
    converted the same way), so that a config built in code is held to the rules of one read from a file."""
    for name, tp in _field_types(type(obj)).items():
        setattr(obj, name, _coerce(f"{section}.{name}", getattr(obj, name), tp))


_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
# the longest training-time test: each step keeps its activations and its attention over every earlier step
# for the backward pass, so memory grows with ttt (EAGLE-3 trains with 7)
MAX_TTT = 64
METHODS = ("eagle3", "dflash")
ROPES = ("target", "plain")  # train.rope: the target's rope, or plain RoPE at the target's theta
# a learning rate above this moves each weight by about its own size in one AdamW step
MAX_LR = 1.0


# target specs that name a model eyas builds or ships itself, never a path (eyas/target/load.py)
TINY_TARGETS = ("tiny", "tiny-llama", "tiny-qwen2", "tiny-moe")  # random models built in code, for tests
BUILTIN_TARGETS = ("smollm2", *TINY_TARGETS)


@dataclass
class TargetConfig:
    # a local HF directory, a hub id, a .gguf file, "smollm2" (the embedded default) or
    # "tiny" / "tiny-qwen2" / "tiny-moe" (random models built in code, for tests)
    model: str = "smollm2"
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # aux layer ids in the Hugging Face output_hidden_states convention (1..n-1);
    # None means the EAGLE-3 default [2, n//2, n-3]
    aux_layers: list[int] | None = None
    # let transformers run Python code shipped with the model (its config's auto_map); off, a target that needs it
    # stops with an error naming this option instead of asking on the terminal
    trust_remote_code: bool = False
    backend: str = "hf"  # hf (transformers in eyas's processes) | vllm (a vLLM engine; pip install eyas[vllm])
    # the engine's own arguments, passed through unchanged (vllm: tensor_parallel_size, pipeline_parallel_size,
    # data_parallel_size, enable_expert_parallel, gpu_memory_utilization, max_model_len, quantization, dtype, ...)
    engine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _check_fields("target", self)
        _one_of("target.backend", self.backend, ("hf", "vllm"))
        _json_mapping("target.engine", self.engine)
        if not self.model.strip():
            raise ConfigError("target.model is empty; give a model directory, a hub id, a .gguf file, smollm2 or tiny")
        _one_of("target.dtype", self.dtype, ("auto", "fp32", "bf16", "fp16"))
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"target.device={self.device!r} is not valid; "
                              f"choose one of: auto, cpu, cuda, cuda:N, mps")
        if self.aux_layers is not None:
            ids = list(self.aux_layers)
            if not ids:
                raise ConfigError("target.aux_layers is empty; give at least one layer id or null for the default")
            if any(not isinstance(i, int) or i < 1 for i in ids):
                raise ConfigError(f"target.aux_layers={ids}: ids are residual-stream indices and must be >= 1")
            if sorted(set(ids)) != ids:
                raise ConfigError(f"target.aux_layers={ids}: ids must be distinct and ascending")


# apply_chat_template's own arguments: data.chat_template_kwargs must not set them
_RENDER_ARGUMENTS = ("conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                     "chat_template", "return_dict", "return_tensors")


@dataclass
class DataConfig:
    # input files (JSONL/JSON/Parquet) or HF dataset names; empty = the built-in prompt corpus
    data: list[str] = field(default_factory=list)
    format: str = "auto"  # auto | sharegpt | openai | prompt-response
    max_length: int = 2048
    on_long: str = "drop"  # drop | truncate
    strict: bool = False
    num_prompts: int = 2000  # size of the built-in prompt corpus when data is empty (0 = none of it)
    # user prompts the target writes itself (Magpie: it continues its template's opening of a user turn),
    # added to the corpus or to the files; chat-like where the corpus is made from Python docstrings
    self_prompts: int = 0
    self_prompt_temperature: float = 0.8  # 1.0 wrote more broken requests with SmolLM2-135M
    self_prompt_max_tokens: int = 128  # a request still running at this length is dropped
    # starts of requests that steer a share of them (the target writes the rest), e.g. ["Write a Python
    # function that", "Complete this Python code:"] for a draft meant for code; taken in turn
    self_prompt_openers: list[str] = field(default_factory=list)
    self_prompt_opener_share: float = 0.5  # of the kept requests, when openers are given
    regenerate: str | None = None  # None | "local" | an OpenAI-compatible base URL
    regen_max_new_tokens: int = 256
    regen_temperature: float = 0.0
    # a regenerated answer that ends in a repetition loop (a greedy small target often repeats a sentence until the
    # length cap): keep it as written | mask (the loop stays as context, its tokens and the end of the turn leave
    # the loss: the draft is not taught to loop) | drop (the sample is skipped and reported)
    regen_loops: str = "keep"
    # rows decoded at once (a finished row is given the next prompt); through vLLM (target.backend=vllm), the
    # prompts handed to the engine at a time (at least 64; the engine batches them by tokens itself)
    regen_batch_size: int = 16
    regen_cuda_graphs: bool = True  # on CUDA, replay each decoding step of local regeneration as a CUDA graph
    regen_concurrency: int = 8  # requests in flight to an OpenAI-compatible server
    regen_timeout_s: float = 120.0  # per request to a server
    regen_retries: int = 3  # per request, on connection errors, timeouts, 429 and 5xx
    # torch threads for local regeneration; 0 = torch's default. On cores shared with other
    # processes one thread was 5-10x faster than two (docs/PERFORMANCE.md)
    regen_threads: int = 0
    # extra end-of-turn tokens, besides the tokenizer's eos and the generation config's eos ids:
    # they end a regenerated response and close the assistant's loss-mask span
    stop_tokens: list[str] = field(default_factory=list)
    # extra variables for the target's chat template, in every render and in each request of endpoint
    # regeneration, e.g. {enable_thinking: false} to match a Qwen3 deployment that does not think
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    draft_vocab: int = 32000
    seed: int = 0
    # an input record (a JSONL line, a JSON document's entry, a Parquet row) larger than this is skipped and
    # reported before it is parsed or tokenized
    max_record_mb: float = 16.0

    def __post_init__(self):
        _check_fields("data", self)
        _one_of("data.format", self.format, ("auto", "sharegpt", "openai", "prompt-response"))
        _one_of("data.on_long", self.on_long, ("drop", "truncate"))
        _at_least("data.max_length", self.max_length, 8)
        _at_least("data.draft_vocab", self.draft_vocab, 1)
        _at_least("data.num_prompts", self.num_prompts, 0)
        _at_least("data.self_prompts", self.self_prompts, 0)
        if self.self_prompts and self.regenerate is None:
            raise ConfigError(f"data.self_prompts={self.self_prompts} needs data.regenerate: the target's own prompts have "
                              f"no responses until it answers them; add --regenerate local (or a server URL)")
        if self.self_prompts and not 0 < self.self_prompt_temperature <= 2:
            raise ConfigError(f"data.self_prompt_temperature={self.self_prompt_temperature!r} must lie in (0, 2]: "
                              f"greedy decoding would write the same request every time")
        _at_least("data.self_prompt_max_tokens", self.self_prompt_max_tokens, 1)
        if any(not isinstance(o, str) or not o.strip() for o in self.self_prompt_openers):
            raise ConfigError(f"data.self_prompt_openers={self.self_prompt_openers!r}: each opener must be a "
                              f"non-empty string (the start of a user request)")
        if not 0 < self.self_prompt_opener_share <= 1:
            raise ConfigError(f"data.self_prompt_opener_share={self.self_prompt_opener_share!r} must lie in (0, 1]")
        if self.regenerate is not None and self.regenerate != "local" \
                and not self.regenerate.startswith(("http://", "https://")):
            raise ConfigError(f"data.regenerate={self.regenerate!r} is not valid; choose one of: none, local, "
                              f"or a server URL such as http://127.0.0.1:8000/v1")
        _at_least("data.regen_max_new_tokens", self.regen_max_new_tokens, 1)
        _at_least("data.regen_temperature", self.regen_temperature, 0.0, " (0 = greedy)")
        _one_of("data.regen_loops", self.regen_loops, ("keep", "mask", "drop"))
        if self.regen_loops != "keep" and self.regenerate is None:
            raise ConfigError(f"data.regen_loops={self.regen_loops} acts on regenerated answers, and data.regenerate "
                              f"is off: set data.regenerate (local or a server URL) or leave data.regen_loops=keep")
        _at_least("data.regen_batch_size", self.regen_batch_size, 1)
        _at_least("data.regen_concurrency", self.regen_concurrency, 1)
        if self.regen_timeout_s <= 0:
            raise ConfigError(f"data.regen_timeout_s={self.regen_timeout_s!r} must be > 0")
        _at_least("data.regen_retries", self.regen_retries, 0)
        _at_least("data.regen_threads", self.regen_threads, 0, " (0 = torch's default)")
        if any(not t for t in self.stop_tokens):
            raise ConfigError(f"data.stop_tokens={self.stop_tokens!r} holds an empty token")
        # it goes into the regeneration settings' hash and into each request's JSON body
        _json_mapping("data.chat_template_kwargs", self.chat_template_kwargs)
        taken = sorted(set(self.chat_template_kwargs) & set(_RENDER_ARGUMENTS))
        if taken:
            raise ConfigError(f"data.chat_template_kwargs sets {', '.join(taken)}, which eyas sets itself; give "
                              f"only the template's own variables, such as enable_thinking")
        if self.max_record_mb <= 0:
            raise ConfigError(f"data.max_record_mb={self.max_record_mb!r} must be > 0: larger input records are "
                              f"skipped before they are parsed")


# the hidden-state store's dtypes (eyas/store/codec.py PARTS says what each stores in which dtype)
STORE_DTYPES = ("fp32", "bf16", "fp8", "fp8-aux")


@dataclass
class CaptureConfig:
    mode: str = "store"  # store (write a hidden-state store) | online (no disk; train runs the target)
    # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp8 | fp8-aux (fp8 auxiliary states, bf16 final state:
    # the target's distribution in training stays as exact as bf16's; eyas/store/codec.py)
    dtype: str = "auto"
    token_budget: int = 0  # tokens per forward pass; 0 = derived from free memory
    shard_tokens: int = 65536  # tokens per shard file
    ram_budget_gb: float = 0.0  # CPU: memory for activations when token_budget is 0; 0 = a quarter of free RAM
    inject_oom_tokens: int = 0  # testing: forward passes over this many (padded) tokens raise OutOfMemoryError

    def __post_init__(self):
        _check_fields("capture", self)
        _one_of("capture.mode", self.mode, ("store", "online"))
        _one_of("capture.dtype", self.dtype, ("auto", *STORE_DTYPES))
        _at_least("capture.token_budget", self.token_budget, 0, " (0 = derived from free memory)")
        _at_least("capture.shard_tokens", self.shard_tokens, 1)
        _at_least("capture.ram_budget_gb", self.ram_budget_gb, 0.0, " (0 = a quarter of free RAM)")
        _at_least("capture.inject_oom_tokens", self.inject_oom_tokens, 0, " (0 = off)")


@dataclass
class TrainConfig:
    steps: int = 0  # optimizer steps; 0 = derive from epochs
    epochs: float = 1.0
    ttt: int = 7  # training-time-test length K
    features: str = "fused"  # fused (EAGLE-3: all aux layers) | last (EAGLE-2 style baseline)
    lr: float = 1e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    batch_tokens: int = 8192  # tokens per micro-batch (padded)
    grad_accum: int = 1
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    adam_beta2: float = 0.95  # AdamW's second-moment decay (SpecForge and torch's default: 0.999)
    # shuffled: each batch a random mix of lengths | sorted: length-sorted windows (less padding, but each batch
    # holds one length, and the draft came out worse on held-out samples: docs/PERFORMANCE.md)
    batching: str = "shuffled"
    loss_decay: float = 0.8  # weight of step k is loss_decay**k
    # the per-position loss: kl (soft cross-entropy against the target, i.e. forward KL) | lk_alpha (-log of the
    # acceptance rate alpha = sum min(p, q)) | lk_hybrid (exp(-lk_eta*alpha) KL + the rest (1 - alpha)): the LK
    # losses of arXiv 2602.23881, which train for acceptance directly (docs/ALGORITHM.md section 3)
    loss: str = "kl"
    lk_eta: float = 3.0
    # three departures from EAGLE's and SpecForge's reference loss, off by default (docs/ALGORITHM.md section 3):
    # true drops positions whose target top-1 token is outside the draft vocabulary (the reference does)
    mask_oov_target: bool = False
    # whose loss_mask counts a prediction: predicted (the predicted token's) | position (the token at the step's
    # own position, two before the predicted one: the reference's)
    loss_mask_token: str = "predicted"
    # a step's loss averaged over its counted positions (counted) | over all B*T positions of the batch (all: the
    # reference's)
    loss_norm: str = "counted"
    # EAGLE 3.1 draft layout, served by vLLM, SGLang and speculators (docs/ALGORITHM.md section 2): an RMSNorm per
    # aux state before fc; the normed output fed back as the next step's hidden input
    fc_norm: bool = False
    norm_output: bool = False
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    fsdp: bool = False
    seed: int = 0
    log_every: int = 10
    save_every: int = 200
    keep_last: int = 2
    attention: str = "dense"  # dense | flex (FlexAttention, CUDA) | reference: the TTT attention kernel
    compile: bool = False  # torch.compile the unrolled draft step (CUDA only; ignored on CPU)
    # with compile: also compile the soft cross-entropy's passes over the [N, Vd] logits (eager, they were most
    # of the element-wise time of a SmolLM2-sized step): 2.21x faster steps on an H200, same loss (the full
    # preset turns it on; docs/PERFORMANCE.md). Costs about 80 s of compiling once
    compile_loss: bool = False
    # samples held out of training, scored every val_every steps (0 = none): simulated tau over all their answer
    # tokens and over those outside repeats (val_tau_fresh), where a draft cannot simply copy
    val_samples: int = 0
    val_every: int = 100  # optimizer steps between held-out scorings (and at the last step)
    # start from this draft's weights and vocabulary (a run dir, checkpoint or export eyas can load) instead of
    # a fresh draft: fine-tuning on this run's data, with a fresh optimizer and schedule ("" = a new draft)
    init_from: str = ""
    # a step whose loss or gradient is not finite is skipped and counted; this many in a row stop training with
    # an error (the last good checkpoint is kept)
    max_bad_steps: int = 3
    save_every_minutes: float = 10.0  # also write a checkpoint after this much wall time (0 = by steps only)
    # which draft family `eyas train` trains: eagle3 (EAGLE-3 with training-time test) or dflash (a block-diffusion
    # draft, the dflash section); `eyas run` trains, evaluates and exports each one listed, from one store
    method: list[str] = field(default_factory=lambda: ["eagle3"])
    # the draft's rotary embedding: target (the target's rope_theta and scaling; linear and llama3 scaling are
    # implemented) or plain (the target's rope_theta, no scaling: for targets with YaRN, such as Kimi K2 and
    # DeepSeek V3; peers' drafts for Kimi have no rope scaling either). The export writes it into the draft's config
    rope: str = "target"

    def __post_init__(self):
        _check_fields("train", self)
        _one_of("train.rope", self.rope, ROPES)
        _one_of("train.attention", self.attention, ("dense", "flex", "reference"))
        _one_of("train.features", self.features, ("fused", "last"))
        _one_of("train.dtype", self.dtype, ("auto", "fp32", "bf16"))
        _one_of("train.loss", self.loss, ("kl", "lk_alpha", "lk_hybrid"))
        _one_of("train.loss_mask_token", self.loss_mask_token, ("predicted", "position"))
        _one_of("train.loss_norm", self.loss_norm, ("counted", "all"))
        _one_of("train.batching", self.batching, ("sorted", "shuffled"))
        if not 0 <= self.lk_eta <= 100:
            raise ConfigError(f"train.lk_eta={self.lk_eta!r} must lie in [0, 100]: the KL weight of train.loss="
                              f"lk_hybrid is exp(-lk_eta * acceptance); 0 is pure KL, the LK paper uses 3")
        if not 1 <= self.ttt <= MAX_TTT:
            raise ConfigError(f"train.ttt={self.ttt!r} must lie in [1, {MAX_TTT}]: each training-time-test step "
                              f"keeps its activations for the backward pass, so memory grows with ttt "
                              f"(EAGLE-3 uses 7)")
        if not 0 < self.lr <= MAX_LR:
            raise ConfigError(f"train.lr={self.lr!r} must lie in (0, {MAX_LR:g}]: AdamW moves each weight by about "
                              f"lr per step, so a larger rate wrecks the draft in a step (typical: 1e-4 to 2e-3)")
        _at_least("train.steps", self.steps, 0, " (0 = derived from train.epochs)")
        if self.epochs <= 0:
            raise ConfigError(f"train.epochs={self.epochs!r} must be > 0")
        _at_least("train.warmup_steps", self.warmup_steps, 0)
        _in_range("train.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        if not 0 < self.adam_beta2 < 1:
            raise ConfigError(f"train.adam_beta2={self.adam_beta2!r} must lie in (0, 1) (typical: 0.95 to 0.999)")
        for key in ("batch_tokens", "grad_accum", "log_every", "save_every", "keep_last", "val_every"):
            _at_least(f"train.{key}", getattr(self, key), 1)
        _at_least("train.val_samples", self.val_samples, 0, " (0 = no held-out samples)")
        if self.grad_clip <= 0:
            raise ConfigError(f"train.grad_clip={self.grad_clip!r} must be > 0")
        _at_least("train.weight_decay", self.weight_decay, 0.0)
        if not 0 < self.loss_decay <= 1:
            raise ConfigError(f"train.loss_decay={self.loss_decay!r} must lie in (0, 1]")
        _at_least("train.max_bad_steps", self.max_bad_steps, 1, " (consecutive non-finite steps that stop training)")
        _at_least("train.save_every_minutes", self.save_every_minutes, 0.0, " (0 = save by steps only)")
        if not self.method or len(set(self.method)) != len(self.method):
            raise ConfigError(f"train.method={self.method!r}: name eagle3, dflash or both, each once")
        for m in self.method:
            _one_of("train.method", m, METHODS)


@dataclass
class DFlashTrainConfig:
    """The DFlash draft and its training (train.method=dflash; docs/ALGORITHM.md section 7). The rest of the
    train section (steps or epochs, batch_tokens, warmup, clipping, checkpoints) applies as for EAGLE-3."""

    block_size: int = 16  # tokens per drafted block: the anchor and block_size - 1 guesses
    layers: int = 1  # draft decoder layers (the released DFlash drafts of 4B-8B targets have 5)
    # target layers fused into the context feature, in eyas's numbering (HF hidden_states indices, as
    # target.aux_layers); empty = the store's aux layers
    target_layers: list[int] = field(default_factory=list)
    mask_token_id: int = -1  # the id of the block's mask slots; -1 = the target's pad token, else its eos
    gamma: float = 7.0  # slot k's loss weight is exp(-(k - 1) / gamma) (the reference: 7 for blocks of 16)
    anchors: int = 512  # blocks drawn per sample at most (and at most block_tokens // block_size per micro-batch)
    # the blocks' query tokens per micro-batch at most; 0 = train.batch_tokens, which draws one anchor per block_size
    # stored tokens. The reference trainers draw up to `anchors` per sample; more blocks cost memory (their logits
    # over the target's whole vocabulary) and time per step
    block_tokens: int = 0
    lr: float = 0.0  # 0 = train.lr (the reference trains DFlash at 6e-4)

    def __post_init__(self):
        _check_fields("dflash", self)
        if not 2 <= self.block_size <= MAX_TTT:
            raise ConfigError(f"dflash.block_size={self.block_size!r} must lie in [2, {MAX_TTT}] (the reference uses 16)")
        if not 1 <= self.layers <= 64:
            raise ConfigError(f"dflash.layers={self.layers!r} must lie in [1, 64]")
        if self.gamma <= 0:
            raise ConfigError(f"dflash.gamma={self.gamma!r} must be > 0 (slot k's weight is exp(-(k - 1) / gamma))")
        _at_least("dflash.anchors", self.anchors, 1)
        _at_least("dflash.block_tokens", self.block_tokens, 0, " (0 = train.batch_tokens)")
        _at_least("dflash.mask_token_id", self.mask_token_id, -1, " (-1 = the target's pad token, else its eos)")
        if not 0 <= self.lr <= MAX_LR:
            raise ConfigError(f"dflash.lr={self.lr!r} must lie in [0, {MAX_LR:g}] (0 = train.lr)")
        if any(x < 1 for x in self.target_layers):
            raise ConfigError(f"dflash.target_layers={self.target_layers!r}: layers are numbered from 1 (HF "
                              f"hidden_states indices; 0 is the embedding output)")


@dataclass
class EvalConfig:
    benches: list[str] = field(default_factory=lambda: ["mt-bench", "humaneval"])
    steps: list[int] = field(default_factory=lambda: [3, 5, 7])  # chain lengths to measure
    tree: str | None = None  # "TOPK,DEPTH,TOTAL", e.g. "4,5,16"; None = no tree run
    temperature: float = 0.0
    max_new_tokens: int = 128
    limit: int = 0  # prompts per benchmark; 0 = all
    hf_baseline: bool = True  # also time transformers `generate` on the same prompts (plain decoding is always timed)
    threads: int = 0  # torch CPU threads for eval; 0 = torch's default (1 is often faster on shared cores)
    cuda_graphs: bool = True  # on a GPU, greedy chains, trees and plain decoding replay CUDA graphs (no effect on CPU)
    # on a GPU with eval.cuda_graphs, the draft-side passes (a chain's or a tree's drafting with its
    # bookkeeping, a rebuild) are compiled by torch.compile (inductor) before their graphs are captured, so that
    # their small kernels fuse: a tree 16,4,48 cycle 1.64 -> 1.46 plain steps on an H200, 1.78x -> 1.97x on
    # MT-bench (docs/PERFORMANCE.md). Compiling costs some seconds per setting at its first
    # generation. No effect elsewhere (a warning says so); `eyas eval --compile-draft` refuses to run there
    compile_draft: bool = False

    def __post_init__(self):
        _check_fields("eval", self)
        if not self.benches:
            raise ConfigError("eval.benches is empty; give mt-bench, mt-bench-1, humaneval or a JSONL file of prompts")
        if not self.steps or any(k < 1 for k in self.steps):
            raise ConfigError(f"eval.steps={self.steps}: give at least one chain length, each >= 1")
        if self.tree is not None:
            parts = self.tree.split(",")
            if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
                raise ConfigError(f"eval.tree={self.tree!r} must be TOPK,DEPTH,TOTAL with positive integers, e.g. 4,5,16")
        _at_least("eval.temperature", self.temperature, 0.0, " (0 = greedy)")
        _at_least("eval.max_new_tokens", self.max_new_tokens, 1)
        _at_least("eval.limit", self.limit, 0, " (0 = all prompts)")
        _at_least("eval.threads", self.threads, 0, " (0 = torch's default)")


@dataclass
class ExportConfig:
    formats: list[str] = field(default_factory=lambda: ["sglang", "vllm", "speculators"])
    dtype: str = "bf16"  # float weights in the serving dtype: bf16 | fp16 | fp32
    embed_tokens: bool = False  # also write the target's embedding (engines take it from the target)

    def __post_init__(self):
        _check_fields("export", self)
        if not self.formats:
            raise ConfigError("export.formats is empty; choose from: sglang, vllm, speculators")
        for f in self.formats:
            _one_of("export.formats", f, ("sglang", "vllm", "speculators"))
        _one_of("export.dtype", self.dtype, ("bf16", "fp16", "fp32"))


@dataclass
class RunConfig:
    name: str = "custom"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    dflash: DFlashTrainConfig = field(default_factory=DFlashTrainConfig)

    def __post_init__(self):
        # options of two sections that cannot hold together
        if self.train.ttt > self.data.max_length:
            raise ConfigError(f"train.ttt={self.train.ttt} is longer than data.max_length={self.data.max_length}: "
                              f"a sample has no tokens for the later training-time-test steps")
        if self.target.backend == "vllm" and self.capture.mode == "online":
            raise ConfigError("capture.mode=online runs the target with transformers inside every training process, "
                              "which target.backend=vllm is chosen to avoid: use capture.mode=store (the engine "
                              "writes the store, training reads it) or target.backend=hf")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig) if f.name != "name"}
_SECTION_CLASSES = {
    "target": TargetConfig, "data": DataConfig, "capture": CaptureConfig,
    "train": TrainConfig, "eval": EvalConfig, "export": ExportConfig, "dflash": DFlashTrainConfig,
}


# ---------------------------------------------------------------- presets

def tiny() -> RunConfig:
    """A random 4-layer Llama made in code: the whole pipeline in seconds, for tests."""
    return RunConfig(
        name="tiny",
        target=TargetConfig(model="tiny"),
        # the tiny tokenizer is byte-level: a corpus prompt with the chat template is 200-700 tokens
        data=DataConfig(num_prompts=48, max_length=768, regenerate="local", regen_max_new_tokens=24,
                        regen_batch_size=16, draft_vocab=256),
        capture=CaptureConfig(dtype="fp32", token_budget=4096, shard_tokens=4096),
        train=TrainConfig(steps=12, ttt=3, lr=1e-3, warmup_steps=2, batch_tokens=2048, log_every=4,
                          save_every=6),
        eval=EvalConfig(benches=["mt-bench"], steps=[3], tree="2,3,6", max_new_tokens=16, limit=2),
    )


def demo() -> RunConfig:
    """SmolLM2-135M-Instruct on CPU: a real draft end to end in about 12 minutes on 2 cores."""
    return RunConfig(
        name="demo",
        target=TargetConfig(model="smollm2"),
        data=DataConfig(num_prompts=200, max_length=384, regenerate="local", regen_max_new_tokens=80,
                        regen_batch_size=25, draft_vocab=4096),
        capture=CaptureConfig(dtype="bf16", shard_tokens=32768),
        # about 4 passes over the ~35k captured tokens; TTT 3 keeps a step affordable on 2 cores
        train=TrainConfig(steps=50, ttt=3, lr=2e-3, warmup_steps=5, batch_tokens=4096,
                          log_every=5, save_every=25),
        # on 2 CPU cores a speculative cycle costs more than a plain step: the demo shows tau, not speedup
        eval=EvalConfig(benches=["mt-bench", "humaneval"], steps=[3], tree=None, max_new_tokens=48, limit=4,
                        hf_baseline=False),
    )


def full() -> RunConfig:
    """SmolLM2 on one GPU: 27,000 regenerated samples, a K = 7 draft, chains and a tree on two benchmarks
    (its figures, and how each choice was measured: docs/PERFORMANCE.md)."""
    return RunConfig(
        name="full",
        target=TargetConfig(model="smollm2"),
        # 512 regeneration slots, each refilled as its row ends, one CUDA graph per decoding step. Most prompts are
        # chat requests the target writes itself (data.self_prompts): a draft trained on the corpus prompts alone
        # (made from Python docstrings) learns little that carries over to chat benchmarks
        data=DataConfig(num_prompts=1500, self_prompts=25500, max_length=2048, regenerate="local",
                        regen_max_new_tokens=512, regen_batch_size=512, draft_vocab=32000),
        capture=CaptureConfig(dtype="bf16", shard_tokens=262144),
        # flex attention + torch.compile for the fastest training step; many smaller steps with a short warmup;
        # 120 samples held out, because the accuracy on training batches hides how the draft does on new text.
        # EAGLE 3.1's two norms lifted held-out tau on every store they were measured on (docs/PERFORMANCE.md)
        train=TrainConfig(epochs=4, ttt=7, lr=5e-4, warmup_steps=40, batch_tokens=32768, log_every=20,
                          save_every=1000, attention="flex", compile=True, compile_loss=True, val_samples=120,
                          val_every=100, fc_norm=True, norm_output=True),
        # greedy chains, the tree and plain decoding replay CUDA graphs (one device read per cycle) and the
        # draft's passes are compiled, which makes a deep, wide tree cheap: 24,6,120 gave the best speedup among
        # the trees timed on bench/prompts/select.jsonl, prompts that no benchmark holds
        eval=EvalConfig(benches=["mt-bench", "humaneval"], steps=[3, 5, 7], tree="24,6,120", max_new_tokens=256,
                        limit=12, hf_baseline=False, compile_draft=True),
    )


PRESETS = {"tiny": tiny, "demo": demo, "full": full}


def preset(name: str) -> RunConfig:
    """A preset, with every value coerced to its field's type exactly as a YAML file's would be (a preset
    writing `epochs=4` for a float field must fingerprint the same as the config.yaml saved from it)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return config_from_dict(PRESETS[name]().to_dict())


# ---------------------------------------------------------------- overrides

def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check (and, for strings from the command line, convert) a value against a field type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if origin is list:
        (item,) = args
        if isinstance(value, str):  # "3,5,7", or as YAML writes a list: "[3, 5, 7]", '["a, b", "c"]'
            text = value.strip()
            if text.startswith("[") and text.endswith("]") and ('"' in text or "'" in text):
                import yaml

                try:  # quoted items may hold commas: read it as the YAML flow list it is
                    value = yaml.safe_load(text)
                except yaml.YAMLError as e:
                    raise ConfigError(f"{key}: cannot read {value!r} as a list ({str(e).splitlines()[0]})") from None
            else:
                if text.startswith("[") and text.endswith("]"):
                    text = text[1:-1]
                value = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, v, item) for v in value]
    if origin is dict:  # a mapping from YAML, or its flow form from the command line: "{enable_thinking: false}"
        if isinstance(value, str):
            import yaml

            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as e:
                raise ConfigError(f"{key}: cannot read {value!r} as a mapping ({str(e).splitlines()[0]})") from None
        if value is None:  # an empty value
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping of names to values, e.g. {{enable_thinking: false}}, "
                              f"got {value!r}")
        return dict(value)
    return _scalar(key, value, tp)


def _scalar(key: str, value: Any, tp: Any) -> Any:
    """A bool, int, float or str field's value, converted from a command-line string where it is one."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):  # "1e999" reads as infinity
            raise ConfigError(f"{key}={value!r}: expected a finite number, not NaN or infinity")
        return number
    if tp is str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise AssertionError(f"unsupported config field type {tp} for {key}")


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def apply_overrides(cfg: RunConfig, updates: dict[str, dict[str, Any]]) -> RunConfig:
    """Return a new config with {section: {key: value}} applied; every key and value is checked."""
    sections = {name: dataclasses.asdict(getattr(cfg, name)) for name in _SECTION_CLASSES}
    name = cfg.name
    for section, values in updates.items():
        if section == "name":
            if not isinstance(values, (str, int, float)) or isinstance(values, bool):
                raise ConfigError(f"name: expected a string, got {values!r} (name has no keys: write name=VALUE)")
            name = str(values)
            continue
        if section not in _SECTION_CLASSES:
            raise ConfigError(f"unknown config section {section!r}; valid sections: name, {', '.join(_SECTION_CLASSES)}")
        if not isinstance(values, dict):
            raise ConfigError(f"config section {section!r} must be a mapping of key: value")
        types_ = _field_types(_SECTION_CLASSES[section])
        for key, value in values.items():
            if key not in types_:
                raise ConfigError(f"unknown key {section}.{key}; valid keys: {', '.join(types_)}")
            sections[section][key] = _coerce(f"{section}.{key}", value, types_[key])
    built = {s: cls(**sections[s]) for s, cls in _SECTION_CLASSES.items()}  # __post_init__ validates
    return RunConfig(name=name, **built)


def parse_set(items: list[str]) -> dict[str, dict[str, Any]]:
    """Turn ["train.lr=3e-4", "data.data=a.jsonl,b.jsonl", "name=x"] into {section: {key: "value"}, "name": "x"}."""
    updates: dict[str, dict[str, Any]] = {}
    for item in items:
        if item.split("=", 1)[0].strip() == "name" and "=" in item:
            updates["name"] = item.split("=", 1)[1]  # type: ignore[assignment]
            continue
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=3e-4")
        lhs, value = item.split("=", 1)
        section, key = lhs.strip().split(".", 1)
        updates.setdefault(section, {})[key] = value
    return updates


# a config is a few KB of YAML; a larger file given as one is not a config
MAX_CONFIG_BYTES = 1 << 20


def _read_yaml(path: Path) -> Any:
    """The YAML document of a config file, or a ConfigError that says why the file is not one."""
    import yaml

    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size:,} bytes is too large for a config file "
                              f"(at most {MAX_CONFIG_BYTES:,}); give a YAML config or a preset name")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a YAML text file (byte {e.start} is not UTF-8); give a YAML config or a "
                          f"preset name ({', '.join(PRESETS)})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror or type(e).__name__})") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None


def load_config(source: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Resolve a preset name or YAML path (default: demo), then apply --set overrides."""
    source = source or "demo"
    if source in PRESETS:
        cfg = preset(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"{source!r} is neither a preset ({', '.join(PRESETS)}) nor a YAML file")
        doc = _read_yaml(path)
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        base = doc.pop("preset", None)
        cfg = preset(base) if base else RunConfig(name=path.stem)
        cfg = apply_overrides(cfg, doc)
    if overrides:
        cfg = apply_overrides(cfg, parse_set(overrides))
    return cfg


def config_from_dict(doc: dict) -> RunConfig:
    doc = dict(doc)
    name = doc.pop("name", "custom")
    return apply_overrides(RunConfig(name=name), doc)
