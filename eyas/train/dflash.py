"""DFlash training on a hidden-state store (docs/ALGORITHM.md section 7): random anchor blocks, one forward.

For a batch of samples (input_ids, loss_mask, attention_mask [B, T], aux_hidden [B, T, A*H]):

1. anchors: positions a whose next token is a real assistant token (attention_mask[a + 1] and loss_mask[a + 1]),
   up to `anchors` per sample drawn uniformly without replacement, and at most block_tokens // block_size in the
   micro-batch (dflash.block_tokens, by default train.batch_tokens: the blocks then hold no more tokens than the
   batch's own budget);
2. each anchor's block is [ids[a], mask, ..., mask] at positions a .. a + block_size - 1; slot k (1 <= k < block_size)
   is trained to be ids[a + k], counted iff a + k is a real assistant token, with weight exp(-(k - 1) / gamma)
   (the loss is the weighted mean of the cross-entropies of counted slots);
3. attention: a block's queries see the context features at positions < a (what decoding has committed when the
   anchor is the pending token) and every slot of their own block; blocks never see each other.

Statistics per slot k (the loop's acc_k, k = 0 .. block_size - 2 for slots 1 .. block_size - 1): among the blocks
whose slots before k were all right (and counted), the share whose slot k is right, and the loss there. The product
of these conditional rates is the share of blocks accepted that far, so `simulated_tau` of them is the block's
mean acceptance length against the stored answers (one anchor, the target's own tokens).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eyas.common import EyasError, print0
from eyas.draft.dflash import DFlashConfig, DFlashDraft
from eyas.train.kernels import linear_weighted_ce
from eyas.train.ttt import TTTResult


def select_layers(aux: torch.Tensor, store_layers: list[int], wanted: list[int]) -> torch.Tensor:
    """aux [B, T, A*H] of the store's aux layers -> [B, T, len(wanted)*H] of the wanted ones, in wanted's order."""
    if list(store_layers) == list(wanted):
        return aux
    b, t, width = aux.shape
    h = width // len(store_layers)
    index = [list(store_layers).index(x) for x in wanted]
    return aux.view(b, t, len(store_layers), h)[:, :, index].reshape(b, t, len(wanted) * h)


def sample_anchors(loss_mask: torch.Tensor, attention_mask: torch.Tensor, per_sample: int, total: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> anchors [B, N] (int64, ascending within a row, padding rows repeat position 0) and keep [B, N] (bool)."""
    b, t = loss_mask.shape
    device = loss_mask.device
    valid = torch.zeros(b, t, dtype=torch.bool, device=device)
    if t >= 2:
        valid[:, :-1] = attention_mask[:, :-1] & attention_mask[:, 1:] & (loss_mask[:, 1:] > 0)
    scores = torch.rand(b, t, device=device, generator=generator)
    scores = torch.where(valid, scores, torch.full_like(scores, -1.0))
    n = max(1, min(per_sample, int(valid.sum(1).max())))
    top = scores.topk(n, dim=1)
    keep = top.values >= 0
    if int(keep.sum()) > total:  # the micro-batch's cap: keep the `total` best scores over all rows
        flat = torch.where(keep, top.values, torch.full_like(top.values, -1.0)).reshape(-1)
        cut = flat.topk(total).values[-1]
        keep = keep & (top.values >= cut)
    anchors = torch.where(keep, top.indices, torch.zeros_like(top.indices))
    order = torch.where(keep, anchors, torch.full_like(anchors, t)).argsort(dim=1)  # kept ones first, ascending
    width = max(1, int(keep.sum(1).max()))  # no row needs more columns than its kept anchors
    return anchors.gather(1, order)[:, :width], keep.gather(1, order)[:, :width]


