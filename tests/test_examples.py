"""Every config in examples/ loads through the loader `eyas run CONFIG.yaml` and `--config` use, so a renamed or
removed key, or a value a section no longer accepts, fails here instead of in a user's first run. No vLLM or
GPU needed: only the config is read."""

from pathlib import Path

import pytest
import yaml

from eyas.common import save_config
from eyas.config import RunConfig, load_config
from eyas.layers import resolve_aux_layers

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_examples():
    names = {p.name for p in EXAMPLES}
    assert {"llama3-8b-multi-gpu.yaml", "kimi-k2.5-8xh200.yaml", "kimi-k2.5-2x8xh100.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_loads(path):
    cfg = load_config(str(path))
    assert isinstance(cfg, RunConfig)
    # every key the file sets reached the config: a key the loader dropped would leave the default in place
    doc = yaml.safe_load(path.read_text())
    for section, values in doc.items():
        if section in ("preset", "name"):
            continue
        for key, value in values.items():
            got = getattr(getattr(cfg, section), key)
            assert got == value or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                    and float(got) == float(value)), f"{path.name}: {section}.{key}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_survives_the_run_directory_round_trip(path, tmp_path):
    """`eyas run` saves the resolved config as RUN/config.yaml and every stage reads that file back."""
    cfg = load_config(str(path))
    saved = tmp_path / "config.yaml"
    save_config(cfg, saved)
    assert load_config(str(saved)) == cfg


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.stem.startswith("kimi-k2.5")], ids=lambda p: p.stem)
def test_kimi_examples_fit_the_engine_they_ask_for(path):
    cfg = load_config(str(path))
    engine = cfg.target.engine
    assert cfg.target.backend == "vllm" and cfg.target.trust_remote_code
    from eyas.target.vllm.engine import engine_kwargs  # target.trust_remote_code reaches the engine too

    assert engine_kwargs("DIR", [2, 30, 58, 61], "S", cfg.target.dtype, dict(engine), True)["trust_remote_code"]
    assert cfg.data.regenerate == "local"  # through the run's engine: one load for regeneration and capture
    # capture refuses a sample as long as the engine's max_model_len (the engine generates one token)
    assert engine["max_model_len"] > cfg.data.max_length
    # extraction runs with chunked prefill off, so one step must take the longest sample whole
    assert engine["max_num_batched_tokens"] >= engine["max_model_len"]
    assert "pipeline_parallel_size" not in engine  # a non-last vLLM pipeline stage drops its aux states
    # the aux ids docs/SCALE.md and the file's comment give for the 61-layer target
    assert cfg.target.aux_layers is None and resolve_aux_layers(None, 61) == [2, 30, 58]
