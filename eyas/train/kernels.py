"""Fast building blocks of the TTT forward: attention of one unrolled step, and the fused lm_head + soft CE.

Each has a plain reference twin in eyas/train/ttt.py (`impl="reference"`); tests/train/test_fast_path.py
shows they agree. What makes them faster on a GPU (the 8B-shaped bench spends most of its time in
elementwise passes over `[nh, T, T]` scores and `[N, Vd]` logits, not in matrix products):

- `dense_attention`: the scale and the causal mask are applied inside one batched GEMM
  (`baddbmm(bias, q, k^T, alpha=scale)`), query heads are folded into the GEMM's rows (no K/V
  repeat), the k diagonal scores come from one einsum, and the one softmax reads the GEMM's dtype and
  writes fp32 (`softmax(dtype=float32)`). About 2.5x fewer bytes moved than the reference.
- `flex_attention_step`: the same attention as one FlexAttention kernel over the keys
  `[k0; k1; ...; kk]` with a block mask (causal on the step-0 block, the diagonal on the others), so
  nothing of size T x T exists and fully masked blocks are skipped. Needs torch.compile to be fast and
  CUDA for backward; opt-in (`attention="flex"`).
- `linear_soft_ce`: `sum_rows soft_CE(x @ W^T, p)` and the draft argmax, chunked over rows; the
  gradients of x and W are formed chunk by chunk in the forward, so the fp32 `[N, Vd]` logits and
  their log-softmax are never kept for the backward. With `train.compile_loss` the passes over each chunk's
  logits (log-sum-exp, argmax, the gradient, the gather of the target rows) are compiled too.
- `linear_lk`: the same chunking for the LK losses (train.loss=lk_alpha|lk_hybrid), whose gradient with respect
  to the logits is written out in `lk_chunk`.
"""

from __future__ import annotations

import functools

import torch


# ---------------------------------------------------------------- attention of TTT step k

