"""The training loop with the draft-quality switches: train.fc_norm / train.norm_output make a draft with that
layout, saved and read back (and resumed) as such; train.loss and the reference-loss switches reach the
TTT loss; the config refuses values it does not know."""

import json

import pytest
import torch

from eyas.config import ConfigError, TrainConfig
from eyas.formats import load_draft
from eyas.train import train
from synthetic_train import small_config, synthetic_source


def test_eagle31_draft_trains_saves_and_loads_back(tmp_path):
    cfg = small_config(["train.steps=8", "train.fc_norm=true", "train.norm_output=true"])
    summary = train(cfg, tmp_path / "run", synthetic_source(), device="cpu")
    meta = json.loads((tmp_path / "run" / "latest" / "draft.json").read_text())
    assert meta["draft_config"]["fc_norm"] is True and meta["draft_config"]["norm_output"] is True
    draft, loaded = load_draft(tmp_path / "run", embed_tokens=synthetic_source().embed_weight)
    assert draft.cfg.fc_norm and draft.cfg.norm_output and len(draft.fc_norm) == 3
    assert any((n.weight - 1).abs().max() > 1e-4 for n in draft.fc_norm)  # the norms were trained
    assert summary["steps"] == 8
    # resuming with the same switches goes on; with them off it is refused (another draft)
    train(small_config(["train.steps=10", "train.fc_norm=true", "train.norm_output=true"]), tmp_path / "run",
          synthetic_source(), resume=True, device="cpu")
    with pytest.raises(Exception, match="draft_config"):
        train(small_config(["train.steps=12"]), tmp_path / "run", synthetic_source(), resume=True, device="cpu")


def test_plain_checkpoint_without_the_new_fields_resumes(tmp_path):
    """A checkpoint written before fc_norm/norm_output existed (no such keys in draft.json) resumes."""
    train(small_config(["train.steps=4", "train.save_every=4"]), tmp_path, synthetic_source(), device="cpu")
    path = tmp_path / "latest" / "draft.json"
    doc = json.loads(path.read_text())
    for key in ("fc_norm", "norm_output"):
        del doc["draft_config"][key]
    path.write_text(json.dumps(doc))
    summary = train(small_config(["train.steps=6"]), tmp_path, synthetic_source(), resume=True, device="cpu")
    assert summary["steps"] == 6


@pytest.mark.parametrize("overrides", [["train.loss=lk_alpha"], ["train.loss=lk_hybrid", "train.lk_eta=1.5"],
                                       ["train.mask_oov_target=true", "train.loss_mask_token=position",
                                        "train.loss_norm=all"], ["train.batching=sorted"]],
                         ids=["lk_alpha", "lk_hybrid", "reference", "sorted"])
def test_loss_switches_reach_the_loss(overrides, tmp_path):
    """(train.batching changes which samples the first batches hold, so their loss)"""
    base = train(small_config(["train.steps=2", "train.log_every=1"]), tmp_path / "base", synthetic_source(),
                 device="cpu")
    other = train(small_config(["train.steps=2", "train.log_every=1"] + overrides), tmp_path / "other",
                  synthetic_source(), device="cpu")
    assert torch.isfinite(torch.tensor(other["loss"])) and other["loss"] != base["loss"]


def test_adam_beta2_reaches_the_optimizer(tmp_path):
    from eyas.train import checkpoint as ckpt

    train(small_config(["train.steps=2", "train.adam_beta2=0.999"]), tmp_path, synthetic_source(), device="cpu")
    optim = ckpt.load_checkpoint(tmp_path / "latest")["optim"]["optimizer"]
    assert optim["param_groups"][0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("field, value, message", [
    ("loss", "tv", "train.loss='tv' is not valid"),
    ("loss_mask_token", "anchor", "train.loss_mask_token='anchor' is not valid"),
    ("loss_norm", "mean", "train.loss_norm='mean' is not valid"),
    ("batching", "random", "train.batching='random' is not valid"),
    ("lk_eta", -1.0, r"train.lk_eta=-1.0 must lie in \[0, 100\]"),
])
def test_config_refuses_unknown_switch_values(field, value, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{field: value})
    assert TrainConfig().loss == "kl" and not TrainConfig().fc_norm and TrainConfig().loss_norm == "counted"
