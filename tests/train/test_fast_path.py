"""The fast TTT path (eyas/train/kernels.py) reproduces the reference path: losses, statistics, gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from eyas.train.kernels import dense_attention, flex_attention_step, linear_soft_ce, ttt_block_mask
from eyas.train.ttt import reference_attention, stack_diagonal, ttt_forward
from test_ttt import H, V, make_batch, make_draft


def grads(draft):
    return {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def run(impl, batch, lm_head, ttt=4, autocast=False, **kw):
    draft = make_draft()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        res = ttt_forward(draft, batch, lm_head, ttt=ttt, impl=impl, **kw)
    res.loss.backward()
    return res, grads(draft)


def test_fast_path_equals_reference_in_fp32():
    batch = make_batch([17, 11, 14])
    lm_head = torch.randn(V, H)
    ref, ref_grads = run("reference", batch, lm_head)
    fast, fast_grads = run("fast", batch, lm_head)
    assert_close(fast.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert_close(fast.loss_k, ref.loss_k, rtol=1e-5, atol=1e-5)
    assert fast.count_k == ref.count_k and fast.correct_k == ref.correct_k
    assert ref_grads.keys() == fast_grads.keys() and "lm_head.weight" in fast_grads
    for name in ref_grads:
        assert_close(fast_grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_fast_path_follows_autocast_like_the_reference():
    batch = make_batch([12, 9])
    lm_head = torch.randn(V, H)
    ref, ref_grads = run("reference", batch, lm_head, ttt=3, autocast=True)
    fast, fast_grads = run("fast", batch, lm_head, ttt=3, autocast=True)
    assert_close(fast.loss, ref.loss, rtol=3e-2, atol=3e-2)
    for name in ref_grads:
        assert fast_grads[name].dtype == ref_grads[name].dtype == torch.float32
        assert_close(fast_grads[name], ref_grads[name], rtol=0.1, atol=0.05 * ref_grads[name].abs().max().item(),
                     msg=name)


def test_linear_soft_ce_in_chunks_equals_cross_entropy():
    torch.manual_seed(0)
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(7, 8, requires_grad=True)
    p = torch.randn(10, 7).softmax(-1)
    logits = x @ w.T
    ref = F.cross_entropy(logits, p, reduction="sum")
    (ref * 0.3).backward()
    ref_gx, ref_gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    loss, argmax = linear_soft_ce(x, w, p, chunk=3)
    (loss * 0.3).backward()
    assert_close(loss, ref)
    assert torch.equal(argmax, logits.argmax(-1))
    assert_close(x.grad, ref_gx)
    assert_close(w.grad, ref_gw)


def test_linear_soft_ce_gathers_its_target_rows_and_traces_whole():
    """The target rows are gathered inside each chunk (a compiled chunk reads them in place); the chunk's
    passes trace into one graph with dynamic sizes (what a compiled training step runs on CUDA; dynamo's
    aot_eager backend here: the graph and its backward logic, no code generation)."""
    from eyas.train.kernels import soft_ce_chunk

    torch.manual_seed(1)
    x, w = torch.randn(11, 8, requires_grad=True), torch.randn(7, 8, requires_grad=True)
    probs = torch.randn(20, 7).softmax(-1)
    rows = torch.randperm(20)[:11]
    ref = F.cross_entropy(x @ w.T, probs[rows], reduction="sum")
    gx, gw = torch.autograd.grad(ref, (x, w))
    loss, argmax = linear_soft_ce(x, w, probs, rows, chunk=4)
    assert_close(loss, ref)
    assert_close(torch.autograd.grad(loss, (x, w)), (gx, gw))

    traced = torch.compile(soft_ce_chunk, backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (5, 3):  # two chunk sizes, one graph
        logits = torch.randn(n, 7, dtype=torch.bfloat16)
        want = soft_ce_chunk(logits, probs, rows[:n], torch.bfloat16)
        got = traced(logits, probs, rows[:n], torch.bfloat16)
        assert_close(got[0], want[0])
        assert torch.equal(got[1], want[1])
        assert_close(got[2], want[2])
        assert soft_ce_chunk(logits, probs, rows[:n], None)[2] is None


@pytest.mark.parametrize("k", [0, 1, 3])
def test_dense_and_flex_attention_equal_the_reference(k):
    torch.manual_seed(k)
    b, nh, nkv, t, d = 2, 4, 2, 9, 8
    q = torch.randn(b, nh, t, d)
    k0, v0 = torch.randn(b, nkv, t, d), torch.randn(b, nkv, t, d)
    dk = [torch.randn(b, nkv, t, d) for _ in range(k)]
    dv = [torch.randn(b, nkv, t, d) for _ in range(k)]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    ref = reference_attention(q, k0, v0, dk, dv, causal, d ** -0.5)
    # the fast paths take the diagonal keys and values stacked, as ttt_forward builds them step by step
    sk = sv = None
    for kj, vj in zip(dk, dv):
        sk, sv = stack_diagonal(sk, kj), stack_diagonal(sv, vj)
    assert (sk is None) == (k == 0) and (k == 0 or sk.shape == (b, nkv, t, k, d))
    assert_close(dense_attention(q, k0, v0, sk, sv, d ** -0.5), ref)
    # FlexAttention has no CPU backward; its forward pins the block mask (the GPU test covers training)
    flex = flex_attention_step(q, k0, v0, sk, sv, d ** -0.5, ttt_block_mask(t, k, q.device))
    assert_close(flex, ref, rtol=1e-4, atol=1e-5)


def test_compiling_the_step_leaves_room_for_every_unrolled_graph():
    """Each TTT step is its own graph under torch.compile; with dynamo's default limit (8) the later steps
    of K = 7 silently ran eagerly on the H200. Building the module must raise the limit."""
    import torch._dynamo as dynamo

    from eyas.train.loop import TTTModule

    before = dynamo.config.recompile_limit
    try:
        dynamo.config.recompile_limit = 8
        TTTModule(torch.nn.Module(), 7, 0.8, "fused", compile=True)
        assert dynamo.config.recompile_limit >= 4 * 8
    finally:
        dynamo.config.recompile_limit = before


def test_a_compiled_dense_step_is_traced_once_for_every_batch_shape():
    """Batches change their rows and length; the compiled steps are marked dynamic in both up front, so the
    K unrolled steps are traced once whatever the batch shape: four graphs (step 0 without diagonal keys, step 1
    without earlier ones, step 2 with one, a count dynamo always specialises, and one for the steps after,
    whose stacked diagonal keys grow), not one per step (on the H200 each cost about 17 s of compiling) nor
    one per new dimension (dynamo's eager backend: no codegen)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from eyas.train.ttt import draft_step

    dynamo.reset()
    counters.clear()
    draft, k = make_draft(), 5
    step_fn = torch.compile(draft_step, backend="eager")
    lm_head = torch.randn(V, H)
    for i, lengths in enumerate([[40, 33], [50, 20, 17], [64, 60], [30] * 4]):
        res = ttt_forward(draft, make_batch(lengths, seed=i), lm_head, k, step_fn=step_fn)
        res.loss.backward()
    assert counters["stats"]["unique_graphs"] == 4
    dynamo.reset()


def test_padding_rows_changes_neither_loss_nor_statistics():
    """pad_rows (what a compiled step does to small batches) appends empty rows: the loss, the per-step
    statistics and the gradients are those of the unpadded batch."""
    from eyas.train.data import pad_rows

    batch, lm_head = make_batch([37, 20], seed=5), torch.randn(V, H)
    padded = pad_rows(batch, 200)
    assert padded["input_ids"].shape == (6, 37) and not padded["attention_mask"][2:].any()
    assert pad_rows(padded, 200) is padded and pad_rows(batch, 10)["input_ids"].shape[0] == 2
    assert pad_rows(make_batch([37], seed=5), 1)["input_ids"].shape[0] == 2  # never one row...
    assert pad_rows(make_batch([37], seed=5), 1, 40)["input_ids"].shape[0] == 1  # ...unless past the budget
    assert pad_rows(batch, 200, 120)["input_ids"].shape[0] == 3  # at most the budget's rows
    res, g = run("fast", batch, lm_head)
    res_p, g_p = run("fast", padded, lm_head)
    assert res.count_k == res_p.count_k and res.correct_k == res_p.correct_k
    assert_close(res_p.loss, res.loss, rtol=1e-6, atol=1e-6)
    for name in g:
        assert_close(g_p[name], g[name], rtol=1e-5, atol=1e-6)


def test_a_compiled_flex_step_is_traced_once_for_every_batch_shape():
    """The H200's `full` run compiled its flex steps in four rounds of K graphs (first batch, first change
    of rows, a small batch, a one-row batch). Compiled dynamic from the start and with small batches padded
    (TTTModule with compile), the unrolled steps are traced once (four graphs) over batches of
    changing rows and lengths, one-row leftovers included (dynamo's eager backend, forward only: flex
    attention has no CPU backward)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from eyas.train.loop import TTTModule

    k = 5
    model = TTTModule(make_draft(), k, 0.8, "fused", attention="flex", compile=True, batch_tokens=1200,
                      compile_backend="eager")  # no code generation on the CPU
    lm_head = torch.randn(V, H)
    dynamo.reset()
    counters.clear()
    try:
        with torch.no_grad():
            for i, lengths in enumerate([[300, 290, 260], [200, 180], [140] * 5, [390], [256, 130], [170]]):
                res = model(make_batch(lengths, seed=i), lm_head)
                assert res.count_k[0] > 0
        assert counters["stats"]["unique_graphs"] == 4  # steps 0, 1, 2 and 3.. (as the dense test)
    finally:
        dynamo.reset()