def slot_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    """[block_size]: 0 for the anchor slot, exp(-(k - 1) / gamma) for slot k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1).clamp(min=0) / gamma), torch.zeros_like(k))


def training_mask(anchors: torch.Tensor, keep: torch.Tensor, t: int, block_size: int) -> torch.Tensor:
    """bool [B, 1, N*Bk, T + N*Bk]: a block's queries see context positions < its anchor (kept blocks only) and
    their own block (always, so no row is empty)."""
    b, n = anchors.shape
    device = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, N*Bk]
    q_keep = keep.repeat_interleave(block_size, dim=1)
    ctx = (torch.arange(t, device=device)[None, None, :] < q_anchor[:, :, None]) & q_keep[:, :, None]  # [B, Q, T]
    block_of = torch.arange(n * block_size, device=device) // block_size
    own = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)  # [B, Q, Q]
    return torch.cat([ctx, own], dim=2)[:, None]


def blocks_per_micro_batch(block_tokens: int, block_size: int) -> int:
    """The most blocks one micro-batch draws: as many as block_tokens query tokens hold, and at least one."""
    return max(1, block_tokens // block_size)


def dflash_forward(draft: DFlashDraft, batch: dict, store_layers: list[int], *, gamma: float, anchors: int,
                   block_tokens: int) -> TTTResult:
    cfg = draft.cfg
    bk = cfg.block_size
    ids, attn, lmask = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"]
    b, t = ids.shape
    device = ids.device
    anchor, keep = sample_anchors(lmask, attn, anchors, blocks_per_micro_batch(block_tokens, bk))  # [B, N]
    n = anchor.shape[1]
    offsets = torch.arange(bk, device=device)
    pos = anchor[:, :, None] + offsets  # [B, N, Bk]
    inside = pos < t
    at = pos.clamp(max=t - 1)
    labels = ids.gather(1, at.reshape(b, -1)).view(b, n, bk)
    real = attn.gather(1, at.reshape(b, -1)).view(b, n, bk) & inside
    assistant = lmask.gather(1, at.reshape(b, -1)).view(b, n, bk) > 0
    counted = keep[:, :, None] & real & assistant & (offsets > 0)  # [B, N, Bk]
    block_ids = torch.full((b, n, bk), cfg.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = ids.gather(1, anchor)

    ctx = draft.fuse(select_layers(batch["aux_hidden"], store_layers, cfg.target_layers))  # [B, T, H]
    ctx_kv = draft.context_kv(ctx, torch.arange(t, device=device)[None].expand(b, t))
    mask = training_mask(anchor, keep, t, bk)
    hidden = draft(block_ids.view(b, n * bk), pos.view(b, n * bk), ctx_kv, mask).view(b, n, bk, -1)

    rows = counted.nonzero(as_tuple=True)
    slot = rows[2]  # [M] slot index k >= 1 of each counted position
    weight = slot_weights(bk, gamma, device)[slot]
    head = draft.lm_head
    if isinstance(head, nn.Linear) and head.bias is None:  # the target's lm_head: chunked, no [M, V] logits
        loss_sum, ce, predicted = linear_weighted_ce(hidden[rows], head.weight, labels[rows], weight)
    else:  # any other head (tests swap in their own)
        logits = head(hidden[rows])  # [M, V]
        ce = F.cross_entropy(logits.float(), labels[rows], reduction="none")  # [M]
        loss_sum, predicted = (ce * weight).sum(), logits.argmax(-1)
    loss = loss_sum / weight.sum().clamp(min=1e-6)
    if not rows[0].numel():
        loss = hidden.sum() * 0.0  # no counted slot: a zero that still reaches every parameter

    with torch.no_grad():
        right = torch.zeros(b, n, bk, dtype=torch.bool, device=device)
        right[rows] = predicted == labels[rows]
        ce_full = torch.zeros(b, n, bk, dtype=torch.float64, device=device)
        ce_full[rows] = ce.detach().double()
        # the block reaches slot k iff every slot 1..k-1 was counted and right
        ok = (right & counted)[:, :, 1:]  # [B, N, Bk-1]
        reached = torch.cat([keep[:, :, None], ok[:, :, :-1]], dim=2).long().cumprod(dim=2).bool()
        tried = reached & counted[:, :, 1:]
        stats = torch.stack([(ce_full[:, :, 1:] * tried).sum((0, 1)),
                             (tried & ok).sum((0, 1)).double(), tried.sum((0, 1)).double()])  # [3, Bk-1]
        stats[0] = stats[0] / stats[2].clamp(min=1)
    return TTTResult(loss=loss, stats=stats)


class DFlashModule(nn.Module):
    """The DFlash draft plus its loss as one module, so DDP/FSDP see one forward per micro-batch."""

    def __init__(self, draft: DFlashDraft, store_layers: list[int], gamma: float, anchors: int, block_tokens: int):
        super().__init__()
        self.draft = draft
        self.store_layers, self.gamma, self.anchors, self.block_tokens = list(store_layers), gamma, anchors, block_tokens

    def forward(self, batch: dict, lm_head_weight: torch.Tensor | None = None) -> TTTResult:
        return dflash_forward(self.draft, batch, self.store_layers, gamma=self.gamma, anchors=self.anchors,
                              block_tokens=self.block_tokens)


def loss_decay(gamma: float) -> float:
    """The per-slot factor exp(-1 / gamma): the loop's logged `loss` is then sum_k decay^k loss_k, the slot weights."""
    return math.exp(-1.0 / gamma)