def causal_bias(t: int, groups: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[1, groups*T, T] additive mask, `groups` copies of: 0 where key <= query, -inf above the diagonal."""
    if torch.compiler.is_compiling():  # traced into the graph (the compiler folds it); cached in eager mode
        return _causal_bias(t, groups, device, dtype)
    return _cached_causal_bias(t, groups, device, dtype)


def _causal_bias(t: int, groups: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    upper = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
    bias = torch.zeros(1, t, t, dtype=dtype, device=device).masked_fill(upper, float("-inf"))
    return bias.repeat(1, groups, 1)


_cached_causal_bias = functools.lru_cache(maxsize=8)(_causal_bias)


def dense_attention(q, k0, v0, diag_k, diag_v, scale: float) -> torch.Tensor:
    """q [B, nh, T, d]; k0, v0 [B, nkv, T, d]; diag_k/diag_v the k diagonal keys and values stacked,
    [B, nkv, T, k, d], or None (k = 0) -> [B, T, nh*d]."""
    b, nh, t, d = q.shape
    nkv = k0.shape[1]
    g = nh // nkv
    qg = q.reshape(b * nkv, g * t, d)  # query head h uses kv head h // g; rows = (head in group, position)
    kt = k0.reshape(b * nkv, t, d).transpose(1, 2)  # [B*nkv, d, T]
    dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else q.dtype
    bias = causal_bias(t, g, q.device, dtype)  # [1, g*T, T]
    scores = torch.baddbmm(bias, qg, kt, alpha=scale).view(b, nkv, g, t, t)  # masked, scaled, one GEMM
    if diag_k is not None:
        sd = torch.einsum("bngtd,bntkd->bngtk", q.view(b, nkv, g, t, d), diag_k) * scale  # [B, nkv, g, T, k]
        scores = torch.cat([scores, sd.to(scores.dtype)], dim=-1)
    probs = scores.softmax(dim=-1, dtype=torch.float32)  # one fp32 softmax over T + k keys
    out = probs[..., :t].to(v0.dtype).view(b * nkv, g * t, t) @ v0.reshape(b * nkv, t, d)  # [B*nkv, g*T, d]
    out = out.view(b, nkv, g, t, d)
    if diag_v is not None:
        out = out + torch.einsum("bngtk,bntkd->bngtd", probs[..., t:].to(diag_v.dtype), diag_v)
    return out.reshape(b, nh, t, d).transpose(1, 2).reshape(b, t, nh * d)


@functools.lru_cache(maxsize=64)
def ttt_block_mask(t: int, k: int, device: torch.device):
    """FlexAttention block mask of step k over the keys [k0 (T); k1 (T); ...; kk (T)]."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // t
        pos = kv_idx - block * t
        return ((block == 0) & (pos <= q_idx)) | ((block > 0) & (pos == q_idx))

    return create_block_mask(mask_mod, None, None, t, (k + 1) * t, device=device, _compile=device.type == "cuda")


_compiled_flex = None


def flex_attention_step(q, k0, v0, diag_k, diag_v, scale: float, block_mask) -> torch.Tensor:
    """The attention of `dense_attention` as one FlexAttention call (fp32 online softmax inside)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    b, nh, t, d = q.shape
    keys, values = k0, v0
    if diag_k is not None:  # [B, nkv, T, k, d] -> the blocks k1..kk after k0: [B, nkv, (k+1)*T, d]
        nkv, k = diag_k.shape[1], diag_k.shape[3]
        keys = torch.cat([k0, diag_k.transpose(2, 3).reshape(b, nkv, k * t, d)], dim=2)
        values = torch.cat([v0, diag_v.transpose(2, 3).reshape(b, nkv, k * t, d)], dim=2)
    fn = flex_attention
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        fn = _compiled_flex
    out = fn(q, keys.to(q.dtype), values.to(q.dtype), block_mask=block_mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(b, t, nh * d)


# ---------------------------------------------------------------- lm_head + soft cross-entropy

def rows_per_chunk(vocab: int, budget_bytes: int = 2**28) -> int:
    """Rows whose fp32 logits fit in budget_bytes (256 MiB by default)."""
    return max(1, budget_bytes // (4 * vocab))


def soft_ce_chunk(logits, probs, rows, grad_dtype):
    """One chunk of `linear_soft_ce` after the matrix product, everything that reads the [n, Vd] logits.

    logits [n, Vd] (the product's dtype); probs [M, Vd] fp32, of which rows [n] are this chunk's targets
    (gathered here, so that a compiled version reads them in place); grad_dtype None for no gradient.
    -> (soft cross-entropy summed over the rows (fp32), argmax [n], d loss / d logits [n, Vd] in grad_dtype
    or None). The gradient is softmax(logits) * mass - p, where mass = sum(p) is 1 up to rounding.
    Eager, this is about fifteen passes over fp32 [n, Vd] tensors; compiled (train.compile_loss), a few fused
    kernels. In the H200 profile of a SmolLM2-sized step (Vd 32,000; bench/train.py --profile) such eager
    element-wise kernels take most of the GPU time, the matrix products little.
    """
    z = logits.float()  # [n, Vd]
    p = probs[rows]  # [n, Vd]
    lse = torch.logsumexp(z, dim=-1)  # [n]
    mass = p.sum(-1)  # [n], 1 up to rounding: the target is renormalised
    loss = (lse * mass).sum() - torch.linalg.vecdot(p, z).sum()
    argmax = z.argmax(-1)
    if grad_dtype is None:
        return loss, argmax, None
    # built in place over the fp32 logits (eager, no second [n, Vd] buffer)
    grad = z.sub_(lse[:, None]).exp_().mul_(mass[:, None]).sub_(p).to(grad_dtype)
    return loss, argmax, grad


_compiled_soft_ce_chunk = None


def _chunk_fn(compiled: bool):
    global _compiled_soft_ce_chunk
    if not compiled:
        return soft_ce_chunk
    if _compiled_soft_ce_chunk is None:
        # dynamic: the last chunk of every batch and every step's row count differ
        _compiled_soft_ce_chunk = torch.compile(soft_ce_chunk, dynamic=True)
    return _compiled_soft_ce_chunk


def _scaled_grads(ctx, grad_loss):
    """The chunked losses' backward: the gradients for x and the head, computed in the forward (saved as
    grad_x, grad_w), times the incoming gradient of the summed loss; None for an input that needs none."""
    grad_x, grad_w = ctx.saved_tensors
    gx = (grad_x.float() * grad_loss).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
    gw = (grad_w * grad_loss).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
    return gx, gw


class _LinearTargetLoss(torch.autograd.Function):
    """sum over rows of a loss of x @ weight.T, a chunk of rows at a time: fn(logits, target, rows, grad_dtype) ->
    (the chunk's summed loss, argmax, d loss / d logits or None[, a per-row figure]) is the loss; `target` is
    what fn reads its targets from (rows [N] says which entry belongs to each x row). Returns (loss, argmax,
    the per-row figures [N] fp32, or an empty tensor where fn gives none)."""

    @staticmethod
    def forward(ctx, x, weight, target, rows, compute_dtype, chunk, fn):
        # x [N, H]; weight [Vd, H]
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(compute_dtype)
            xc = x.to(compute_dtype)
            want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            n = xc.shape[0]
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            argmax = torch.empty(n, dtype=torch.long, device=x.device)
            per_row = None
            grad_x = torch.empty_like(xc) if want_x else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if want_w else None
            for i in range(0, n, chunk):
                xi = xc[i:i + chunk]
                part, argmax[i:i + chunk], g, *extra = fn(xi @ w.T, target, rows[i:i + chunk],
                                                          compute_dtype if want_x or want_w else None)
                loss += part
                if extra:
                    if per_row is None:
                        per_row = torch.empty(n, dtype=torch.float32, device=x.device)
                    per_row[i:i + chunk] = extra[0]
                if want_x:
                    grad_x[i:i + chunk] = g @ w
                if want_w:
                    grad_w += (g.T @ xi).float()
        none = torch.empty(0, device=x.device)
        ctx.save_for_backward(grad_x if want_x else none, grad_w if want_w else none)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        per_row = none if per_row is None else per_row
        ctx.mark_non_differentiable(argmax, per_row)
        return loss, argmax, per_row

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax, _grad_per_row):
        return *_scaled_grads(ctx, grad_loss), None, None, None, None, None


def linear_soft_ce(x: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor | None = None,
                   chunk: int | None = None, compiled: bool = False):
    """(sum over rows of soft cross-entropy of x @ weight.T against probs[rows], argmax of the logits [N]).

    Matches `F.cross_entropy((x @ weight.T).float(), probs[rows], reduction="sum")` (under autocast the
    product runs in the autocast dtype, as a Linear would). `rows` defaults to all of probs' rows in order;
    `compiled` runs each chunk's passes over the logits through torch.compile (`soft_ce_chunk`).
    """
    dev = x.device.type
    compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if rows is None:
        rows = torch.arange(probs.shape[0], device=probs.device)
    if rows.shape[0] != x.shape[0]:
        raise ValueError(f"linear_soft_ce: {x.shape[0]} rows of x but {rows.shape[0]} target rows")
    loss, argmax, _ = _LinearTargetLoss.apply(x, weight, probs, rows, compute_dtype,
                                              chunk or rows_per_chunk(weight.shape[0]), _chunk_fn(compiled))
    return loss, argmax


# ---------------------------------------------------------------- lm_head + an LK loss

LK_EPS = 1e-5  # floor of the acceptance rate under -log(alpha): a draft that puts no mass on p stays finite


def lk_chunk(logits, probs, rows, grad_dtype, *, kind: str, eta: float):
    """One chunk of `linear_lk` after the matrix product: (the LK loss summed over the rows (fp32), argmax [n],
    d loss / d logits [n, Vd] in grad_dtype or None).

    With q = softmax(z), alpha = sum_v min(p_v, q_v) and m_v = 1 where q_v < p_v (where the minimum is q's):
    d alpha / d z_j = q_j (m_j - sum_v m_v q_v); d KL(p || q) / d z_j = q_j sum(p) - p_j (sum(p) is 1 up to
    rounding). `lk_alpha` = -log(max(alpha, LK_EPS)), whose gradient is -(d alpha / d z) / alpha above the floor
    and 0 under it; `lk_hybrid` = lam KL + (1 - lam)(1 - alpha) with lam = exp(-eta alpha) a constant.
    """
    z = logits.float()  # [n, Vd]
    p = probs[rows]  # [n, Vd]
    argmax = z.argmax(-1)
    logq = z.log_softmax(-1)
    q = logq.exp()
    alpha = torch.minimum(p, q).sum(-1)  # [n]
    if kind == "lk_alpha":
        loss = -alpha.clamp_min(LK_EPS).log().sum()
    else:
        kl = (torch.xlogy(p, p) - p * logq).sum(-1)  # [n]; 0 log 0 = 0
        lam = torch.exp(-eta * alpha)
        loss = (lam * kl + (1 - lam) * (1 - alpha)).sum()
    if grad_dtype is None:
        return loss, argmax, None
    m = (q < p).float()
    dalpha = q * (m - (m * q).sum(-1, keepdim=True))  # [n, Vd]
    if kind == "lk_alpha":
        grad = dalpha * torch.where(alpha > LK_EPS, -1.0 / alpha.clamp_min(LK_EPS), 0.0)[:, None]
    else:
        dkl = q * p.sum(-1, keepdim=True) - p
        grad = lam[:, None] * dkl - (1 - lam)[:, None] * dalpha
    return loss, argmax, grad.to(grad_dtype)


def linear_lk(x: torch.Tensor, weight: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, kind: str,
              eta: float = 3.0, chunk: int | None = None):
    """(an LK loss of x @ weight.T against probs[rows], summed over rows; the argmax of the logits [N]), a chunk of
    rows at a time with the gradients formed in the forward, as `linear_soft_ce` does for KL, so that the fp32
    [N, Vd] logits, softmax and min(p, q) never exist whole. Equals `eyas.train.ttt.lk_loss_sum` on the logits
    (kind "lk_alpha" or "lk_hybrid"); under autocast the product runs in the autocast dtype, as a Linear would."""
    if kind not in ("lk_alpha", "lk_hybrid"):
        raise ValueError(f"linear_lk: kind={kind!r}, expected lk_alpha or lk_hybrid")
    if rows.shape[0] != x.shape[0]:
        raise ValueError(f"linear_lk: {x.shape[0]} rows of x but {rows.shape[0]} target rows")
    dev = x.device.type
    compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    # about twice the soft CE's fp32 passes live at once (q, log q, p, min and the gradient): half its rows
    loss, argmax, _ = _LinearTargetLoss.apply(x, weight, probs, rows, compute_dtype,
                                              chunk or max(1, rows_per_chunk(weight.shape[0]) // 2),
                                              functools.partial(lk_chunk, kind=kind, eta=float(eta)))
    return loss, argmax


# ---------------------------------------------------------------- lm_head + weighted hard-label cross-entropy

def weighted_ce_chunk(logits, target, rows, grad_dtype):
    """One chunk of `linear_weighted_ce` after the matrix product: target = (labels [N], row weights [N]), rows [n]
    this chunk's entries -> (the weighted cross-entropy summed over the rows (fp32), argmax [n], d loss / d logits
    [n, V] in grad_dtype or None, the cross-entropy of each row [n] fp32). The gradient is weight * (softmax -
    one_hot), built over the fp32 logits in place."""
    labels, weights = target
    lab, wt = labels[rows], weights[rows].float()
    z = logits.float()  # [n, V]
    lse = torch.logsumexp(z, dim=-1)
    ce = lse - z.gather(1, lab[:, None])[:, 0]
    argmax = z.argmax(-1)
    loss = (ce * wt).sum()
    if grad_dtype is None:
        return loss, argmax, None, ce
    g = z.sub_(lse[:, None]).exp_()
    g[torch.arange(g.shape[0], device=g.device), lab] -= 1.0
    return loss, argmax, g.mul_(wt[:, None]).to(grad_dtype), ce


def linear_weighted_ce(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_weights: torch.Tensor,
                       chunk: int | None = None):
    """(sum over rows of row_weights * cross-entropy of x @ weight.T against labels, that cross-entropy per row
    [N] fp32 (no gradient), the argmax of the logits [N]), computed a chunk of rows at a time, so that the
    [N, V] logits over a target's whole vocabulary never exist at once (a DFlash micro-batch scores tens of
    thousands of block slots). The loss equals `(F.cross_entropy((x @ weight.T).float(), labels, reduction="none")
    * row_weights).sum()`; under autocast the product runs in the autocast dtype, as a Linear would."""
    dev = x.device.type
    compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if not (x.shape[0] == labels.shape[0] == row_weights.shape[0]):
        raise ValueError(f"linear_weighted_ce: {x.shape[0]} rows of x, {labels.shape[0]} labels, "
                         f"{row_weights.shape[0]} weights")
    rows = torch.arange(x.shape[0], device=x.device)
    loss, argmax, ce = _LinearTargetLoss.apply(x, weight, (labels, row_weights), rows, compute_dtype,
                                               chunk or rows_per_chunk(weight.shape[0]), weighted_ce_chunk)
    return loss, ce, argmax
