"""Prompts (token ids) -> per-sample hidden states through a vLLM extraction engine, in eyas's convention.

Each prompt is one request with max_tokens=1: the prefill runs the whole prompt, the connector writes the
request's states ([T, A+1, H]: the aux ids, then id n before the final norm) to a file, and this module reads
the file under its lock, deletes it, and returns `aux_hidden [T, A*H]` and `final_hidden [T, H]` (the
target's final norm applied to id n, so it equals HF's `hidden_states[n]`, the lm_head's input). Files live
only between the engine's write and this read: at most one call's prompts are on disk at a time.

A prompt the engine refuses (as long as or longer than its max_model_len) is returned in `refused` with
the reason, never dropped silently. Called like `FeatureCapture` (padded `[B, L]` ids and mask), a refused
prompt is an EyasError naming it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass, field

import torch

from eyas.common import EyasError


@dataclass
class Captured:
    """The states of the accepted prompts, in the order given, and the refused ones."""

    states: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # index -> (aux, final)
    refused: dict[int, str] = field(default_factory=dict)  # index -> the engine's reason


def read_states(path: str) -> torch.Tensor:
    """The connector's file at `path` ([T, L, H]) once its writer released the lock; the file and lock removed."""
    from safetensors.torch import load_file

    lock = f"{path}.lock"
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # sleeps until the connector's writer thread releases its lock
        states = load_file(path)["hidden_states"]  # [T, L, H]
    os.unlink(path)
    os.unlink(lock)
    return states


class VllmFeatures:
    """`capture(list of token-id lists) -> Captured` through `engine` (an ExtractionEngine); `norm` is the
    target's final norm (a module or any callable [T, H] -> [T, H]). Also `FeatureCapture`'s call and
    attributes (`target`: the loaded target whose identity, head and norm the store records)."""

    def __init__(self, engine, norm, target=None):
        self.engine, self.norm, self.target = engine, norm, target
        self.aux_layers = list(engine.aux_layers)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """`(input_ids [B,L], attention_mask [B,L]) -> (aux_hidden [B,L,A*H], final_hidden [B,L,H])`, right
        padding as `FeatureCapture` takes it; padded positions hold zeros."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        lengths = attention_mask.sum(1).tolist()
        assert all(bool(attention_mask[b, :n].all()) for b, n in enumerate(lengths)), "expected right padding"
        got = self.capture([input_ids[b, :n].tolist() for b, n in enumerate(lengths)])
        if got.refused:
            i, reason = next(iter(got.refused.items()))
            raise EyasError(f"the vLLM engine refused {len(got.refused)} of {len(lengths)} prompts (prompt {i}: "
                            f"{reason}); raise target.engine.max_model_len or lower data.max_length")
        (aux0, final0) = got.states[0]
        batch, longest = input_ids.shape
        aux = aux0.new_zeros(batch, longest, aux0.shape[-1])  # [B, L, A*H]
        final = final0.new_zeros(batch, longest, final0.shape[-1])  # [B, L, H]
        for b, n in enumerate(lengths):
            aux[b, :n], final[b, :n] = got.states[b]
        return aux, final

    @property
    def num_aux(self) -> int:
        return len(self.aux_layers)

    def capture(self, prompts: list[list[int]]) -> Captured:
        out = Captured()
        paths, out.refused = self.engine.extract(prompts)
        for i, path in paths.items():
            out.states[i] = self._split(read_states(path), len(prompts[i]))
        return out

    @torch.inference_mode()
    def _split(self, states: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert states.shape[0] == num_tokens and states.shape[1] == self.num_aux + 1, \
            f"the engine wrote states of shape {tuple(states.shape)} for {num_tokens} tokens and {self.num_aux}+1 layers"
        aux = states[:, :-1].reshape(num_tokens, -1)  # [T, A*H], layers in the order asked
        last = states[:, -1]  # [T, H], before the final norm
        dtype = next(self.norm.parameters()).dtype if isinstance(self.norm, torch.nn.Module) else last.dtype
        return aux, self.norm(last.to(dtype)).to(states.dtype)  # [T, A*H], [T, H]


def model_dir(target) -> str:
    """What vLLM loads for a loaded eyas target: the HF directory it was read from (a GGUF's cached conversion
    included), its hub id, or, for a target built in code, a copy saved into eyas's cache."""
    if target.path is not None:
        return str(target.path)
    from eyas.common import cache_dir

    out = cache_dir() / "vllm-models" / f"{target.name}-{target.identity['config_hash']}"
    if not (out / "config.json").is_file():
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        target.model.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    return str(out)


