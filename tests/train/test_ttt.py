"""Proof of exactness of the vectorised TTT forward, and the loss-mask alignment at the assistant boundary."""

import torch
from torch.testing import assert_close

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.train.ttt import shift_left, simulated_tau, ttt_forward

H, V, VD, A = 32, 64, 48, 3


def make_draft(seed=0, head_dim=8) -> Eagle3Draft:
    hf = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, intermediate_size=48,
              vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    draft = Eagle3Draft(DraftConfig.from_target_config(hf, draft_vocab_size=VD, num_aux_layers=A))
    for p in draft.parameters():  # larger than the default init so that errors cannot hide
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.normal_(p, 1.0, 0.2)
    d2t = torch.zeros(VD, dtype=torch.long)
    d2t[VD // 2:] = V - VD  # the upper half of the draft vocab maps to the top of the target vocab
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(VD) + d2t] = True
    draft.set_vocab(d2t, t2d)
    return draft


def make_batch(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    loss_mask = (torch.rand(b, t, generator=g) > 0.3).float() * mask
    return {
        "input_ids": torch.randint(0, V, (b, t), generator=g) * mask,
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "aux_hidden": torch.randn(b, t, A * H, generator=g),
        "final_hidden": torch.randn(b, t, H, generator=g),
    }


def naive_logits(draft, batch, ttt):
    """Chain drafting with the KV cache, one anchor at a time: what inference does."""
    ids = batch["input_ids"]
    b, t = ids.shape
    pos = torch.arange(t, device=ids.device).expand(b, t)
    step0 = draft(draft.fuse(batch["aux_hidden"]), shift_left(ids, 1), pos)
    out = [step0.logits] + [torch.full_like(step0.logits, float("nan")) for _ in range(1, ttt)]
    k_cache, v_cache = step0.past_key_values
    for anchor in range(t):
        past = (k_cache[:, :, :anchor + 1], v_cache[:, :, :anchor + 1])
        h = step0.hidden_out[:, anchor:anchor + 1]
        for k in range(1, ttt):
            if anchor + 1 + k >= t:
                break
            o = draft(h, ids[:, anchor + 1 + k:anchor + 2 + k], torch.full((b, 1), anchor + k, device=ids.device), past_key_values=past)
            out[k][:, anchor] = o.logits[:, 0]
            past, h = o.past_key_values, o.hidden_out
    return out


def test_vectorised_ttt_equals_step_by_step_kv_cache():
    draft = make_draft()
    batch = make_batch([13, 9])
    ttt = 4
    res = ttt_forward(draft, batch, torch.randn(V, H), ttt=ttt, return_logits=True)
    ref = naive_logits(draft, batch, ttt)
    t = batch["input_ids"].shape[1]
    for k in range(ttt):
        n = t - 1 - k  # anchors whose token input ids[t + 1 + k] exists
        # real positions of the shorter sample must match too: padding never leaks into them
        assert_close(res.logits_k[k][:, :n], ref[k][:, :n], rtol=1e-4, atol=1e-4, msg=f"step {k}")
    loss = res.loss
    loss.backward()
    assert torch.isfinite(loss) and draft.fc.weight.grad is not None and draft.embed_tokens.weight.grad is None


def test_padding_does_not_change_real_positions():
    draft = make_draft()
    batch = make_batch([10, 10])
    padded = {k: torch.cat([v, torch.zeros_like(v[:, :5])], 1) for k, v in batch.items()}
    padded["aux_hidden"][:, 10:] = 1e4  # garbage in the padding must not reach real positions
    padded["input_ids"][:, 10:] = V - 1
    padded["loss_mask"][:, 10:] = 1.0  # even a loss mask set on padding is ignored
    lm = torch.randn(V, H)
    a = ttt_forward(draft, batch, lm, ttt=3, return_logits=True)
    p = ttt_forward(draft, padded, lm, ttt=3, return_logits=True)
    for k in range(3):
        assert_close(p.logits_k[k][:, :10 - 1 - k], a.logits_k[k][:, :10 - 1 - k])
    assert a.count_k == p.count_k
    assert_close(a.loss, p.loss)


def test_loss_mask_alignment_at_assistant_boundary():
    """Prompt tokens 0..4, assistant tokens 5..9: step k at anchor t predicts token t + 2 + k, which must be
    an assistant token; its target is the distribution at t + 1 + k; the input token is t + 1 + k."""
    draft = make_draft()
    t = 10
    batch = make_batch([t])
    batch["loss_mask"] = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.float32)
    # the target puts all its mass on token (position + 1) % VD, so the right target position is visible
    lm_head = torch.eye(V, H) * 50  # logit of target id i is 50 * final[i]; ids 1..10 lie in the draft vocab
    batch["final_hidden"] = torch.zeros(1, t, H)
    for j in range(t):
        batch["final_hidden"][0, j, (j + 1) % H] = 1.0
    res = ttt_forward(draft, batch, lm_head, ttt=3, return_logits=True)
    # step 0 trains anchors 3..7 (predicting tokens 5..9), step 1 anchors 2..6, step 2 anchors 1..5
    assert res.count_k == [5, 5, 5]
    # recompute step k's loss by hand from the logits, the target at t + 1 + k and the mask of t + 2 + k
    for k in range(3):
        anchors = [a for a in range(t) if a + 2 + k < t and batch["loss_mask"][0, a + 2 + k] == 1]
        assert anchors == list(range(3 - k, 8 - k))
        logp = res.logits_k[k][0, anchors].detach().log_softmax(-1)
        target = torch.zeros(len(anchors), VD)
        for i, a in enumerate(anchors):
            target[i, (a + 1 + k + 1) % H] = 1.0  # the one-hot target distribution at position a + 1 + k
        assert_close(res.loss_k[k], float(-(target * logp).sum(-1).mean()), rtol=1e-4, atol=1e-4)


def test_accuracy_counts_tokens_outside_the_draft_vocab_as_misses():
    draft = make_draft()
    batch = make_batch([8])
    batch["loss_mask"][:] = 1.0
    batch["final_hidden"][..., 0] = 1.0
    inside, outside = VD // 2 - 1, VD // 2  # target id 23 is in the draft vocab, 24 is not
    assert bool(draft.t2d[inside]) and not bool(draft.t2d[outside])
    for target_id, hit_possible in ((inside, True), (outside, False)):
        lm_head = torch.zeros(V, H)
        lm_head[target_id, 0] = 100.0  # the target's argmax is target_id everywhere
        res = ttt_forward(draft, batch, lm_head, ttt=1, return_logits=True)
        predicted = draft.to_target_ids(res.logits_k[0][0, :6].argmax(-1))
        assert res.count_k == [6]
        assert res.correct_k == [int((predicted == target_id).sum())]
        if not hit_possible:
            assert res.correct_k == [0]


def test_simulated_tau():
    assert simulated_tau([0.0, 1.0]) == 1.0
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    assert abs(simulated_tau([0.5, 0.5]) - 1.75) < 1e-12
