"""Training-time test (docs/ALGORITHM.md section 3): K unrolled draft steps, vectorised over all positions.

Index arithmetic (t = the anchor position, k = the step, 0-based):

    step k at anchor t feeds    hidden h_k[t]  (h_0 = fc(aux[t]); h_k = the step k-1 pre-norm output at t)
                                token  ids[t + 1 + k]
                                RoPE position t + k
                      predicts  token ids[t + 2 + k], trained towards the target's distribution at
                                position t + 1 + k  (softmax(lm_head(final[t + 1 + k])) on the draft vocab)
                      counted   iff loss_mask[t + 2 + k] (the predicted token is an assistant token) and
                                attention_mask[t + 2 + k] (it is a real token)

Attention of step k at anchor t: every step-0 key at positions <= t (causal) plus, for j in 1..k, the
step-j key at the same anchor t (a diagonal, one dot product each), under one fp32 softmax. This is
exactly what chain drafting sees at inference when the committed prefix ends at t (the test
tests/train/test_ttt.py proves it against `Eagle3Draft.forward` with its KV cache). With right padding
and causal attention, no real position ever sees a padded one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.draft import Eagle3Draft, rope_cos_sin
from eyas.train.kernels import LK_EPS, dense_attention, flex_attention_step, linear_lk, linear_soft_ce, ttt_block_mask


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros at the end, so that out[:, t] = x[:, t + n]."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


@dataclass
class TargetView:
    """The target's side of a batch, at the positions some step needs (rows of the flat [B*T])."""

    probs: torch.Tensor  # [N, Vd] fp32 target distribution on the draft vocab, renormalised
    argmax: torch.Tensor  # [N] target argmax over the full vocabulary (target ids)
    row_of: torch.Tensor  # [B*T] row in `probs` of each flat position, -1 where not needed


@torch.no_grad()
def target_view(final_hidden, need, lm_head_weight, draft_target_ids, chunk: int = 4096) -> TargetView:
    """Target distributions at the flat positions where `need` [B, T] is True.

    final_hidden [B, T, H]; lm_head_weight [V, H]; draft_target_ids [Vd] = arange(Vd) + d2t.
    Softmax over the draft-vocab subset of the logits IS the restricted, renormalised distribution.
    Work is chunked over positions so the full [N, V] logits never exist at once.
    """
    flat = need.reshape(-1)
    rows = flat.nonzero().squeeze(1)  # [N]
    hidden = final_hidden.reshape(-1, final_hidden.shape[-1])[rows].to(lm_head_weight.dtype)  # [N, H]
    sub_weight = lm_head_weight[draft_target_ids]  # [Vd, H]
    probs, argmax = [], []
    for i in range(0, hidden.shape[0], chunk):
        h = hidden[i:i + chunk]
        probs.append((h @ sub_weight.T).float().softmax(-1))  # [n, Vd]
        argmax.append((h @ lm_head_weight.T).argmax(-1))  # [n]
    vd = sub_weight.shape[0]
    row_of = torch.full_like(flat, -1, dtype=torch.long)
    row_of[rows] = torch.arange(len(rows), device=rows.device)
    if not probs:
        return TargetView(hidden.new_zeros(0, vd, dtype=torch.float32), rows.new_zeros(0), row_of)
    return TargetView(torch.cat(probs), torch.cat(argmax), row_of)


