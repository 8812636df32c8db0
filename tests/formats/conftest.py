"""Checkpoints in the layout of docs/INTERNALS.md "Checkpoints", made by hand from a random draft of the
tiny target, so that the export tests need no training run."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from eyas.draft import DraftConfig, Eagle3Draft

TINY_AUX = [1, 2, 3]  # HF ids on the 4-layer tiny target
DRAFT_VOCAB = 200  # of the tiny target's 320


def random_draft(target_config: dict, draft_vocab: int, num_aux: int = 3, seed: int = 0, **layout) -> Eagle3Draft:
    """Every weight random (norms too, so that a swapped norm changes the logits), a random vocab map.
    `layout`: the EAGLE 3.1 switches (fc_norm, norm_output)."""
    cfg = DraftConfig.from_target_config(target_config, draft_vocab_size=draft_vocab, num_aux_layers=num_aux,
                                         **layout)
    gen = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
        if draft_vocab < cfg.vocab_size:
            ids = torch.randperm(cfg.vocab_size, generator=gen)[:draft_vocab].sort().values
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            draft.set_vocab(ids - torch.arange(draft_vocab), t2d)
    return draft.eval()


def write_checkpoint(run_dir, draft: Eagle3Draft, aux_layers, target_identity, target_model, **extra):
    """RUN_DIR/step-0000010/{model.safetensors, draft.json} and RUN_DIR/latest -> it."""
    step = run_dir / "step-0000010"
    step.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    save_file(state, str(step / "model.safetensors"))
    doc = {"draft_config": draft.cfg.to_dict(), "aux_layers": aux_layers, "features": "fused",
           "target": target_identity, "target_model": target_model, "store": None, "ttt": 3, **extra}
    (step / "draft.json").write_text(json.dumps(doc, indent=2))
    os.symlink(step.name, run_dir / "latest")
    return run_dir


@pytest.fixture(scope="session")
def tiny_target_dir(tiny_target, tmp_path_factory):
    """The tiny target saved as a HF directory: a target spec that speculators can read as its verifier."""
    d = tmp_path_factory.mktemp("tiny-target")
    tiny_target.model.save_pretrained(d)
    return d


@pytest.fixture()
def make_run(tiny_target, tiny_target_dir, tmp_path):
    """A factory: make_run(draft_vocab=200, aux=TINY_AUX, identity=..., layout={}, **draft_json_extra)
    -> (run_dir, draft); `layout` holds the EAGLE 3.1 switches of the draft (fc_norm, norm_output)."""

    def make(draft_vocab=DRAFT_VOCAB, aux=TINY_AUX, identity="default", num_aux=3, name="run", layout=None, **extra):
        draft = random_draft(tiny_target.config.to_dict(), draft_vocab, num_aux, **(layout or {}))
        draft.embed_tokens.weight.data.copy_(tiny_target.embed_tokens.weight)
        ident = dict(tiny_target.identity) if identity == "default" else identity
        run = write_checkpoint(tmp_path / name, draft, aux, ident, str(tiny_target_dir), **extra)
        return run, draft

    return make
