"""train.rope: a target whose rope scaling the drafts do not implement (YaRN) is refused with the fix, and
train.rope=plain builds both families' drafts with plain RoPE at the target's theta."""

from types import SimpleNamespace

import pytest
import torch

from eyas.common import EyasError
from eyas.config import load_config
from eyas.train.dflash import build_dflash_draft
from eyas.train.loop import build_draft

YARN_TARGET = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 320, "num_hidden_layers": 4,
               "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "eos_token_id": 2,
               "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                   "original_max_position_embeddings": 4096}}


def source():
    return SimpleNamespace(target_config=YARN_TARGET, aux_layers=[1, 2, 3], d2t=None, t2d=None,
                           embed_weight=torch.randn(320, 64), lm_head_weight=torch.randn(320, 64))


def test_a_yarn_target_is_refused_with_the_fix_and_trains_with_plain_rope():
    tc = load_config("tiny").train
    with pytest.raises(EyasError, match=r"the draft for this store's target: .*'yarn'.*set train.rope=plain"):
        build_draft(source(), tc.features, rope=tc.rope)
    draft = build_draft(source(), tc.features, rope="plain")
    assert draft.cfg.rope_scaling is None and draft.cfg.rope_theta == 50000.0


def test_a_yarn_target_gets_a_dflash_draft_with_plain_rope():
    dcfg = load_config("tiny", ["dflash.block_size=4"]).dflash
    with pytest.raises(EyasError, match=r"the DFlash draft for this store's target: .*set train.rope=plain"):
        build_dflash_draft(source(), dcfg)
    draft = build_dflash_draft(source(), dcfg, rope="plain")
    assert draft.cfg.rope_scaling is None and draft.cfg.rope_theta == 50000.0
