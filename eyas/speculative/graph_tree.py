"""EAGLE-2's dynamic trees on the static path (the rules of drafting.draft_tree), with fixed shapes.

Trees have the chain's three graphs (graph_modes.py) with fixed shapes: every level feeds its top-k
nodes, the candidates are ranked on the device (by counting, not with a sort), and the verify graph
walks the greedy path itself and moves its entries into place, so a tree cycle reads the device once,
like a chain's.

`tree`: `depth` levels of drafting; each level after the first feeds its `topk` best nodes (by
cumulative draft log-prob) at draft slots n + (level - 1) * topk + row, each seeing the committed
slots, its expanded ancestors and itself. The `total` best of all candidates (a parent always
scores at least as well as its child, and ties go to the earlier candidate, so the set is closed
under ancestors) are ordered parents first, siblings by score. `verify`: the target over the
pending token and the nodes at slots n.. (positions n + depth) with the ancestor mask; the greedy
path is walked on the device (a node is accepted when its token is the target's argmax at its
parent and its parent is accepted) and its depth + 1 entries are moved to slots n..n + depth.
`rebuild` is the chain's, over depth + 1 rows.

As in graph_modes.py, each function takes the GraphDecoder `dec` (graphs.py) whose state the passes use.
"""

from __future__ import annotations

import torch

from eyas.speculative.graph_modes import rebuild_draft
from eyas.speculative.graph_steps import _Reads


def _stable_order(keys: torch.Tensor) -> torch.Tensor:
    """Indices that sort keys [n] ascending, ties in index order: a stable argsort by counting, for the
    small n of a tree (a few hundred). Element-wise work only, so it can be captured in a CUDA graph
    (CUB's stable sorts cannot always be)."""
    idx = torch.arange(keys.numel(), device=keys.device)
    before = (keys[None, :] < keys[:, None]) | ((keys[None, :] == keys[:, None]) & (idx[None, :] < idx[:, None]))
    rank = before.sum(1)  # [n]: a permutation of 0..n-1
    return torch.empty_like(idx).scatter_(0, rank, idx)


