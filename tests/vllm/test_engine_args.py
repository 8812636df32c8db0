"""The extraction engine's arguments and checks, without starting an engine (runs without vLLM too)."""

import builtins
import importlib.util
import json

import pytest

from eyas.common import EyasError
from eyas.target.vllm.engine import cpu_mla_fp32_fix, cpu_rope_fix, engine_kwargs, engine_layer_ids, require_vllm


def test_layer_ids_are_hf_ids_plus_the_last_layer():
    assert engine_layer_ids([2, 15, 27], 30) == [2, 15, 27, 30]
    for bad in ([0, 2], [2, 31], []):
        with pytest.raises(EyasError, match=r"must lie in 1\.\.30"):
            engine_layer_ids(bad, 30)
    with pytest.raises(EyasError, match="final_hidden"):
        engine_layer_ids([2, 30], 30)


def test_kwargs_pass_the_users_engine_through_and_add_extraction():
    user = {"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "gpu_memory_utilization": 0.9,
            "max_model_len": 4096, "quantization": "fp8", "enable_expert_parallel": True}
    kw = engine_kwargs("/models/kimi", [2, 30, 58, 61], "/tmp/states", "bf16", dict(user))
    assert {k: kw[k] for k in user} == user
    assert kw["model"] == "/models/kimi" and kw["dtype"] == "bfloat16"
    assert kw["enable_chunked_prefill"] is False and kw["enable_prefix_caching"] is False
    spec = kw["speculative_config"]
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58, 61]
    kv = kw["kv_transfer_config"]
    assert kv["kv_connector_module_path"] == "eyas.target.vllm.connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/tmp/states"
    assert engine_kwargs("m", [1, 4], "s", "auto", {"dtype": "half"})["dtype"] == "half"  # the user's wins
    assert "trust_remote_code" not in kw  # off unless the config says so
    assert engine_kwargs("m", [1, 4], "s", "bf16", {}, trust_remote_code=True)["trust_remote_code"] is True
    assert engine_kwargs("m", [1, 4], "s", "bf16", {"trust_remote_code": False},
                         trust_remote_code=True)["trust_remote_code"] is False  # target.engine says otherwise


@pytest.mark.parametrize("engine, match", [({"enable_chunked_prefill": True}, "enable_chunked_prefill"),
                                           ({"enable_prefix_caching": True}, "enable_prefix_caching"),
                                           ({"speculative_config": {}}, "speculative_config is set by eyas")])
def test_kwargs_refuse_what_extraction_cannot_run_with(engine, match):
    with pytest.raises(EyasError, match=match):
        engine_kwargs("m", [1, 4], "s", "fp32", engine)


def test_missing_vllm_is_one_line_with_the_install_command(monkeypatch):
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(EyasError, match="pip install") as e:
        require_vllm()
    assert "\n" not in str(e.value)


def test_vllm_without_extraction_is_refused(monkeypatch):
    from conftest import require_vllm as vllm_or_skip

    vllm_or_skip()
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.endswith("extract_hidden_states") else real_find(name, *a))
    with pytest.raises(EyasError, match="cannot extract hidden states.*pip install") as e:
        require_vllm()
    assert "\n" not in str(e.value)


def test_cpu_rope_fix_selects_the_pytorch_rope_unless_the_user_chose():
    kw = cpu_rope_fix({"model": "m", "compilation_config": {"custom_ops": ["+rms_norm"], "level": 0}})
    assert kw["compilation_config"] == {"custom_ops": ["+rms_norm", "-rotary_embedding"], "level": 0}
    assert cpu_rope_fix({"model": "m"})["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}
    mine = {"model": "m", "compilation_config": {"custom_ops": ["+rotary_embedding"]}}
    assert cpu_rope_fix(mine) == mine  # the user named the op: left as given


def test_an_fp32_mla_engine_gets_the_reference_cpu_mla_backend(tmp_path):
    mla, gqa = tmp_path / "mla", tmp_path / "gqa"
    for d, cfg in ((mla, {"model_type": "deepseek_v3", "kv_lora_rank": 32}), (gqa, {"model_type": "llama"})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    assert cpu_mla_fp32_fix({"model": str(mla), "dtype": "float32"})["attention_backend"] == "CPU_MLA"
    for kw in ({"model": str(mla), "dtype": "bfloat16"},  # AMX MLA takes bf16
               {"model": str(gqa), "dtype": "float32"},  # not MLA
               {"model": str(mla), "dtype": "float32", "attention_backend": "AMX_MLA"},  # the user chose
               {"model": str(mla), "dtype": "float32", "attention_config": {"backend": "AMX_MLA"}},
               {"model": "org/hub-id", "dtype": "float32"}):  # no local config to read
        assert cpu_mla_fp32_fix(kw) == kw