def reference_attention(q, k0, v0, diag_k, diag_v, causal, scale):
    """The plain TTT attention: q [B, nh, T, d]; k0/v0 [B, nkv, T, d]; diag_k/diag_v lists -> [B, T, nh*d]."""
    b, nh, t, d = q.shape
    nkv = k0.shape[1]
    qg = q.view(b, nkv, nh // nkv, t, d)  # query head h uses kv head h // (nh // nkv)
    scores = (qg @ k0.unsqueeze(2).transpose(-1, -2)).float() * scale  # [B, nkv, g, T, T]
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(qg * kj.unsqueeze(2)).sum(-1, keepdim=True).float() * scale for kj in diag_k]  # each [B, nkv, g, T, 1]
    probs = torch.cat([scores, *diag], dim=-1).softmax(dim=-1)  # one fp32 softmax over T + k keys
    out = probs[..., :t].to(v0.dtype) @ v0.unsqueeze(2)  # [B, nkv, g, T, d]
    for j, vj in enumerate(diag_v):
        out = out + probs[..., t + j:t + j + 1].to(vj.dtype) * vj.unsqueeze(2)
    return out.reshape(b, nh, t, d).transpose(1, 2).reshape(b, t, nh * d)


def stack_diagonal(stacked, new: torch.Tensor) -> torch.Tensor:
    """The diagonal keys (or values) so far [B, nkv, T, j, d] (None for j = 0) with `new` [B, nkv, T, d] after
    them -> [B, nkv, T, j + 1, d]."""
    new = new.unsqueeze(3)
    return new if stacked is None else torch.cat([stacked, new], dim=3)


def draft_step(draft: Eagle3Draft, h, ids_k, cos, sin, k0, v0, diag_k, diag_v, attention: str,
               block_mask=None):
    """One unrolled step of the draft layer over all anchors -> (pre-norm output [B, T, H], keys, values):
    at step 0 its keys and values (the next steps' k0, v0), after it the diagonal stacks with its own appended
    (the next step's diag_k, diag_v).

    `k0`/`v0` are None at step 0 (the step's own keys are then the causal step-0 keys). `diag_k`/`diag_v`:
    the diagonal keys and values of the steps after 0 before this one, stacked [B, nkv, T, j, d], or None.
    One tensor rather than a list, so that under torch.compile the steps from 3 on share one graph (a list's
    length is part of a graph; a dimension marked dynamic is not). A plain function of the draft so that it
    can be torch.compile'd from outside (TTTModule(compile=True)).
    """
    layer = draft.layers[0]
    attn = layer.self_attn
    embeds = draft.embed_tokens(ids_k).to(h.dtype)  # [B, T, H]
    q, kk, vv = attn.qkv(layer.attn_input(embeds, h), cos, sin)  # q [B, nh, T, d]; kk, vv [B, nkv, T, d]
    if k0 is None:
        k0, v0 = kk, vv
        keys, values = kk, vv
    else:
        diag_k, diag_v = stack_diagonal(diag_k, kk), stack_diagonal(diag_v, vv)
        keys, values = diag_k, diag_v
    scale = 1.0 / math.sqrt(draft.cfg.head_dim)
    if attention == "reference":
        t = q.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        listed = [] if diag_k is None else list(diag_k.unbind(3)), [] if diag_v is None else list(diag_v.unbind(3))
        out = reference_attention(q, k0, v0, *listed, causal, scale)
    elif attention == "flex":
        out = flex_attention_step(q, k0, v0, diag_k, diag_v, scale, block_mask)
    else:
        out = dense_attention(q, k0, v0, diag_k, diag_v, scale)
    return layer.finish(h, attn.o_proj(out)), keys, values


def _dynamic(*tensors, block_mask=None) -> None:
    """Mark the batch and sequence dimensions of a compiled step's inputs dynamic before the first call.

    Otherwise the compiler specialises the first graph of each unrolled step on the first batch's shape
    and compiles all K steps again, dynamic, when a dimension first changes. Inputs are [B, T, ...] (hidden
    states, ids, rope tables), [B, heads, T, d], or the stacked diagonal keys and values [B, heads, T, j, d],
    whose j grows by one per step (dynamo always specialises a size of 1, so steps 0, 1, 2 and 3.. make four
    graphs, where a list of diagonal keys made one per step); a flex block mask's block counts ([1, 1, T/128]
    and [1, 1, T/128, (k+1)T/128]) follow T. For flex this is not enough alone: the length is tied to the block
    mask's lengths, plain ints, so TTTModule also compiles flex steps with `dynamic=True`; the marks keep
    dynamo from tying the batch size to a block count of the same value (its "duck sizing").
    """
    import torch._dynamo as dynamo

    for x in tensors:
        if x is None:
            continue
        dynamo.maybe_mark_dynamic(x, 0)
        dynamo.maybe_mark_dynamic(x, 2 if x.dim() >= 4 else 1)
        if x.dim() == 5:
            dynamo.maybe_mark_dynamic(x, 3)
    if block_mask is not None:
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            x = getattr(block_mask, name, None)
            if isinstance(x, torch.Tensor):
                for dim in range(2, x.dim()):
                    dynamo.maybe_mark_dynamic(x, dim)


