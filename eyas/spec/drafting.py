"""Drafting: a chain of k tokens, or an EAGLE-2 dynamic tree, from the draft model and its cache.

Both start from the draft's state after the committed tokens: its KV cache (entries 0..N-1, built
from the target's real features) and the hidden output and logits of its last entry, which predict
token N+1. A proposal is a `Proposal`: target token ids of the nodes, each node's parent (-1 = the
root, i.e. the last committed token N that the target has not seen yet) and depth, nodes ordered
so that parents come first and siblings by descending draft score. A chain is a tree whose nodes
each have one child.

Drafting appends entries to the draft cache; the engine rolls them back by slicing (the caller
keeps N and cuts the cache to N before rebuilding it from real features).
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


def draft_chain(draft, cache, hidden, logits, position: int, steps: int) -> tuple[Proposal, tuple]:
    """k greedy draft tokens. hidden [1,1,H] and logits [Vd] belong to the entry at position-1."""
    tokens = []
    for i in range(steps):
        tok = draft.to_target_ids(logits.argmax(-1, keepdim=True))  # [1]
        tokens.append(int(tok))
        if i == steps - 1:
            break
        out = draft(hidden, tok.view(1, 1), torch.tensor([[position + i]], device=tok.device), past_key_values=cache)
        hidden, logits, cache = out.hidden_out[:, -1:], out.logits[0, -1], out.past_key_values
    n = len(tokens)
    return Proposal(tokens, list(range(-1, n - 1)), list(range(1, n + 1)), n - 1), cache


def draft_tree(draft, cache, hidden, logits, position: int, topk: int, depth: int, total: int):
    """EAGLE-2 dynamic tree: expand the `topk` best nodes per level to `depth`, keep the `total`
    nodes of highest cumulative draft log-prob (a parent always scores at least its child, so the
    kept set is closed under ancestors; ties are broken by depth so that holds exactly).
    """
    device = logits.device
    past = cache[0].shape[2]
    logp = torch.log_softmax(logits.float(), dim=-1)  # [Vd]
    top = logp.topk(min(topk, logp.numel()))
    # candidate pool: (score, depth, creation index, parent pool index, draft id)
    pool_scores = top.values.tolist()
    pool_depth = [1] * len(pool_scores)
    pool_parent = [-1] * len(pool_scores)
    pool_ids = top.indices.tolist()
    frontier = list(range(len(pool_scores)))  # pool indices to expand next
    frontier_hidden = hidden.expand(1, len(frontier), hidden.shape[-1])  # [1, F, H]
    slot_of = {}  # pool index -> draft-cache slot (relative to past) of its expanded entry
    for d in range(1, depth):
        f = len(frontier)
        ids = draft.to_target_ids(torch.tensor(pool_ids, device=device)[frontier]).view(1, f)
        base = len(slot_of)
        mask = torch.zeros(f, past + base + f, dtype=torch.bool, device=device)
        mask[:, :past] = True
        for row, node in enumerate(frontier):
            a = pool_parent[node]
            while a >= 0:
                mask[row, past + slot_of[a]] = True
                a = pool_parent[a]
            mask[row, past + base + row] = True
        pos = torch.full((1, f), position + d - 1, device=device)
        out = draft(frontier_hidden, ids, pos, past_key_values=cache, attention_mask=mask[None, None])
        cache = out.past_key_values
        for row, node in enumerate(frontier):
            slot_of[node] = base + row
        child_logp = torch.log_softmax(out.logits[0].float(), dim=-1)  # [F, Vd]
        child = child_logp.topk(min(topk, child_logp.shape[-1]), dim=-1)
        parent_scores = torch.tensor([pool_scores[n] for n in frontier], device=device)
        cum = parent_scores[:, None] + child.values  # [F, topk]
        start = len(pool_scores)
        for row, node in enumerate(frontier):
            for j in range(cum.shape[1]):
                pool_scores.append(float(cum[row, j]))
                pool_depth.append(d + 1)
                pool_parent.append(node)
                pool_ids.append(int(child.indices[row, j]))
        if d == depth - 1:
            break
        best = cum.flatten().topk(min(topk, cum.numel())).indices.tolist()
        frontier = [start + i for i in best]
        rows = torch.tensor([i // cum.shape[1] for i in best], device=device)
        frontier_hidden = out.hidden_out[:, rows]  # each new frontier node's parent output
    order = sorted(range(len(pool_scores)), key=lambda i: (-pool_scores[i], pool_depth[i], i))[:total]
    order.sort(key=lambda i: (pool_depth[i], -pool_scores[i], i))  # parents first, siblings by score
    index = {p: i for i, p in enumerate(order)}
    target_ids = draft.to_target_ids(torch.tensor([pool_ids[p] for p in order], device=device)).tolist()
    parents = [index[pool_parent[p]] if pool_parent[p] >= 0 else -1 for p in order]
    assert all(p < i for i, p in enumerate(parents)), "tree nodes must follow their parents"
    return Proposal(target_ids, parents, [pool_depth[p] for p in order], len(slot_of)), cache