def resolve_mask_token(dcfg, target_config: dict, vocab_size: int) -> int:
    """dflash.mask_token_id, or (-1) the target's pad token, else its (first) eos token, else 0."""
    if dcfg.mask_token_id >= 0:
        token = dcfg.mask_token_id
    else:
        token = target_config.get("pad_token_id")
        if token is None:
            eos = target_config.get("eos_token_id")
            token = (eos[0] if isinstance(eos, list) and eos else eos) if eos is not None else 0
    if not 0 <= int(token) < vocab_size:
        raise EyasError(f"dflash.mask_token_id={token} is outside the target's vocabulary 0..{vocab_size - 1}; "
                        f"set dflash.mask_token_id to a token id of the target")
    return int(token)


def dflash_config(source, dcfg, rope: str = "target") -> DFlashConfig:
    """The config of a new DFlash draft for this source: the target's shape, the fused layers (dflash.target_layers,
    or all the store's aux layers), the block, the mask token and the rotary embedding of train.rope."""
    layers = list(dcfg.target_layers) or list(source.aux_layers)
    missing = [x for x in layers if x not in source.aux_layers]
    if missing:
        want = sorted(set(source.aux_layers) | set(layers))
        raise EyasError(f"dflash.target_layers={layers}: the store holds aux layers {list(source.aux_layers)}, not "
                        f"{missing}; capture them (`eyas capture --layers {','.join(map(str, want))}`) or choose "
                        f"among the store's")
    vocab, hidden = source.embed_weight.shape
    try:
        return DFlashConfig.from_target_config(source.target_config, layers,
                                               resolve_mask_token(dcfg, source.target_config, vocab),
                                               num_layers=dcfg.layers, block_size=dcfg.block_size, rope=rope)
    except ValueError as e:  # the target's config asks for a draft eyas cannot build: the message names the fix
        raise EyasError(f"the DFlash draft for this store's target: {e}") from None


def build_dflash_draft(source, dcfg, init_from: str = "", rope: str = "target") -> DFlashDraft:
    """A new DFlash draft (or train.init_from's, which must have the same config) holding the target's frozen
    embedding and lm_head."""
    cfg = dflash_config(source, dcfg, rope)
    draft = DFlashDraft(cfg)
    if init_from:
        from eyas.formats import load_draft

        old, meta = load_draft(init_from, embed_tokens=source.embed_weight, lm_head=source.lm_head_weight)
        if meta.get("method") != "dflash":
            raise EyasError(f"train.init_from={init_from} is not a DFlash draft; with train.method=dflash fine-tune one")
        if old.cfg.to_dict() != cfg.to_dict():
            raise EyasError(f"train.init_from={init_from}: its DFlash config {old.cfg.to_dict()} differs from this "
                            f"run's {cfg.to_dict()}; set the dflash section as it was trained")
        draft.load_state_dict(old.state_dict())
        print0(f"fine-tuning the DFlash draft of {init_from} (train.init_from): a fresh optimizer and schedule")
    draft.embed_tokens.weight.data.copy_(source.embed_weight.float())
    draft.lm_head.weight.data.copy_(source.lm_head_weight.float())
    return draft.train()


def dflash_train_config(tc, dcfg):
    """The train section as the loop reads it for DFlash: K = block_size - 1 positions, their logged loss
    weighted exp(-(k - 1) / gamma), the learning rate dflash.lr where it is set."""
    import dataclasses

    return dataclasses.replace(tc, ttt=dcfg.block_size - 1, loss_decay=loss_decay(dcfg.gamma), lr=dcfg.lr or tc.lr)