@dataclass
class TTTResult:
    """The differentiable loss plus per-step statistics, kept on the device until first read (one sync).

    A dataclass on purpose: FSDP2 finds the output tensors of a module inside dataclasses (not inside
    plain objects) to hook the backward that reduce-scatters the gradients.
    """

    loss: torch.Tensor  # scalar: sum_k decay**k * loss_k (differentiable)
    stats: torch.Tensor  # [3, K] float64: loss_k (as normalised), correct, count per step
    logits_k: list | None = None  # per-step [B, T, Vd], only with return_logits
    _lists: list | None = None

    def _read(self):
        if self._lists is None:
            self._lists = self.stats.tolist()
        return self._lists

    @property
    def loss_k(self) -> list[float]:  # per-step loss (soft cross-entropy by default)
        return self._read()[0]

    @property
    def correct_k(self) -> list[int]:  # per-step count of draft argmax == target argmax
        return [int(x) for x in self._read()[1]]

    @property
    def count_k(self) -> list[int]:  # per-step count of positions in the loss
        return [int(x) for x in self._read()[2]]


ATTENTION_IMPLS = ("dense", "flex", "reference")
LOSSES = ("kl", "lk_alpha", "lk_hybrid")
MASK_TOKENS = ("predicted", "position")
LOSS_NORMS = ("counted", "all")


@dataclass(frozen=True)
class LossSpec:
    """What the TTT loss is and which positions it counts (train.loss ... train.loss_norm; docs/ALGORITHM.md
    section 3). The defaults are eyas's loss; the three masking/normalising switches give EAGLE's and
    SpecForge's reference behaviour."""

    kind: str = "kl"  # kl (soft cross-entropy) | lk_alpha (-log alpha) | lk_hybrid (adaptive KL/TV blend)
    lk_eta: float = 3.0  # lk_hybrid: the KL weight is exp(-lk_eta * alpha), alpha not differentiated
    mask_oov_target: bool = False  # drop positions whose target top-1 token is outside the draft vocabulary
    mask_token: str = "predicted"  # whose loss_mask counts a prediction: the predicted token's | position t + k's
    norm: str = "counted"  # a step's loss averaged over its counted positions | over all B*T positions

    def __post_init__(self):
        for name, value, allowed in (("kind", self.kind, LOSSES), ("mask_token", self.mask_token, MASK_TOKENS),
                                     ("norm", self.norm, LOSS_NORMS)):
            if value not in allowed:
                raise ValueError(f"LossSpec.{name}={value!r}: expected one of {allowed}")


def shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, :-n] padded with zeros at the start, so that out[:, t + n] = x[:, t]."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :n]), x[:, :-n]], dim=1)


