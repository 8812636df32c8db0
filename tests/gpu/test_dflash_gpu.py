"""DFlash on CUDA with the tiny random target: decoding lossless in fp32, training steps in bf16 autocast."""

import sys
from pathlib import Path

import pytest
import torch

from eyas.draft.dflash import DFlashConfig, DFlashDraft
from eyas.speculative.engine import SpecEngine
from eyas.target import load_target

pytestmark = pytest.mark.gpu
PROMPT = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 2]


def tiny_and_draft():
    """The tiny target in fp32 on CUDA and a random 2-layer DFlash draft (block 16) with its embedding and head."""
    target = load_target("tiny", device="cuda", dtype="fp32")
    cfg = DFlashConfig.from_target_config(target.config.to_dict(), target_layers=[1, 2, 3],
                                          mask_token_id=target.vocab_size - 1, num_layers=2, block_size=16)
    torch.manual_seed(0)
    draft = DFlashDraft(cfg)
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.detach())
    draft.lm_head.weight.data.copy_(target.lm_head.weight.detach())
    return target, draft.to("cuda").eval()


@pytest.mark.parametrize("k", [3, 15])
def test_dflash_lossless_fp32_cuda(k):
    target, draft = tiny_and_draft()
    ref = SpecEngine(target.model).plain_generate(PROMPT, 64).tokens
    res = SpecEngine(target.model, draft).generate(PROMPT, 64, steps=k)
    assert res.tokens == ref and res.num_cycles > 0


@pytest.mark.parametrize("k", [3, 15])
def test_dflash_cuda_graphs_lossless_fp32(k):
    """The static path captured as CUDA graphs: plain greedy decoding's tokens and the eager path's cycles,
    for two prompts on one engine (graphs replayed at a second length)."""
    target, draft = tiny_and_draft()
    graphed = SpecEngine(target.model, draft, static=True)
    for prompt in (PROMPT, PROMPT * 5):
        ref = SpecEngine(target.model).plain_generate(prompt, 64).tokens
        res = graphed.generate(prompt, 64, steps=k)
        assert res.tokens == ref and res.num_cycles > 0
        assert res.accepted_per_cycle == SpecEngine(target.model, draft).generate(prompt, 64, steps=k).accepted_per_cycle
    assert graphed._decoder.graphs


def test_dflash_trains_on_cuda_bf16(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent.parent / "train"))
    from synthetic_train import small_config, synthetic_source

    from eyas.train import train

    cfg = small_config(["train.method=dflash", "dflash.block_size=8", "dflash.layers=2", "train.steps=20",
                        "train.log_every=5", "train.dtype=bf16", "dflash.lr=3e-3"])
    summary = train(cfg, tmp_path, synthetic_source(), device="cuda")
    assert summary["steps"] == 20 and summary["nonfinite_steps"] == 0
    assert (tmp_path / "latest" / "model.safetensors").is_file()
