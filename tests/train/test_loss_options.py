"""The training-time test's switches: EAGLE 3.1's draft layout (fc_norm, norm_output) against chain drafting,
the LK losses against a direct computation and under training, and the three switches that give EAGLE's
and SpecForge's reference loss (docs/ALGORITHM.md section 3), each on a batch crafted to show it."""

import pytest
import torch
from torch.testing import assert_close

from eyas.draft import DraftConfig, Eagle3Draft
from eyas.train.kernels import linear_lk
from eyas.train.ttt import LossSpec, lk_loss_sum, ttt_forward
from test_ttt import A, H, V, VD, make_batch, make_draft, naive_logits


def layout_draft(seed=0, **layout) -> Eagle3Draft:
    """make_draft's draft (same weights and vocabulary) with the EAGLE 3.1 switches, its norms random too."""
    base = make_draft(seed)
    draft = Eagle3Draft(DraftConfig(**{**base.cfg.to_dict(), **layout}))
    missing, _ = draft.load_state_dict(base.state_dict(), strict=False)
    assert all(k.startswith("fc_norm.") for k in missing)
    torch.manual_seed(seed + 1)
    for name, p in draft.named_parameters():
        if name.startswith("fc_norm."):
            torch.nn.init.normal_(p, 1.0, 0.2)
    return draft


@pytest.mark.parametrize("layout", [{"fc_norm": True}, {"norm_output": True}, {"fc_norm": True, "norm_output": True}],
                         ids=["fc_norm", "norm_output", "both"])
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_ttt_with_eagle31_layout_equals_chain_drafting(layout, impl):
    """Training sees exactly what inference computes with the switches on: the vectorised TTT's logits
    equal chain drafting with the KV cache (Eagle3Draft.forward), and the switches do change them."""
    draft = layout_draft(**layout)
    batch = make_batch([13, 9])
    res = ttt_forward(draft, batch, torch.randn(V, H), ttt=4, return_logits=True, impl=impl)
    ref = naive_logits(draft, batch, 4)
    plain = ttt_forward(make_draft(), batch, torch.randn(V, H), ttt=4, return_logits=True)
    t = batch["input_ids"].shape[1]
    for k in range(4):
        assert_close(res.logits_k[k][:, :t - 1 - k], ref[k][:, :t - 1 - k], rtol=1e-4, atol=1e-4, msg=f"step {k}")
    assert (res.logits_k[1] - plain.logits_k[1]).abs().max() > 0.1
    res.loss.backward()
    if layout.get("fc_norm"):
        assert all(n.weight.grad is not None and n.weight.grad.abs().sum() > 0 for n in draft.fc_norm)


# ---------------------------------------------------------------- LK losses

def _direct_lk(logits, p, kind, eta):
    """Per row, spelled out: alpha = sum_v min(p_v, q_v); lk_alpha = -log alpha; lk_hybrid = lam KL(p||q) +
    (1 - lam)(1 - alpha), lam = exp(-eta alpha)."""
    out = []
    for z, pr in zip(logits.double(), p.double()):
        q = torch.exp(z) / torch.exp(z).sum()
        alpha = sum(min(a, b) for a, b in zip(pr.tolist(), q.tolist()))
        if kind == "lk_alpha":
            out.append(-torch.log(torch.tensor(alpha, dtype=torch.float64)))
            continue
        kl = sum(a * (torch.log(torch.tensor(a)) - torch.log(b)) for a, b in zip(pr.tolist(), q) if a > 0)
        lam = torch.exp(torch.tensor(-eta * alpha))
        out.append(lam * kl + (1 - lam) * (1 - alpha))
    return torch.stack(out).sum()


@pytest.mark.parametrize("kind", ["lk_alpha", "lk_hybrid"])
def test_lk_loss_value_against_a_direct_computation(kind):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=g) * 2
    p = torch.softmax(torch.randn(5, 7, generator=g) * 3, -1)
    p[0] = 0.0
    p[0, 2] = 1.0  # a one-hot target: lk_alpha is then the cross-entropy of that token
    got = lk_loss_sum(logits, p, kind, eta=3.0)
    assert_close(got.double(), _direct_lk(logits, p, kind, 3.0), rtol=1e-5, atol=1e-6)
    if kind == "lk_alpha":
        assert_close(lk_loss_sum(logits[:1], p[:1], kind), -logits[0].log_softmax(-1)[2])