def lk_loss_sum(logits: torch.Tensor, probs: torch.Tensor, kind: str, eta: float = 3.0) -> torch.Tensor:
    """An LK loss (Samarin et al., arXiv 2602.23881) summed over rows: logits [N, Vd], probs [N, Vd] the target.

    alpha = sum_v min(p_v, q_v) is the acceptance rate of sampling from q against p (1 - TV). `lk_alpha`
    is -log(alpha); `lk_hybrid` is lam * KL(p || q) + (1 - lam) * (1 - alpha) with lam = exp(-eta * alpha)
    taken as a constant, so a poor draft learns from KL and a good one from the acceptance rate itself.
    """
    logq = logits.float().log_softmax(-1)  # [N, Vd]
    alpha = torch.minimum(probs, logq.exp()).sum(-1)  # [N]
    if kind == "lk_alpha":
        return -alpha.clamp_min(LK_EPS).log().sum()
    kl = (torch.xlogy(probs, probs) - probs * logq).sum(-1)  # [N]; 0 log 0 = 0
    lam = torch.exp(-eta * alpha.detach())
    return (lam * kl + (1 - lam) * (1 - alpha)).sum()


def counted_positions(batch: dict, ttt: int, mask_token: str) -> torch.Tensor:
    """[K, B, T] bool: step k at anchor t is in the loss (before any out-of-vocabulary mask).

    The predicted token ids[t + 2 + k] must be a real one. `predicted`: and an assistant token itself;
    `position`: the token at the step's own position t + k, two before it, must be (EAGLE's and SpecForge's
    shifted loss mask)."""
    real = batch["attention_mask"].bool()  # [B, T]
    assistant = batch["loss_mask"].bool()
    if mask_token == "predicted":
        return torch.stack([shift_left(assistant & real, 2 + k) for k in range(ttt)])
    return torch.stack([shift_left(assistant, k) & shift_left(real, 2 + k) for k in range(ttt)])


