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
        todo = []
        for i, ids in enumerate(prompts):
            if len(ids) >= self.engine.max_model_len:
                out.refused[i] = (f"{len(ids)} tokens, the engine takes at most {self.engine.max_model_len - 1} "
                                  f"(max_model_len {self.engine.max_model_len} less the one token it generates)")
            elif len(ids) == 0:
                out.refused[i] = "an empty prompt"
            else:
                todo.append(i)
        try:
            paths = self._generate([prompts[i] for i in todo])
        except ValueError:  # one prompt the engine refuses fails the call: find it, run the rest
            paths = []
            for i in list(todo):
                try:
                    paths += self._generate([prompts[i]])
                except ValueError as e:
                    out.refused[i] = str(e).strip().splitlines()[0][:200]
                    todo.remove(i)
        for i, path in zip(todo, paths):
            out.states[i] = self._split(read_states(path), len(prompts[i]))
        return out

    def _generate(self, prompts: list[list[int]]) -> list[str]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outputs = self.engine.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts],
                                           params, use_tqdm=False)
        paths = []
        for output in outputs:
            params_out = output.kv_transfer_params or {}
            assert "hidden_states_path" in params_out, f"request {output.request_id} came back without its states"
            paths.append(params_out["hidden_states_path"])
        return paths

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
