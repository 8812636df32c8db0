"""Export round trips, layer-id conventions, on-disk layout, refusals and foreign checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.common import EyasError
from eyas.formats import export, load_draft
from eyas.formats.keys import to_midlayer
from eyas.ownership import MARKER

FORMATS = ("sglang", "vllm", "speculators")


def ttt_logits(draft, aux_hidden, input_ids, position_ids, steps):
    """Draft logits for `steps` TTT steps as training lays them out (docs/ALGORITHM.md section 3): step 0 is
    causal over real features; step k feeds back the previous hidden output with the tokens shifted by k
    and attends to step 0's keys causally plus its own position in each earlier draft step."""
    t = input_ids.shape[1]
    causal, diag = torch.ones(t, t, dtype=torch.bool).tril(), torch.eye(t, dtype=torch.bool)
    hidden, past, ids, out = draft.fuse(aux_hidden), None, input_ids, []
    for k in range(steps):
        mask = None if k == 0 else torch.cat([causal] + [diag] * k, dim=-1)[None, None]
        step = draft(hidden, ids, position_ids + k, past_key_values=past, attention_mask=mask)
        out.append(step.logits)
        hidden, past = step.hidden_out, step.past_key_values
        ids = torch.cat([input_ids[:, k + 1:], input_ids.new_zeros(1, k + 1)], dim=1)
    return torch.stack(out)  # [K, 1, T, Vd]