def ttt_forward(draft: Eagle3Draft, batch: dict, lm_head_weight: torch.Tensor, ttt: int,
                loss_decay: float = 0.8, features: str = "fused", return_logits: bool = False,
                impl: str = "fast", attention: str = "dense", step_fn=None, compiled_ce: bool = False,
                loss: LossSpec = LossSpec()) -> TTTResult:
    """The unrolled TTT loss of one batch (see the module docstring for the index arithmetic).

    batch: input_ids [B, T] int64, attention_mask [B, T] bool, loss_mask [B, T], aux_hidden [B, T, A*H],
    final_hidden [B, T, H]. `features="last"` keeps only the last aux state (EAGLE-2-style baseline).
    `impl="reference"` is the plain computation (reference attention, per-step fp32 logits and
    F.cross_entropy); `impl="fast"` uses `attention` ("dense" or "flex", eyas/train/kernels.py), the fused
    lm_head + soft cross-entropy, and few host syncs. `step_fn` replaces `draft_step` (a compiled one);
    `compiled_ce` compiles the soft cross-entropy's passes over the logits (eyas/train/kernels.py). `loss`:
    which loss and which positions count (LossSpec); the fast path chunks an LK loss as it does KL.
    """
    if impl not in ("fast", "reference") or attention not in ATTENTION_IMPLS:
        raise ValueError(f"impl={impl!r} / attention={attention!r}: expected fast|reference / {ATTENTION_IMPLS}")
    if impl == "reference":
        attention = "reference"
    step_fn = step_fn or draft_step
    cfg = draft.cfg
    ids = batch["input_ids"]
    b, t = ids.shape
    aux = batch["aux_hidden"]
    if features == "last":
        aux = aux[..., -cfg.hidden_size:]
    param_dtype = draft.fc.weight.dtype
    h = draft.fuse(aux.to(param_dtype))  # [B, T, H]

    # step k at anchor t predicts token t + 2 + k from the target's distribution at t + 1 + k
    valid = counted_positions(batch, ttt, loss.mask_token)  # [K, B, T]
    need = torch.zeros_like(valid[0])  # [B, T]: position j's target distribution is used
    for k in range(ttt):
        need |= shift_right(valid[k], 1 + k)
    draft_target_ids = torch.arange(cfg.draft_vocab_size, device=ids.device) + draft.d2t
    target = target_view(batch["final_hidden"], need, lm_head_weight, draft_target_ids)
    if loss.mask_oov_target:  # the target's top-1 must be a token the draft can propose
        in_vocab = torch.zeros(b * t, dtype=torch.bool, device=ids.device)
        needed = target.row_of >= 0
        in_vocab[needed] = draft.t2d[target.argmax[target.row_of[needed]]]
        valid = valid & torch.stack([shift_left(in_vocab.view(b, t), 1 + k) for k in range(ttt)])

    # anchors of every step at once (two host syncs in all)
    valid = valid.reshape(ttt, b * t)  # [K, B*T]
    counts = valid.sum(1).tolist()
    anchors_k = valid.nonzero()[:, 1].split(counts)  # K tensors [N_k] of flat positions

    pos = torch.arange(t, device=ids.device).expand(b, t)  # [B, T]
    k0 = v0 = diag_k = diag_v = None
    total = h.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(3, ttt, dtype=torch.float64, device=ids.device)
    logits_k = [] if return_logits else None
    rotary = getattr(draft, "rotary", None)  # its fp32 frequencies, on the device already
    inv_freq = rotary.inv_freq if rotary is not None else None
    for k in range(ttt):
        cos, sin = rope_cos_sin(cfg, pos + k, h.dtype, inv_freq=inv_freq)
        mask = ttt_block_mask(t, k, ids.device) if attention == "flex" else None
        ids_k = shift_left(ids, 1 + k)
        if step_fn is not draft_step:  # compiled: four graphs for the K unrolled steps (see _dynamic)
            _dynamic(h, ids_k, cos, sin, k0, v0, diag_k, diag_v, block_mask=mask)
        h, keys, values = step_fn(draft, h, ids_k, cos, sin, k0, v0, diag_k, diag_v, attention, mask)
        h = draft.step_output(h)  # the next step's hidden input (normed with cfg.norm_output)
        if k == 0:
            k0, v0 = keys, values
        else:  # the step appended its own diagonal keys and values already
            diag_k, diag_v = keys, values

        anchors = anchors_k[k]
        rows = target.row_of[anchors + 1 + k]
        flat_h = h.reshape(b * t, -1)
        n = counts[k]
        if return_logits:
            logits_k.append(draft.lm_head(draft.head_input(flat_h)).view(b, t, -1))  # [B, T, Vd]
        if loss.kind != "kl" and impl == "reference":
            logits = draft.lm_head(draft.head_input(flat_h[anchors]))  # [N_k, Vd]
            loss_sum = lk_loss_sum(logits, target.probs[rows], loss.kind, loss.lk_eta)
            predicted = logits.detach().argmax(-1)
        elif loss.kind != "kl":  # the same, a chunk of rows at a time (no [N_k, Vd] logits kept)
            loss_sum, predicted = linear_lk(draft.head_input(flat_h[anchors]), draft.lm_head.weight, target.probs,
                                            rows, loss.kind, loss.lk_eta)
        # soft cross-entropy = forward KL to the target distribution up to a constant
        elif impl == "reference":
            logits = draft.lm_head(draft.head_input(flat_h[anchors]))  # [N_k, Vd]
            loss_sum = F.cross_entropy(logits.float(), target.probs[rows], reduction="sum")
            predicted = logits.detach().argmax(-1)
        else:
            loss_sum, predicted = linear_soft_ce(draft.head_input(flat_h[anchors]), draft.lm_head.weight,
                                                 target.probs, rows, compiled=compiled_ce)
        loss_k = loss_sum / (b * t if loss.norm == "all" else max(n, 1))
        total = total + (loss_decay ** k) * loss_k
        with torch.no_grad():
            hits = draft_target_ids[predicted] == target.argmax[rows]  # draft argmax as target ids
            stats[0, k] = loss_k.detach()
            stats[1, k] = hits.sum()
            stats[2, k] = n
    return TTTResult(total, stats, logits_k)


def simulated_tau(acc_k: list[float]) -> float:
    """Offline proxy of the acceptance length: 1 + sum_k prod_{i<=k} acc_i."""
    tau, run = 1.0, 1.0
    for a in acc_k:
        run *= a
        tau += run
    return tau
