"""Drafting: a chain of k tokens, or an EAGLE-2 dynamic tree, from the draft model and its cache.

Both start from the draft's state after the committed tokens: its KV cache (entries 0..N-1, built
from the target's real features) and the hidden output and logits of its last entry, which predict
token N+1. A chain stays on the device: its k tokens come back as one tensor and the engine reads
them to the host together with the target's verdict, in the cycle's single sync. A tree is a
`Proposal`: target token ids of the nodes, each node's parent (-1 = the root, i.e. the last
committed token N that the target has not seen yet) and depth, nodes ordered so that parents come
first and siblings by descending draft score; building it reads each level's top-k to the host once.

Drafting appends entries to the draft cache (an Eagle3Draft's DraftCache writes them in place into
preallocated storage); the engine rolls them back by length with `crop_cache` (the caller keeps N and
cuts the cache to N before rebuilding it from real features; nothing is copied). Drafts with the old
interface, whose cache is a (k, v) tuple, are cut by slicing. `positions` is a view of
a device buffer of position ids ([1, n], starting at N), so no step copies an index to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: list[int]  # target ids, one per node
    parents: list[int]  # index of the parent node, -1 = root
    depths: list[int]  # 1 for children of the root
    num_fed: int = 0  # tokens the draft was fed to build it

    def __len__(self) -> int:
        return len(self.tokens)


def cache_length(cache) -> int:
    """Entries in a draft cache: a DraftCache (its length) or a (k, v) tuple [B, nkv, S, d]."""
    length = getattr(cache, "length", None)
    return cache[0].shape[2] if length is None else length


def crop_cache(cache, n: int):
    """The draft cache cut back to its first n entries: by length for a DraftCache, by slicing a tuple."""
    crop = getattr(cache, "crop", None)
    return (cache[0][:, :, :n], cache[1][:, :, :n]) if crop is None else crop(n)


def draft_chain(draft, cache, hidden, logits, positions, steps: int) -> tuple[torch.Tensor, object, int]:
    """k greedy draft tokens. hidden [1,1,H] and logits [Vd] belong to the entry at position N-1;
    positions [1, >= k-1] holds N, N+1, ... -> (target ids [k] on the device, cache, tokens fed)."""
    tokens = []
    for i in range(steps):
        tok = draft.to_target_ids(logits.argmax(-1, keepdim=True))  # [1]
        tokens.append(tok)
        if i == steps - 1:
            break
        out = draft(hidden, tok.view(1, 1), positions[:, i:i + 1], past_key_values=cache)
        hidden, logits, cache = out.hidden_out[:, -1:], out.logits[0, -1], out.past_key_values
    return torch.cat(tokens), cache, steps - 1


def _frontier_mask(frontier, pool_parent, slot_of, past: int, base: int, device) -> torch.Tensor:
    """[F, past + base + F]: each frontier node sees the committed past, its expanded ancestors, itself.
    Built on the host and copied once (per-element writes on the device would each be a kernel)."""
    f = len(frontier)
    mask = torch.zeros(f, past + base + f, dtype=torch.bool)
    mask[:, :past] = True
    for row, node in enumerate(frontier):
        a = pool_parent[node]
        while a >= 0:
            mask[row, past + slot_of[a]] = True
            a = pool_parent[a]
        mask[row, past + base + row] = True
    return mask.to(device)


@dataclass
class Pool:
    """Every candidate node a tree drafting scored, in creation order (level by level)."""
    scores: list[float]  # cumulative draft log-prob
    depths: list[int]  # 1 for children of the root
    parents: list[int]  # pool index of the parent, -1 = root
    ids: list[int]  # draft vocabulary ids
    num_fed: int = 0  # tokens the draft was fed to score them
    # the last expanded level: its pool indices, their hidden outputs [1, F, H] (the input of their children)
    # and every expanded node's draft-cache slot after the committed ones; None for a depth of 1
    last: tuple[list[int], torch.Tensor, dict[int, int]] | None = None


def draft_tree(draft, cache, hidden, logits, positions, topk: int, depth: int, total: int, d2t: list[int] | None = None):
    """EAGLE-2 dynamic tree: expand the `topk` best nodes per level to `depth`, keep the `total`
    nodes of highest cumulative draft log-prob (a parent always scores at least its child, so the
    kept set is closed under ancestors; ties are broken by depth so that holds exactly).
    positions [1, >= depth-1] holds N, N+1, ...; one device-to-host read per level. `d2t` is the
    draft's offset table as a host list (read once per generation), None for an identity vocabulary.
    """
    pool, cache = tree_pool(draft, cache, hidden, logits, positions, topk, depth)
    return select_tree(pool, total, d2t), cache


def select_tree(pool: Pool, total: int, d2t: list[int] | None = None) -> Proposal:
    """The `total` nodes of highest score (ties to the shallower), parents first, as a Proposal."""
    depths, order = pool.depths, kept_order(pool, total)
    index = {p: i for i, p in enumerate(order)}
    target_ids = [pool.ids[p] + (d2t[pool.ids[p]] if d2t else 0) for p in order]
    parents = [index[pool.parents[p]] if pool.parents[p] >= 0 else -1 for p in order]
    assert all(p < i for i, p in enumerate(parents)), "tree nodes must follow their parents"
    return Proposal(target_ids, parents, [depths[p] for p in order], pool.num_fed)


def kept_order(pool: Pool, total: int) -> list[int]:
    """Pool indices of the `total` nodes of highest score (ties to the shallower), in the Proposal's order:
    parents first, siblings by score."""
    scores, depths = pool.scores, pool.depths
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[:total]
    return sorted(order, key=lambda i: (depths[i], -scores[i], i))


def tree_pool(draft, cache, hidden, logits, positions, topk: int, depth: int) -> tuple[Pool, object]:
    """The candidates of `draft_tree`: the root's `topk` best draft tokens, then per level the `topk`
    children of each of the `topk` best nodes of the level before. -> (pool, cache)."""
    device = logits.device
    past = cache_length(cache)
    logp = torch.log_softmax(logits.float(), dim=-1)  # [Vd]
    top = logp.topk(min(topk, logp.numel()))
    # candidate pool, indexed by creation order: score, depth, parent pool index, draft id
    pool_scores, pool_ids = torch.stack([top.values, top.indices.to(top.values.dtype)]).tolist()
    pool_ids = [int(i) for i in pool_ids]
    pool_depth = [1] * len(pool_scores)
    pool_parent = [-1] * len(pool_scores)
    frontier = list(range(len(pool_scores)))  # pool indices to expand next
    frontier_ids = top.indices  # [F] draft ids of the frontier, on the device
    frontier_scores = top.values  # [F] their cumulative log-probs, on the device
    frontier_hidden = hidden.expand(1, len(frontier), hidden.shape[-1])  # [1, F, H]
    slot_of = {}  # pool index -> draft-cache slot (relative to past) of its expanded entry
    for d in range(1, depth):
        f = len(frontier)
        ids = draft.to_target_ids(frontier_ids).view(1, f)
        base = len(slot_of)
        mask = _frontier_mask(frontier, pool_parent, slot_of, past, base, device)
        pos = positions[:, d - 1:d].expand(1, f)
        out = draft(frontier_hidden, ids, pos, past_key_values=cache, attention_mask=mask[None, None])
        cache = out.past_key_values
        for row, node in enumerate(frontier):
            slot_of[node] = base + row
        child_logp = torch.log_softmax(out.logits[0].float(), dim=-1)  # [F, Vd]
        k = min(topk, child_logp.shape[-1])
        child = child_logp.topk(k, dim=-1)
        cum = frontier_scores[:, None] + child.values  # [F, k]
        best = cum.flatten().topk(min(topk, cum.numel())).indices if d < depth - 1 else None
        # one read per level: scores, child ids and (but for the last level) the next frontier
        host = torch.cat([cum.flatten().double(), child.indices.flatten().double()]
                         + ([best.double()] if best is not None else [])).tolist()
        n = f * k
        scores, kids = host[:n], host[n:2 * n]
        start = len(pool_scores)
        for i in range(n):
            pool_scores.append(scores[i])
            pool_depth.append(d + 1)
            pool_parent.append(frontier[i // k])
            pool_ids.append(int(kids[i]))
        if best is None:
            break
        chosen = [int(i) for i in host[2 * n:]]
        frontier = [start + i for i in chosen]
        frontier_ids = child.indices.flatten()[best]
        frontier_scores = cum.flatten()[best]
        frontier_hidden = out.hidden_out[:, best // k]  # each new frontier node's parent output
    last = (frontier, out.hidden_out, slot_of) if depth > 1 else None  # references: nothing is copied
    return Pool(pool_scores, pool_depth, pool_parent, pool_ids, len(slot_of), last), cache