def test_lk_hybrid_weight_is_not_differentiated():
    """lam = exp(-eta alpha) is a constant to the gradient: d/dz of the hybrid is lam dKL + (1 - lam) dTV."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(1, 6, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(1, 6, generator=g), -1)
    lk_loss_sum(z, p, "lk_hybrid", eta=2.0).backward()
    q = z.detach().softmax(-1)
    alpha = torch.minimum(p, q).sum()
    lam = torch.exp(-2.0 * alpha)
    zz = z.detach().clone().requires_grad_(True)
    kl = (p * (p.log() - zz.log_softmax(-1))).sum()
    tv = 1 - torch.minimum(p, zz.softmax(-1)).sum()
    (lam * kl + (1 - lam) * tv).backward()
    assert_close(z.grad, zz.grad)


@pytest.mark.parametrize("kind", ["lk_alpha", "lk_hybrid"])
def test_ttt_lk_loss_equals_direct_and_training_reduces_it(kind):
    """ttt_forward's per-step LK loss is the mean over counted positions of the direct computation on the
    draft's logits against the target's renormalised distribution; a few AdamW steps lower it."""
    draft = make_draft()
    batch = make_batch([12, 10])
    lm = torch.randn(V, H, generator=torch.Generator().manual_seed(5)) * 0.5
    spec = LossSpec(kind=kind)
    res = ttt_forward(draft, batch, lm, ttt=2, return_logits=True, loss=spec)
    ids_ok = batch["loss_mask"].bool() & batch["attention_mask"]
    target_ids = torch.arange(VD) + draft.d2t
    for k in range(2):
        rows = [(b, t) for b in range(2) for t in range(12) if t + 2 + k < 12 and ids_ok[b, t + 2 + k]]
        logits = torch.stack([res.logits_k[k][b, t] for b, t in rows]).detach()
        p = torch.stack([(batch["final_hidden"][b, t + 1 + k] @ lm[target_ids].T).softmax(-1) for b, t in rows])
        assert res.count_k[k] == len(rows)
        assert_close(res.loss_k[k], float(_direct_lk(logits, p, kind, 3.0)) / len(rows), rtol=1e-5, atol=1e-6)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(15):
        out = ttt_forward(draft, batch, lm, ttt=2, loss=spec)
        first = float(out.loss.detach()) if first is None else first
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    last = float(ttt_forward(draft, batch, lm, ttt=2, loss=spec).loss.detach())
    assert last < 0.8 * first, (first, last)


@pytest.mark.parametrize("kind", ["lk_alpha", "lk_hybrid"])
def test_chunked_lk_equals_the_plain_loss_and_its_gradients(kind):
    """linear_lk (chunks of 3 rows, the gradient written out) against lk_loss_sum on the full logits with
    autograd: the same loss, argmax and gradients of x and the head. Among the rows: a one-hot target, a target
    equal to the draft's own distribution (alpha = 1) and one where the draft puts almost no mass on the target
    (lk_alpha's floor: no gradient there). Under bf16 autocast the product runs in bf16 as a Linear's would."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    w = torch.randn(11, 6, generator=g, dtype=torch.float64)
    x[2] *= 40  # row 2's logits spread far apart: almost no mass on its smallest logit's token
    z = x @ w.T
    p = torch.softmax(torch.randn(8, 11, generator=g, dtype=torch.float64) * 2, -1)  # row i's target
    p[0] = 0.0
    p[0, 4] = 1.0  # one-hot
    p[1] = z[1].softmax(-1)  # the draft's own distribution
    p[2] = 0.0
    p[2, int(z[2].argmin())] = 1.0
    alpha = torch.minimum(p, z.softmax(-1)).sum(-1)
    assert alpha[2] < 1e-5 and abs(float(alpha[1]) - 1) < 1e-12
    probs, rows = p.flip(0), torch.arange(7, -1, -1)  # probs[rows[i]] is row i's target, as in training
    xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = lk_loss_sum(xa @ wa.T, p, kind, eta=2.5)
    want.backward()
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    got, argmax = linear_lk(xb, wb, probs, rows, kind, eta=2.5, chunk=3)
    (2 * got).backward()  # the incoming gradient scales both
    assert_close(got.double(), want.detach().double(), rtol=1e-6, atol=1e-6)  # log-softmax in fp32 in both
    assert torch.equal(argmax, z.argmax(-1))
    assert_close(xb.grad, 2 * xa.grad, rtol=1e-5, atol=1e-6)
    assert_close(wb.grad, 2 * wa.grad, rtol=1e-5, atol=1e-6)
    if kind == "lk_alpha":
        assert xb.grad[2].abs().max() == 0  # under the floor: no gradient
    else:
        assert xb.grad[2].abs().max() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = linear_lk(x.float(), w.float(), probs.float(), rows, kind, chunk=3)
    plain = lk_loss_sum(x.float().bfloat16() @ w.float().bfloat16().T, p.float(), kind)
    assert low.dtype == torch.float32
    assert_close(low, plain.float(), rtol=1e-5, atol=1e-5)


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="kind='tv'"):
        LossSpec(kind="tv")


# ---------------------------------------------------------------- the reference's three choices

def crafted_batch():
    """One sample of 10 tokens: prompt 0..4, assistant 5..9; the target puts all its mass on one token per
    position, chosen below, so that which positions count and with which target is visible."""
    batch = make_batch([10])
    batch["loss_mask"] = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.float32)
    batch["final_hidden"] = torch.zeros(1, 10, H)
    return batch


