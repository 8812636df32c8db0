"""What the engines read from an export: aux ids in each engine's own key, the flags that change the
draft's computation, the vocabulary mapping and the rope type. eyas.json never reaches an engine, so
the loader must not fill a gap in config.json from it."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.common import EyasError
from eyas.draft import DraftConfig
from eyas.formats import export, load_draft
from eyas.formats.configs import llama_layer_config
from test_export import sample_inputs, ttt_logits

SGL_KEY = "eagle_config.eagle_aux_hidden_state_layer_ids"
TOP_KEY = "eagle_aux_hidden_state_layer_ids"
REFUSED_FLAGS = ("norm_before_residual", "norm_before_fc")  # fc_norm, norm_output: tests/formats/test_eagle31.py


def edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _sglang_ids_only_at_top(cfg):  # the right HF ids in vLLM's key; SGLang never looks there
    del cfg["eagle_config"][TOP_KEY]
    cfg[TOP_KEY] = [1, 2, 3]


def _vllm_ids_only_in_eagle_config(cfg):  # the right SGLang ids in SGLang's key; vLLM never looks there
    cfg["eagle_config"][TOP_KEY] = [i - 1 for i in cfg.pop(TOP_KEY)]


@pytest.mark.parametrize("fmt, edit, message", [
    ("sglang", lambda c: c["eagle_config"].pop(TOP_KEY), rf"{SGL_KEY} is missing, but eyas.json says \[0, 1, 2\]"),
    ("sglang", _sglang_ids_only_at_top, rf"{SGL_KEY} is missing, but eyas.json says \[0, 1, 2\]"),
    ("vllm", lambda c: c.pop(TOP_KEY), r" eagle_aux_hidden_state_layer_ids is missing, but eyas.json says \[1, 2, 3\]"),
    ("vllm", _vllm_ids_only_in_eagle_config, r" eagle_aux_hidden_state_layer_ids is missing"),
    ("speculators", lambda c: c.pop(TOP_KEY), r" eagle_aux_hidden_state_layer_ids is missing"),
    ("speculators", lambda c: c.update({TOP_KEY: [1, 2]}), r"is \[1, 2\], but eyas.json says \[1, 2, 3\]"),
])
def test_eyas_export_needs_aux_ids_where_its_engine_reads_them(fmt, edit, message, make_run, tmp_path):
    run, _ = make_run()
    out = export(run, tmp_path / "out", [fmt])[fmt]
    edit_config(out, edit)
    with pytest.raises(EyasError, match=message) as err:
        load_draft(out)
    assert str(out / "config.json") in str(err.value)


def test_sglang_export_needs_midlayer_names(make_run, tmp_path):
    run, _ = make_run()
    out = export(run, tmp_path / "out", ["sglang"])["sglang"]
    state = load_file(out / "model.safetensors")
    state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(EyasError, match=r"names its decoder layer `midlayer.\*`, found \['layers.0."):
        load_draft(out)


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("flag", REFUSED_FLAGS)
def test_flat_configs_refuse_layout_flags(flag, fmt, make_run, tmp_path):
    """vLLM reads these flags on the flat path too (missing = false); eyas's draft has them off."""
    run, _ = make_run()
    out = export(run, tmp_path / "out", [fmt])[fmt]
    edit_config(out, lambda c: c.update({flag: False}))
    load_draft(out)
    edit_config(out, lambda c: c.update({flag: True}))
    with pytest.raises(EyasError, match=rf"\['{flag}'\] set to true"):
        load_draft(out)


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_flat_configs_refuse_no_aux_hidden_state(fmt, make_run, tmp_path):
    run, _ = make_run()
    out = export(run, tmp_path / "out", [fmt])[fmt]
    edit_config(out, lambda c: c["eagle_config"].update(use_aux_hidden_state=False))
    with pytest.raises(EyasError, match="use_aux_hidden_state is false"):
        load_draft(out)


def test_permuted_full_vocabulary_keeps_its_mapping(make_run, tiny_target, tmp_path):
    """Vd == V in another order: engines take a missing d2t for the identity, so the map must be written."""
    run, draft = make_run(draft_vocab=320)
    perm = torch.randperm(320, generator=torch.Generator().manual_seed(3))
    draft.set_vocab(perm - torch.arange(320), torch.ones(320, dtype=torch.bool))
    path = run / "latest" / "model.safetensors"
    state = load_file(path)
    state.update(d2t=draft.d2t.clone(), t2d=draft.t2d.clone())
    save_file(state, str(path))
    aux, ids, pos = sample_inputs(draft)
    for fmt, out in export(run, tmp_path / "out", "all", dtype="fp32").items():
        weights = load_file(out / "model.safetensors")
        assert torch.equal(weights["d2t"], perm - torch.arange(320)) and bool(weights["t2d"].all()), fmt
        back, _ = load_draft(out, embed_tokens=tiny_target.embed_tokens.weight)
        draft_ids = torch.arange(320)
        assert torch.equal(back.to_target_ids(draft_ids), perm), fmt
        with torch.no_grad():
            torch.testing.assert_close(ttt_logits(back, aux, ids, pos, 2), ttt_logits(draft, aux, ids, pos, 2),
                                       rtol=0, atol=0)


@pytest.mark.parametrize("rope_scaling, rope_type", [
    (None, "default"),
    ({"type": "linear", "factor": 2.0}, "linear"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, "llama3"),
])
def test_rope_parameters_keep_the_rope_type(rope_scaling, rope_type, tiny_target):
    dc = DraftConfig.from_target_config(tiny_target.config.to_dict(), draft_vocab_size=200).to_dict()
    dc["rope_scaling"] = rope_scaling
    layer = llama_layer_config(dc)
    assert layer["rope_parameters"]["rope_type"] == rope_type
    assert layer["rope_parameters"]["rope_theta"] == dc["rope_theta"] and layer["rope_scaling"] == rope_scaling
    if rope_scaling:
        assert layer["rope_parameters"]["factor"] == rope_scaling["factor"]