def sample_inputs(draft, t=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    h = draft.cfg.hidden_size
    aux = torch.randn(1, t, draft.cfg.num_aux_layers * h, generator=gen)  # [1, T, A*H]
    ids = torch.randint(0, draft.cfg.vocab_size, (1, t), generator=gen)
    return aux, ids, torch.arange(t)[None]


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_fp32_is_exact(fmt, make_run, tiny_target, tmp_path):
    run, draft = make_run()
    out = export(run, tmp_path / "out", [fmt], dtype="fp32")[fmt]
    assert out == (tmp_path / "out").resolve()  # one format: --out is the export itself
    back, meta = load_draft(out, embed_tokens=tiny_target.embed_tokens.weight)
    assert meta["aux_layers"] == [1, 2, 3] and meta["target"] == tiny_target.identity
    assert meta["features"] == "fused" and meta["num_layers"] == 4
    assert torch.equal(back.d2t, draft.d2t) and torch.equal(back.t2d, draft.t2d)
    aux, ids, pos = sample_inputs(draft)
    with torch.no_grad():
        torch.testing.assert_close(ttt_logits(back, aux, ids, pos, 3), ttt_logits(draft, aux, ids, pos, 3),
                                   rtol=0, atol=0)


def test_bf16_export_equals_bf16_rounded_weights(make_run, tiny_target, tmp_path):
    """The default export rounds float weights to bf16 and changes nothing else: reloaded (in fp32) it
    computes exactly what the original draft computes with its weights rounded to bf16."""
    run, draft = make_run()
    out = export(run, tmp_path / "out", ["vllm"])["vllm"]
    weights = load_file(out / "model.safetensors")
    assert {v.dtype for k, v in weights.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    back, _ = load_draft(out, embed_tokens=tiny_target.embed_tokens.weight)
    rounded, _ = load_draft(run, embed_tokens=tiny_target.embed_tokens.weight)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if name != "embed_tokens.weight":
                p.copy_(p.to(torch.bfloat16).float())
        aux, ids, pos = sample_inputs(draft)
        torch.testing.assert_close(ttt_logits(back, aux, ids, pos, 2), ttt_logits(rounded, aux, ids, pos, 2),
                                   rtol=0, atol=0)


def test_layer_id_conventions(make_run, tmp_path):
    """HF ids [3, 10, 20] on a 30-layer target: SGLang gets HF - 1 under eagle_config, vLLM and speculators
    the HF ids at the top level, all say num_aux_hidden_states 3."""
    run, _ = make_run(aux=[3, 10, 20], target_num_layers=30)
    paths = export(run, tmp_path / "out", "all")
    assert {f: p.name for f, p in paths.items()} == {f: f for f in FORMATS}
    cfg = {f: json.loads((paths[f] / "config.json").read_text()) for f in FORMATS}
    assert cfg["sglang"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 9, 19]
    assert "eagle_aux_hidden_state_layer_ids" not in cfg["sglang"]
    assert cfg["vllm"]["eagle_aux_hidden_state_layer_ids"] == [3, 10, 20]
    assert "eagle_aux_hidden_state_layer_ids" not in cfg["vllm"].get("eagle_config", {})
    assert cfg["speculators"]["eagle_aux_hidden_state_layer_ids"] == [3, 10, 20]
    assert all(c["num_aux_hidden_states"] == 3 for c in cfg.values())
    for f in FORMATS:  # read back, every format yields the same HF ids
        assert load_draft(paths[f])[1]["aux_layers"] == [3, 10, 20]
    sgl_readme = (paths["sglang"] / "README.md").read_text()
    assert "sglang.launch_server" in sgl_readme and str(paths["sglang"]) in sgl_readme
    assert "vllm serve" in (paths["vllm"] / "README.md").read_text()


def test_layout_and_vocab_buffers(make_run, tmp_path):
    run, _ = make_run()
    paths = export(run, tmp_path / "out", "all")
    sgl, vll = load_file(paths["sglang"] / "model.safetensors"), load_file(paths["vllm"] / "model.safetensors")
    assert "midlayer.self_attn.q_proj.weight" in sgl and not any(k.startswith("layers.") for k in sgl)
    assert "layers.0.self_attn.q_proj.weight" in vll and not any(k.startswith("midlayer.") for k in vll)
    assert vll["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 64  # q/k/v take [emb, hidden]
    assert vll["fc.weight"].shape == (64, 3 * 64) and vll["lm_head.weight"].shape == (200, 64)
    assert vll["d2t"].dtype == torch.int64 and vll["d2t"].shape == (200,)
    assert vll["t2d"].dtype == torch.bool and vll["t2d"].shape == (320,) and int(vll["t2d"].sum()) == 200
    assert "embed_tokens.weight" not in vll
    spec = json.loads((paths["speculators"] / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["transformer_layer_config"]["model_type"] == "llama"
    assert all(spec[k] is False for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))

    full_run, _ = make_run(draft_vocab=320, name="full")  # Vd == V: no mapping written
    full = load_file(export(full_run, tmp_path / "full-out", ["vllm"])["vllm"] / "model.safetensors")
    assert "d2t" not in full and "t2d" not in full


@pytest.mark.parametrize("case, kwargs, message", [
    ("no identity", dict(identity=None), "no target identity"),
    ("no aux ids", dict(aux=None), "no aux layer ids"),
    ("out of range", dict(aux=[1, 2, 4]), "out of range for the recorded 4-layer target"),
    ("count vs fc", dict(aux=[1, 3]), "fc takes 192"),
    ("not ascending", dict(aux=[3, 2, 1]), "distinct ascending"),
])
def test_refuses_inconsistent_drafts(case, kwargs, message, make_run, tmp_path):
    run, _ = make_run(**kwargs)
    with pytest.raises(EyasError, match=message):
        export(run, tmp_path / "out", "all")
    assert not (tmp_path / "out").exists()


def test_cli(make_run, tmp_path, capsys):
    from eyas.cli import main

    run, _ = make_run(aux=[3], num_aux=1)  # one aux layer ("last" features): only speculators can take it
    assert main(["export", str(run), "--to", "vllm", "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert "builds fc for exactly 3" in err and len(err.strip().splitlines()) == 1
    assert main(["export", str(run), "--to", "speculators", "--out", str(tmp_path / "s")]) == 0


def test_cli_all_formats(make_run, tmp_path):
    from eyas.cli import main

    run, _ = make_run()
    assert main(["export", str(run), "--to", "all", "--out", str(tmp_path / "e"), "--config", "tiny",
                 "--dtype", "fp32"]) == 0
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == sorted([MARKER, *FORMATS])
    assert json.loads((tmp_path / "e" / "vllm" / "eyas.json").read_text())["dtype"] == "fp32"
    # re-exporting over an export replaces it; over a foreign directory it refuses
    assert main(["export", str(run), "--to", "vllm", "--out", str(tmp_path / "e" / "vllm")]) == 0
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    assert main(["export", str(run), "--to", "vllm", "--out", str(tmp_path / "foreign")]) == 2
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("prefix", ["", "model."])
def test_research_checkpoint_with_midlayer_names(prefix, make_run, tiny_target, tmp_path):
    """EAGLE/SpecForge layout: flat Llama config with draft_vocab_size, `midlayer.*` weights, no aux ids."""
    _, draft = make_run()
    d = tmp_path / "research"
    d.mkdir()
    state = to_midlayer({k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"})
    state = {(k if k == "lm_head.weight" else prefix + k): v.contiguous() for k, v in state.items()}
    torch.save(state, d / "pytorch_model.bin")
    cfg = tiny_target.config.to_dict()
    cfg.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1, draft_vocab_size=200)
    (d / "config.json").write_text(json.dumps(cfg))
    back, meta = load_draft(d, embed_tokens=tiny_target.embed_tokens.weight)
    assert meta["target"] is None and meta["aux_layers"] is None and meta["kind"] == "flat"
    aux, ids, pos = sample_inputs(draft)
    with torch.no_grad():
        torch.testing.assert_close(ttt_logits(back, aux, ids, pos, 2), ttt_logits(draft, aux, ids, pos, 2),
                                   rtol=0, atol=0)
    with pytest.raises(EyasError, match="no target identity"):  # nothing says which target it serves
        export(d, tmp_path / "out", "all")


def test_unknown_weight_names_are_an_error(make_run, tmp_path):
    run, _ = make_run()
    path = run / "latest" / "model.safetensors"
    state = load_file(path)
    state["layers.0.self_attn.qkv_proj.weight"] = state.pop("layers.0.self_attn.q_proj.weight")
    save_file(state, str(path))
    with pytest.raises(EyasError, match="unexpected weight names"):
        load_draft(run)


def test_missing_embedding_is_nan(make_run):
    run, _ = make_run()
    draft, meta = load_draft(run)
    assert not meta["has_embed"] and torch.isnan(draft.embed_tokens.weight).all()


def _fake_store(path, tiny_target, aux):
    """Just the parts of a store (docs/INTERNALS.md "Store") that export reads."""
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"schema_version": 2, "target": tiny_target.identity,
                                                    "num_layers": 4, "aux_layers": aux}))
    save_file({"embed_tokens.weight": tiny_target.embed_tokens.weight.detach().clone(),
               "lm_head.weight": tiny_target.lm_head.weight.detach().clone()}, str(path / "target_head.safetensors"))
    return str(path)


def test_embed_from_store_and_store_consistency(make_run, tiny_target, tmp_path):
    run, draft = make_run(store=_fake_store(tmp_path / "store", tiny_target, [1, 2, 3]))
    out = export(run, tmp_path / "out", ["speculators"], dtype="fp32", embed_tokens=True)["speculators"]
    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["embed_tokens.weight"], tiny_target.embed_tokens.weight)
    back, meta = load_draft(out)  # self-contained: no embedding passed
    assert meta["has_embed"]
    aux, ids, pos = sample_inputs(draft)
    with torch.no_grad():
        torch.testing.assert_close(ttt_logits(back, aux, ids, pos, 2), ttt_logits(draft, aux, ids, pos, 2),
                                   rtol=0, atol=0)

    other, _ = make_run(name="other", store=_fake_store(tmp_path / "store2", tiny_target, [1, 2]))
    with pytest.raises(EyasError, match=r"its store .* captured \[1, 2\]"):
        export(other, tmp_path / "out2", "all")
    # a "last"-features draft records only the deepest captured layer: consistent with its store
    last, _ = make_run(name="last", aux=[3], num_aux=1, features="last",
                       store=_fake_store(tmp_path / "store3", tiny_target, [1, 2, 3]))
    assert export(last, tmp_path / "out3", ["speculators"])


def test_flat_configs_without_eyas_json(make_run, tiny_target, tmp_path):
    """An export whose eyas.json is gone reads like a foreign one: aux ids come from each engine's own
    key and convention, and a flat config whose two lists disagree is refused."""
    run, draft = make_run()
    paths = export(run, tmp_path / "out", ["sglang", "vllm"], dtype="fp32")
    aux, ids, pos = sample_inputs(draft)
    for fmt, path in paths.items():
        (path / "eyas.json").unlink()
        back, meta = load_draft(path, embed_tokens=tiny_target.embed_tokens.weight)
        assert meta["aux_layers"] == [1, 2, 3] and meta["target"] is None, fmt
        with torch.no_grad():
            torch.testing.assert_close(ttt_logits(back, aux, ids, pos, 2), ttt_logits(draft, aux, ids, pos, 2),
                                       rtol=0, atol=0)
    cfg_path = paths["sglang"] / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # HF ids beside SGLang's [0, 1, 2]: consistent
    cfg_path.write_text(json.dumps(cfg))
    assert load_draft(paths["sglang"])[1]["aux_layers"] == [1, 2, 3]
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]  # the same numbers in both lists: one is wrong
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(EyasError, match="name different layers"):
        load_draft(paths["sglang"])


def sglang_loads(names, layer: str, num_fc_norms: int = 0) -> tuple[set, set]:
    """Which file weights SGLang's LlamaForCausalLMEagle3.load_weights places, by its naming rules (read in
    sgl-project/sglang python/sglang/srt/models/llama_eagle3.py): the decoder layer is `model.<layer>`
    (`midlayer` up to PR #24663, `layers.0` after it, which also renames `midlayer` to `layers.0`),
    q/k/v and gate/up are fused, a name is tried as is and with `model.`, d2t/t2d are read apart, and
    anything else is skipped without a word. `num_fc_norms`: the newer loader's `model.fc_norm.{i}` norms of a
    config with `fc_norm: true` (the older loader has none). -> (placed parameters, skipped file names)."""
    params = {"lm_head.weight", "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight"} | {
        f"model.{layer}.{p}.weight" for p in ("hidden_norm", "input_layernorm", "self_attn.qkv_proj",
                                              "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_up_proj",
                                              "mlp.down_proj")} | {
        f"model.fc_norm.{i}.weight" for i in range(num_fc_norms)}
    fused = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
             ".up_proj": ".gate_up_proj"}
    placed, skipped = set(), set()
    for name in names:
        if name in ("d2t", "t2d"):
            continue
        new = name.replace("midlayer", "layers.0") if layer == "layers.0" else name
        for part, whole in fused.items():
            new = new.replace(part, whole)
        hit = next((c for c in (new, f"model.{new}") if c in params), None)
        (placed.add(hit) if hit else skipped.add(name))
    return placed, skipped


def test_sglang_export_loads_in_old_and_new_sglang(make_run, tmp_path):
    """Every weight of the SGLang export lands on a parameter, and every draft parameter is filled, for
    both generations of SGLang's loader; a `layers.0.*` file would serve with a random layer in the old one."""
    run, _ = make_run()
    paths = export(run, tmp_path / "out", ["sglang", "vllm"])
    sgl = load_file(paths["sglang"] / "model.safetensors")
    for layer in ("midlayer", "layers.0"):
        placed, skipped = sglang_loads(sgl, layer)
        assert not skipped, (layer, skipped)
        assert len(placed) == 10  # all but the embedding, which SGLang takes from the target
    placed, skipped = sglang_loads(load_file(paths["vllm"] / "model.safetensors"), "midlayer")
    assert len(skipped) == 10 and all(k.startswith("layers.0.") for k in skipped)