def target_head(top_ids):
    """lm_head and final states such that position j's target argmax is target id top_ids[j]."""
    lm = torch.zeros(V, H)
    final = torch.zeros(1, len(top_ids), H)
    for j, tid in enumerate(top_ids):
        lm[tid, j % H] = 30.0 + j  # distinct rows; position j lights row j's unit
        final[0, j, j % H] = 1.0
    return lm, final


def per_anchor_ce(res, k, anchors, batch, lm, draft):
    """Soft cross-entropy of step k at each anchor against the target at anchor + 1 + k, from the logits."""
    target_ids = torch.arange(VD) + draft.d2t
    out = []
    for a in anchors:
        p = (batch["final_hidden"][0, a + 1 + k] @ lm[target_ids].T).softmax(-1)
        out.append(-(p * res.logits_k[k][0, a].detach().log_softmax(-1)).sum())
    return torch.stack(out)


def test_mask_oov_target_drops_positions_whose_target_top1_the_draft_cannot_propose():
    draft = make_draft()
    inside, outside = 3, VD // 2  # target id 3 is in the draft vocabulary, VD // 2 is not
    assert bool(draft.t2d[inside]) and not bool(draft.t2d[outside])
    tops = [inside] * 10
    tops[6] = tops[8] = outside  # predictions of tokens 7 and 9 (targets at positions 6 and 8) are out of vocab
    batch = crafted_batch()
    lm, batch["final_hidden"] = target_head(tops)
    base = ttt_forward(draft, batch, lm, ttt=1, return_logits=True)
    masked = ttt_forward(draft, batch, lm, ttt=1, return_logits=True, loss=LossSpec(mask_oov_target=True))
    # step 0 at anchor t: target at t + 1, predicted token t + 2 in 5..9 -> anchors 3..7
    assert base.count_k == [5] and masked.count_k == [3]
    ce = per_anchor_ce(base, 0, [3, 4, 5, 6, 7], batch, lm, draft)
    assert_close(base.loss_k[0], float(ce.mean()), rtol=1e-5, atol=1e-6)
    assert_close(masked.loss_k[0], float(ce[[0, 1, 3]].mean()), rtol=1e-5, atol=1e-6)  # anchors 5 and 7 dropped


def test_loss_mask_of_the_position_token_counts_two_tokens_earlier():
    """Default: a prediction of token j counts if token j is an assistant token; `position`: if token
    j - 2 is (the token at the step's own position t + k), as in EAGLE and SpecForge, so the first two
    answer tokens' predictions drop out and the two after the answer's last one come in (if real)."""
    draft = make_draft()
    batch = crafted_batch()
    batch["loss_mask"] = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    lm, batch["final_hidden"] = target_head([3] * 10)
    base = ttt_forward(draft, batch, lm, ttt=2, return_logits=True)
    ref = ttt_forward(draft, batch, lm, ttt=2, return_logits=True, loss=LossSpec(mask_token="position"))
    for k in range(2):
        # predicted tokens t + 2 + k in 3..6 (default) vs position tokens t + k in 3..6, i.e. predicted 5..8
        base_anchors = [t for t in range(10) if 3 <= t + 2 + k <= 6]
        ref_anchors = [t for t in range(10) if 3 <= t + k <= 6 and t + 2 + k < 10]
        assert base.count_k[k] == len(base_anchors) and ref.count_k[k] == len(ref_anchors), k
        for res, anchors in ((base, base_anchors), (ref, ref_anchors)):
            ce = per_anchor_ce(res, k, anchors, batch, lm, draft)
            assert_close(res.loss_k[k], float(ce.mean()), rtol=1e-5, atol=1e-6)


def test_loss_norm_all_divides_by_every_position_of_the_batch():
    draft = make_draft()
    batch = make_batch([12, 7])  # padded to 12: B*T = 24 positions, fewer counted
    lm = torch.randn(V, H, generator=torch.Generator().manual_seed(2))
    base = ttt_forward(draft, batch, lm, ttt=3)
    ref = ttt_forward(draft, batch, lm, ttt=3, loss=LossSpec(norm="all"))
    for k in range(3):
        assert 0 < base.count_k[k] < 24
        assert_close(ref.loss_k[k], base.loss_k[k] * base.count_k[k] / 24, rtol=1e-6, atol=1e-7)
    assert_close(float(ref.loss.detach()), sum(0.8 ** k * ref.loss_k[k] for k in range(3)), rtol=1e-6, atol=1e-7)


def test_defaults_are_the_plain_loss():
    draft = make_draft()
    batch = make_batch([11, 8])
    lm = torch.randn(V, H)
    a = ttt_forward(draft, batch, lm, ttt=3)
    b = ttt_forward(draft, batch, lm, ttt=3, loss=LossSpec())
    assert torch.equal(a.loss, b.loss) and torch.equal(a.stats, b.stats)
    assert A == draft.cfg.num_aux_layers and not draft.cfg.fc_norm and not draft.cfg.norm_output