def engine_dtype(cfg) -> str:
    """The dtype the engine computes in: target.dtype, where `auto` is bf16 on a GPU and fp32 on the CPU (vLLM's
    own `auto` would take the checkpoint's, which the store could not name before the engine starts)."""
    if cfg.target.dtype != "auto":
        return cfg.target.dtype
    return "bf16" if torch.cuda.is_available() else "fp32"


def load_for_engine(cfg):
    """The target as capture through vLLM needs it in this process (identity, config, tokenizer, final norm and
    head, on the CPU in the engine's dtype); the engine loads the weights itself."""
    from eyas.target import load_target

    return load_target(cfg.target.model, device="cpu", dtype=engine_dtype(cfg),
                       trust_remote_code=cfg.target.trust_remote_code, weights="head")


def start_engine(cfg, *, target=None, states_dir=None):
    """An ExtractionEngine for the config's target (target.aux_layers, target.engine, the engine's dtype)."""
    from eyas.layers import resolve_aux_layers
    from eyas.target.vllm.engine import ExtractionEngine, require_vllm

    require_vllm()
    target = target or load_for_engine(cfg)
    ids = resolve_aux_layers(cfg.target.aux_layers, target.num_layers)
    return ExtractionEngine(model_dir(target), ids, target.num_layers, dtype=engine_dtype(cfg),
                            engine=cfg.target.engine, states_dir=states_dir,
                            trust_remote_code=cfg.target.trust_remote_code)


def connect(socket_path, target, aux_layers: list[int] | None) -> VllmFeatures:
    """`VllmFeatures` on the engine served at `socket_path` (eyas.target.vllm.service), which must extract the
    layers this config asks for."""
    from eyas.layers import resolve_aux_layers
    from eyas.target.vllm.service import RemoteEngine

    engine = RemoteEngine(socket_path)
    want = [*resolve_aux_layers(aux_layers, target.num_layers), target.num_layers]
    if engine.layer_ids != want:
        engine.close()
        raise EyasError(f"the engine on {socket_path} extracts layers {engine.layer_ids}, this capture needs {want} "
                        f"(target.aux_layers): start the engine with this config")
    return VllmFeatures(engine, target.norm, target)


def start_features(target, aux_layers: list[int] | None, *, dtype: str = "auto", engine: dict | None = None,
                   states_dir=None) -> VllmFeatures:
    """A vLLM engine for `target` asked for `aux_layers` (HF ids; None: the EAGLE-3 default) and n, as a
    `VllmFeatures`; `features.engine.close()` shuts the engine down."""
    from eyas.layers import resolve_aux_layers
    from eyas.target.vllm.engine import ExtractionEngine, require_vllm

    require_vllm()
    ids = resolve_aux_layers(aux_layers, target.num_layers)
    if dtype == "auto":  # the engine computes in the dtype the loaded target has (the store records it)
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[target.dtype]
    engine = ExtractionEngine(model_dir(target), ids, target.num_layers, dtype=dtype, engine=engine,
                              states_dir=states_dir)
    return VllmFeatures(engine, target.norm, target)


@contextlib.contextmanager
def extraction(target, aux_layers: list[int] | None, *, dtype: str = "auto", engine: dict | None = None,
               states_dir=None):
    """`start_features` for a `with` block: the engine is shut down when it ends, however it ends."""
    features = start_features(target, aux_layers, dtype=dtype, engine=engine, states_dir=states_dir)
    try:
        yield features
    finally:
        features.engine.close()
