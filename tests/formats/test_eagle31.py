"""EAGLE 3.1's `fc_norm` and `norm_output` on an export: the config field and weight names each engine reads,
an exact round trip back into eyas, and refusals where config.json and the draft would disagree.

What the engines do with them (read in vLLM 0.32's llama_eagle3.py, speculators 0.9's eagle3 model and
SGLang's newer llama_eagle3.py): `fc_norm: true` builds one RMSNorm per aux state, loaded from
`fc_norm.{i}.weight`, applied to each aux state's slice before `fc`; `norm_output: true` feeds the normed
output (the lm_head's input) back as the next step's hidden state instead of the pre-norm one.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from eyas.common import EyasError
from eyas.formats import export, load_draft
from test_engine_configs import edit_config
from test_export import FORMATS, sample_inputs, sglang_loads, ttt_logits

BOTH = {"fc_norm": True, "norm_output": True}
NORMS = {f"fc_norm.{i}.weight" for i in range(3)}


def _norm_logits(draft, aux, ids, pos, steps):
    """What the engines compute with both flags on, spelled out from the draft's weights: per-aux norms, then
    fc; after each step the normed output is both the lm_head's input and the next step's hidden state."""
    chunks = aux.chunk(3, dim=-1)
    fused = draft.fc(torch.cat([norm(x) for norm, x in zip(draft.fc_norm, chunks)], dim=-1))
    plain = type(draft)(type(draft.cfg)(**{**draft.cfg.to_dict(), "fc_norm": False, "norm_output": False}))
    plain.load_state_dict({k: v for k, v in draft.state_dict().items() if not k.startswith("fc_norm.")})
    t = ids.shape[1]
    causal, diag = torch.ones(t, t, dtype=torch.bool).tril(), torch.eye(t, dtype=torch.bool)
    hidden, past, step_ids, out = fused, None, ids, []
    for k in range(steps):
        mask = None if k == 0 else torch.cat([causal] + [diag] * k, dim=-1)[None, None]
        step = plain(hidden, step_ids, pos + k, past_key_values=past, attention_mask=mask)
        out.append(step.logits)
        hidden, past = draft.norm(step.hidden_out), step.past_key_values
        step_ids = torch.cat([ids[:, k + 1:], ids.new_zeros(1, k + 1)], dim=1)
    return torch.stack(out)


def test_draft_computes_what_the_engines_compute(make_run):
    _, draft = make_run(layout=BOTH)
    aux, ids, pos = sample_inputs(draft)
    with torch.no_grad():
        mine = ttt_logits(draft, aux, ids, pos, 3)
        torch.testing.assert_close(mine, _norm_logits(draft, aux, ids, pos, 3), rtol=1e-5, atol=1e-5)
        _, plain = make_run(name="plain")
        assert (mine - ttt_logits(plain, aux, ids, pos, 3)).abs().max() > 0.1  # the switches change the draft


@pytest.mark.parametrize("layout", [BOTH, {"fc_norm": True}, {"norm_output": True}], ids=["both", "fc", "out"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_with_eagle31_layout_is_exact(fmt, layout, make_run, tiny_target, tmp_path):
    run, draft = make_run(layout=layout)
    out = export(run, tmp_path / "out", [fmt], dtype="fp32")[fmt]
    cfg = json.loads((out / "config.json").read_text())
    for flag in ("fc_norm", "norm_output"):  # top-level in all three configs; flat ones omit a false flag
        assert cfg.get(flag, False) is bool(layout.get(flag)), (fmt, flag)
    names = set(load_file(out / "model.safetensors"))
    assert {n for n in names if "norm" in n and n.startswith("fc")} == (NORMS if layout.get("fc_norm") else set())
    back, _ = load_draft(out, embed_tokens=tiny_target.embed_tokens.weight)
    assert (back.cfg.fc_norm, back.cfg.norm_output) == (draft.cfg.fc_norm, draft.cfg.norm_output)
    aux, ids, pos = sample_inputs(draft)
    with torch.no_grad():
        torch.testing.assert_close(ttt_logits(back, aux, ids, pos, 3), ttt_logits(draft, aux, ids, pos, 3),
                                   rtol=0, atol=0)
    # without eyas.json (as a foreign checkpoint) the flags come from config.json alone
    (out / "eyas.json").unlink()
    foreign, _ = load_draft(out, embed_tokens=tiny_target.embed_tokens.weight)
    with torch.no_grad():
        torch.testing.assert_close(ttt_logits(foreign, aux, ids, pos, 3), ttt_logits(draft, aux, ids, pos, 3),
                                   rtol=0, atol=0)


def test_plain_export_is_unchanged(make_run, tmp_path):
    """A draft without the switches exports as before: no flag in the flat configs, false in speculators'."""
    run, _ = make_run()
    paths = export(run, tmp_path / "out", "all")
    for fmt, path in paths.items():
        cfg = json.loads((path / "config.json").read_text())
        if fmt == "speculators":
            assert cfg["fc_norm"] is False and cfg["norm_output"] is False
        else:
            assert "fc_norm" not in cfg and "norm_output" not in cfg
        assert not any(k.startswith("fc_norm") for k in load_file(path / "model.safetensors"))
        assert "EAGLE 3.1" not in (path / "README.md").read_text()


def test_sglang_places_fc_norm_only_in_its_newer_loader(make_run, tmp_path):
    """SGLang's newer loader has `model.fc_norm.{i}` parameters and places the export's norms by its
    `model.` fallback; the older one has none and skips them without a word, hence the README's warning."""
    run, _ = make_run(layout=BOTH)
    out = export(run, tmp_path / "out", ["sglang"])["sglang"]
    names = load_file(out / "model.safetensors")
    placed, skipped = sglang_loads(names, "layers.0", num_fc_norms=3)
    assert not skipped and {f"model.{n}" for n in NORMS} <= placed and len(placed) == 13
    _, skipped_old = sglang_loads(names, "midlayer")
    assert skipped_old == NORMS
    assert "EAGLE 3.1 layout: `fc_norm` and `norm_output` on" in (out / "README.md").read_text()


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
@pytest.mark.parametrize("flag", ["fc_norm", "norm_output"])
def test_config_flag_that_the_draft_lacks_is_refused(flag, fmt, make_run, tmp_path):
    """An engine reads the flag from config.json: set there but not in the draft eyas exported (or the other
    way round), the export would serve another draft, so loading it is refused."""
    run, _ = make_run()
    out = export(run, tmp_path / "out", [fmt])[fmt]
    edit_config(out, lambda c: c.update({flag: True}))
    with pytest.raises(EyasError, match=rf"{flag} is true there, but eyas.json's draft has {flag}=false"):
        load_draft(out)
    run2, _ = make_run(layout={flag: True}, name="on")
    out2 = export(run2, tmp_path / "out2", [fmt])[fmt]
    edit_config(out2, lambda c: c.update({flag: False}))
    with pytest.raises(EyasError, match=rf"{flag} is false there"):
        load_draft(out2)


def test_fc_norm_weights_must_match_the_config(make_run, tmp_path):
    run, _ = make_run(layout={"fc_norm": True})
    out = export(run, tmp_path / "out", ["vllm"])["vllm"]
    (out / "eyas.json").unlink()
    edit_config(out, lambda c: c.update({"fc_norm": False}))
    with pytest.raises(EyasError, match="fc_norm=false for 3 aux states but the weights hold"):
        load_draft(out)
