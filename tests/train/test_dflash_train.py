"""DFlash training: anchors, the training mask against decoding, the acceptance statistics, a run and its resume."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from eyas.config import ConfigError, load_config
from eyas.draft.dflash import DFlashConfig, DFlashContext, DFlashDraft, auto_target_layers
from eyas.train import train
from eyas.train.dflash import dflash_forward, sample_anchors, select_layers, training_mask
from synthetic_train import TARGET_CONFIG, small_config, synthetic_source


def tiny_draft(block=4, layers=2, target_layers=(1, 2, 3), seed=0) -> DFlashDraft:
    torch.manual_seed(seed)
    cfg = DFlashConfig.from_target_config(TARGET_CONFIG, list(target_layers), mask_token_id=5, num_layers=layers,
                                          block_size=block)
    draft = DFlashDraft(cfg)
    for p in draft.parameters():  # norms away from 1 so that a misplaced one shows
        p.data.normal_(0, 0.3) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    return draft.eval()


def test_anchors_lie_where_the_next_token_is_a_real_assistant_token_and_respect_both_caps():
    torch.manual_seed(0)
    lm = torch.zeros(3, 10)
    lm[0, 4:9] = 1  # row 0: assistant tokens 4..8 -> anchors 3..7
    lm[1, 2:10] = 1  # row 1: 2..9, but only 6 real tokens -> anchors 1..4
    attn = torch.ones(3, 10, dtype=torch.bool)
    attn[1, 6:] = False
    lm[1, 6:] = 0
    anchors, keep = sample_anchors(lm, attn, per_sample=100, total=100)  # row 2 has none
    got = [sorted(anchors[r][keep[r]].tolist()) for r in range(3)]
    assert got == [[3, 4, 5, 6, 7], [1, 2, 3, 4], []]
    anchors, keep = sample_anchors(lm, attn, per_sample=2, total=100)
    assert keep.sum(1).tolist() == [2, 2, 0]
    anchors, keep = sample_anchors(lm, attn, per_sample=100, total=3)
    assert int(keep.sum()) == 3


def test_a_training_block_sees_what_decoding_sees():
    """The training mask (context < anchor, the own block both ways, no other block) gives each block the hidden
    states that a decoding-time forward over the committed context gives."""
    draft = tiny_draft()
    t, h = 14, draft.cfg.hidden_size
    aux = torch.randn(1, t, 3 * h)
    ids = torch.randint(0, 96, (1, t))
    anchors = torch.tensor([[2, 5, 9, 12]])
    keep = torch.tensor([[True, True, True, False]])
    bk = draft.cfg.block_size
    pos = anchors[:, :, None] + torch.arange(bk)
    block_ids = torch.full((1, 4, bk), draft.cfg.mask_token_id)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    with torch.no_grad():
        ctx = draft.fuse(aux)
        kv = draft.context_kv(ctx, torch.arange(t)[None])
        hidden = draft(block_ids.view(1, -1), pos.view(1, -1), kv, training_mask(anchors, keep, t, bk)).view(1, 4, bk, h)
        for j in range(3):
            a = int(anchors[0, j])
            context = DFlashContext(draft)
            context.append(aux[0, :a], torch.arange(a)[None])
            alone = draft(block_ids[:, j], pos[:, j], context.views())
            torch.testing.assert_close(hidden[:, j], alone, rtol=1e-5, atol=1e-5)


def test_context_grows_in_place_and_matches_one_pass():
    draft = tiny_draft()
    aux = torch.randn(40, 3 * draft.cfg.hidden_size)
    grown = DFlashContext(draft)
    for lo, hi in ((0, 7), (7, 8), (8, 30), (30, 40)):
        grown.append(aux[lo:hi], torch.arange(lo, hi)[None])
    whole = draft.context_kv(draft.fuse(aux)[None], torch.arange(40)[None])
    for (k, v), (k2, v2) in zip(grown.views(), whole):
        torch.testing.assert_close(k, k2)
        torch.testing.assert_close(v, v2)


def test_statistics_are_acceptance_rates_conditional_on_the_earlier_slots():
    """A draft whose lm_head always says token 7: slot k is right iff the label is 7; acc_k counts only blocks
    whose earlier slots were all right."""
    draft = tiny_draft(block=4, layers=1)
    draft.lm_head = torch.nn.Linear(draft.cfg.hidden_size, 96)
    draft.lm_head.weight.data.zero_()
    draft.lm_head.bias.data.zero_()
    draft.lm_head.bias.data[7] = 1.0
    ids = torch.tensor([[1, 2, 7, 7, 3, 7, 7, 7, 9, 9]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
             "loss_mask": torch.ones(1, 10), "aux_hidden": torch.randn(1, 10, 3 * draft.cfg.hidden_size)}
    with torch.no_grad():
        logits = draft.lm_head(draft(ids, torch.arange(10)[None], draft.context_kv(
            draft.fuse(batch["aux_hidden"]), torch.arange(10)[None])))
    assert bool((logits.argmax(-1) == 7).all())
    torch.manual_seed(0)
    res = dflash_forward(draft, batch, [1, 2, 3], gamma=7.0, anchors=100, block_tokens=4096)
    # anchors 0..8 (the token after each is an assistant token); slots 1..3 predict ids[a+1..a+3]
    labels = [[int(ids[0, a + k]) if a + k < 10 else None for k in (1, 2, 3)] for a in range(9)]
    want_count, want_right = [0, 0, 0], [0, 0, 0]
    for row in labels:
        for k, lab in enumerate(row):
            if lab is None:
                break
            want_count[k] += 1
            if lab != 7:
                break
            want_right[k] += 1
    assert res.count_k == want_count and res.correct_k == want_right


def test_block_tokens_caps_the_blocks_of_a_micro_batch():
    """dflash.block_tokens // block_size blocks a micro-batch at most: with 2 rows of 40 answer tokens, a budget of
    32 query tokens (8 blocks of 4) draws 8 blocks, one of 400 draws every anchor (39 a row); the config refuses a
    negative budget and the loop reads 0 as train.batch_tokens."""
    draft = tiny_draft(block=4, layers=1)
    ids = torch.randint(0, 96, (2, 40))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
             "loss_mask": torch.ones(2, 40), "aux_hidden": torch.randn(2, 40, 3 * draft.cfg.hidden_size)}
    with torch.no_grad():
        few = dflash_forward(draft, batch, [1, 2, 3], gamma=7.0, anchors=512, block_tokens=32)
        every = dflash_forward(draft, batch, [1, 2, 3], gamma=7.0, anchors=512, block_tokens=400)
    assert few.count_k[0] == 8 and every.count_k[0] == 2 * 39  # slot 1 of every drawn block is counted
    with pytest.raises(ConfigError, match="dflash.block_tokens"):
        load_config("tiny", ["dflash.block_tokens=-1"])


def test_dflash_trains_checkpoints_and_resumes_bit_exact(tmp_path):
    sets = ["train.method=dflash", "dflash.block_size=4", "dflash.layers=2", "train.steps=8", "train.save_every=4",
            "train.log_every=4"]
    full = train(small_config(sets), tmp_path / "full", synthetic_source(), device="cpu")
    records = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8] and {"acc_0", "acc_2", "tau_sim"} <= set(records[-1])
    assert full["steps"] == 8 and 1.0 <= full["tau_sim"] <= 4.0
    step = tmp_path / "full" / "latest"
    meta = json.loads((step / "draft.json").read_text())
    assert meta["method"] == "dflash" and meta["aux_layers"] == [1, 2, 3]
    assert meta["draft_config"]["block_size"] == 4 and meta["draft_config"]["num_layers"] == 2
    weights = load_file(str(step / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and "lm_head.weight" not in weights
    assert weights["fc.weight"].shape == (32, 96) and "layers.1.self_attn.k_norm.weight" in weights

    # a run stopped after step 4 (its step-8 checkpoint never written), then resumed
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut, symlinks=True)
    shutil.rmtree(cut / "step-0000008")
    os.remove(cut / "latest")
    os.symlink("step-0000004", cut / "latest")
    train(small_config(sets), cut, synthetic_source(), device="cpu", resume=True)
    a, b = load_file(str(tmp_path / "full" / "latest" / "model.safetensors")), load_file(str(cut / "latest" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dflash_learns_on_the_synthetic_store(tmp_path):
    sets = ["train.method=dflash", "dflash.block_size=4", "train.steps=40", "train.log_every=10", "dflash.lr=3e-3"]
    train(small_config(sets), tmp_path, synthetic_source(), device="cpu")
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]


def test_target_layers_must_be_in_the_store_and_config_is_checked(tmp_path):
    with pytest.raises(Exception, match=r"capture them \(`eyas capture --layers 1,2,3,4`\)"):
        train(small_config(["train.method=dflash", "dflash.target_layers=[2, 4]"]), tmp_path, synthetic_source(),
              device="cpu")
    draft_layers = select_layers(torch.arange(12.0).view(1, 1, 12), [1, 2, 3], [3, 1])
    assert draft_layers.view(-1).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    with pytest.raises(ConfigError, match="train.method"):
        load_config("tiny", ["train.method=medusa"])
    with pytest.raises(ConfigError, match="dflash.block_size"):
        load_config("tiny", ["dflash.block_size=1"])
    with pytest.raises(Exception, match="trains one"):
        train(small_config(["train.method=[eagle3, dflash]"]), tmp_path / "two", synthetic_source(), device="cpu")


def test_auto_target_layers_follow_the_reference_spacing():
    # Qwen3-8B (36 layers, 5 fused): decoder layers 1, 9, 17, 25, 33 -> hidden_states indices 2, 10, 18, 26, 34
    assert auto_target_layers(36, 5) == [2, 10, 18, 26, 34]
    assert auto_target_layers(30, 1) == [16]


def test_chunked_lm_head_loss_equals_the_full_logits_one():
    """linear_weighted_ce (chunks of rows; no [N, V] logits) against F.cross_entropy on the full logits: the
    weighted loss, its gradients for x and the head, each row's cross-entropy and the argmax (fp32)."""
    from eyas.train.kernels import linear_weighted_ce

    torch.manual_seed(0)
    x = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    labels, weights = torch.randint(0, 50, (37,)), torch.rand(37)
    loss, ce, argmax = linear_weighted_ce(x, w, labels, weights, chunk=8)
    loss.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    logits = x @ w.T
    want_ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    (want_ce * weights).sum().backward()
    torch.testing.assert_close(loss, (want_ce * weights).sum().detach())
    torch.testing.assert_close(ce, want_ce.detach())
    assert torch.equal(argmax, logits.argmax(-1))
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_dflash_loss_with_the_chunked_head_equals_the_plain_one():
    """The training forward with the target's bias-free lm_head (chunked) and with the same head as a module the
    forward does not recognise (full logits): the same loss, statistics and gradients of every draft weight."""
    draft = tiny_draft(block=4, layers=1)
    draft.lm_head = torch.nn.Linear(draft.cfg.hidden_size, 96, bias=False)
    torch.nn.init.normal_(draft.lm_head.weight, std=0.3)
    ids = torch.randint(0, 96, (2, 30))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
             "loss_mask": torch.ones(2, 30), "aux_hidden": torch.randn(2, 30, 3 * draft.cfg.hidden_size)}

    class Head(torch.nn.Module):  # the same weights, through F.linear
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

        def forward(self, h):
            return torch.nn.functional.linear(h, self.weight)

    runs = []
    for head in (draft.lm_head, Head(draft.lm_head.weight)):
        draft.lm_head = head
        draft.zero_grad()
        torch.manual_seed(1)  # the same anchors
        res = dflash_forward(draft, batch, [1, 2, 3], gamma=7.0, anchors=512, block_tokens=4096)
        res.loss.backward()
        runs.append((res, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = runs
    torch.testing.assert_close(a.loss, b.loss)
    assert a.count_k == b.count_k and a.correct_k == b.correct_k
    assert ga.keys() == gb.keys() and "fc.weight" in ga
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], msg=name)