def _tree_mask(n: torch.Tensor, local: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[T, W] over the slots `cols` [W]: every committed slot (< n), plus the slots n + j for which
    local [T, L] is True."""
    width = local.shape[1]
    rel = cols - n  # [W]: slot relative to the committed length
    inside = (rel >= 0) & (rel < width)
    return (rel < 0)[None, :] | (local[:, rel.clamp(0, width - 1)] & inside[None, :])


def tree_buffers(dec, topk: int, depth: int, total: int) -> dict:
    """The passes of trees (topk, depth, total): `tree`, `verify` and `rebuild` (see the module docstring)."""
    dev, vocab = dec.device, dec.dlogits.shape[0]
    if topk > vocab:
        raise ValueError(f"tree top-k {topk} exceeds the draft vocabulary ({vocab})")
    m = min(total, topk + (depth - 1) * topk * topk)  # nodes verified: at most the candidates drafted
    b = {"ids": torch.zeros(1, m + 1, dtype=torch.long, device=dev),  # [1, m + 1]: pending + nodes, verify's input
         "depths": torch.zeros(m + 1, dtype=torch.long, device=dev),  # [m + 1]: 0 for the pending token
         "parents": torch.zeros(m + 1, dtype=torch.long, device=dev),  # [m + 1]: row of each row's parent (root: 0)
         "anc": torch.zeros(m + 1, m + 1, dtype=torch.bool, device=dev),  # row sees row (ancestors, itself)
         "rows": torch.arange(m + 1, device=dev),  # [m + 1]
         "best": torch.zeros(depth + 1, dtype=torch.long, device=dev),  # the target's argmax along the path
         "aux": torch.zeros(depth + 1, len(dec.runner.aux_layers) * dec.hidden_size, dtype=dec.dtype,
                            device=dev),  # [depth + 1, A*H]
         "read": torch.zeros(depth + 3, dtype=torch.long, device=dev),  # best along the path, a, tree depth
         "reads": _Reads(depth + 3, dev), "size": m}
    dec.runner.attach()  # the verify pass needs the aux hooks while it is traced
    eye = torch.eye(topk, dtype=torch.bool, device=dev)  # [topk, topk]

    def tree():
        scores, ids, levels, parents = _draft_levels(dec, topk, depth, eye)
        _order_nodes(dec, b, depth, scores, ids, levels, parents)

    def verify():
        _verify_tree(dec, b, depth)

    def rebuild():
        rebuild_draft(dec, b)

    name = f"tree {topk},{depth},{total}"
    b["passes"] = dec._capture({"tree": dec._compiled(tree, name), "verify": verify,
                                "rebuild": dec._compiled(rebuild, f"{name} rebuild")}, name)
    return b


def _draft_levels(dec, topk: int, depth: int, eye: torch.Tensor):
    """The `depth` levels of drafting -> (scores, ids, levels, parents), each [pool] over every candidate
    drafted, level by level (parents: the candidate's parent's index in them, -1 for the first level)."""
    dev = dec.device
    width = (depth - 1) * topk  # draft slots the expanded levels take
    top = torch.log_softmax(dec.dlogits.float(), dim=-1).topk(topk)
    scores, ids, levels, parents = [top.values], [top.indices], [torch.ones_like(top.indices)], \
        [torch.full_like(top.indices, -1)]
    front, front_ids, front_scores = torch.arange(topk, device=dev), top.indices, top.values
    front_hidden = dec.hidden.expand(1, topk, dec.hidden.shape[-1])
    front_anc = torch.zeros(topk, width, dtype=torch.bool, device=dev)  # expanded ancestors' draft slots
    start = topk
    for d in range(1, depth):
        seen = front_anc.clone()
        seen[:, (d - 1) * topk:d * topk] |= eye  # each frontier node sees its own new slot
        slots = dec.n + (d - 1) * topk + dec.cols[:topk]
        out = dec._draft(front_hidden, dec.draft.to_target_ids(front_ids).view(1, topk),
                         (dec.n + (d - 1)).expand(topk), slots=slots, mask=_tree_mask(dec.n, seen, dec.dcols))
        child = torch.log_softmax(out.logits[0].float(), dim=-1).topk(topk, dim=-1)  # [topk, topk]
        cum = (front_scores[:, None] + child.values).flatten()
        kids = child.indices.flatten()
        scores.append(cum)
        ids.append(kids)
        levels.append(torch.full_like(kids, d + 1))
        parents.append(front[:, None].expand(topk, topk).flatten())
        if d < depth - 1:
            best = cum.topk(topk).indices
            front, front_ids, front_scores = start + best, kids[best], cum[best]
            front_hidden = out.hidden_out[:, best // topk]
            front_anc = seen[best // topk]
        start += topk * topk
    return tuple(torch.cat(x) for x in (scores, ids, levels, parents))


def _order_nodes(dec, b: dict, depth: int, scores, ids, levels, parents) -> None:
    """The m best candidates by score (ties: the earlier, i.e. shallower, candidate), parents first, into
    the verify input: their tokens, depths, parent rows and ancestor mask."""
    dev, m, pool = dec.device, b["size"], scores.shape[0]
    chosen = _stable_order(-scores)[:m]
    order = chosen[_stable_order(levels[chosen])]
    row_of = torch.zeros(pool, dtype=torch.long, device=dev).scatter_(0, order, dec.cols[1:m + 1])  # [pool]
    par = parents[order]  # pool indices; row_of maps them to verify rows (1..m)
    b["parents"][1:].copy_(torch.where(par >= 0, row_of[par.clamp(min=0)], 0))
    b["ids"][0, 1:].copy_(dec.draft.to_target_ids(ids[order]))
    b["depths"][1:].copy_(levels[order])
    anc = torch.eye(m + 1, dtype=torch.bool, device=dev)  # [m + 1, m + 1]
    up = b["rows"]
    for _ in range(depth):
        up = b["parents"][up]
        anc.scatter_(1, up[:, None], True)
    b["anc"].copy_(anc)


def _verify_tree(dec, b: dict, depth: int) -> None:
    """The target over the tree; the greedy path walked on the device and its entries moved to slots
    n..n + depth; the host's read: the target's argmax along the path, a and the tree's depth."""
    logits, aux = dec._target(b["ids"], dec.n + b["depths"], aux=True, slots=dec.n + b["rows"],
                              mask=_tree_mask(dec.n, b["anc"], dec.wcols))
    best = logits.argmax(-1)  # [m + 1]
    match = (b["ids"][0] == best[b["parents"]]) | (b["rows"] == 0)
    accepted = match
    for _ in range(depth):
        accepted = match & accepted[b["parents"]]
    # the deepest accepted node (one per depth), kept a 1-element tensor: indexing with a 0-dim tensor
    # reads it on the host, which a CUDA graph capture refuses
    node = torch.where(accepted, b["depths"], -1).argmax().view(1)
    dec.a.copy_(b["depths"].index_select(0, node).view(()))
    path = node.expand(depth + 2).clone()  # rows along the path by depth; later entries repeat the node
    path.scatter_(0, torch.where(b["anc"].index_select(0, node)[0], b["depths"], depth + 1), b["rows"])
    path = path[:depth + 1]
    slots, dest = dec.n + path, dec.n + dec.cols[:depth + 1]
    for store in (dec.cache.keys, dec.cache.values):  # the path's entries move to slots n..n + depth
        store.index_copy_(3, dest, store.index_select(3, slots))
    b["best"].copy_(best[path])
    b["aux"].copy_(aux[path])
    b["read"][:depth + 1].copy_(b["best"])
    b["read"][depth + 1:depth + 2].copy_(dec.a.view(1))
    b["read"][depth + 2:].copy_(b["depths"].max().view(1))
