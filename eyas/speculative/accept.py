"""Acceptance of drafted tokens against the target's logits (docs/ALGORITHM.md section 4).

Rows of `logits` are the target's predictions after the root (row 0) and after each proposal node
(row i + 1 for node i). Walking down from the root:

- greedy: move to the child whose token is the target's argmax; when none matches, the target's
  argmax is the bonus token. The output is exactly the target's greedy output.
- sampling: the draft's tokens are deterministic proposals, so a child x is accepted with probability
  p(x) (the target's tempered distribution at the current node). On rejection p(x) is set to zero and
  p renormalised, and the next sibling is tried; when all are rejected, or the node has no children,
  the bonus token is sampled from what remains. Each emitted token then follows p exactly.
"""

from __future__ import annotations

import torch


def children_lists(parents: list[int]) -> list[list[int]]:
    """children[0] = children of the root; children[i + 1] = children of node i (in proposal order)."""
    children = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p + 1].append(i)
    return children


def accept_greedy(logits: torch.Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """-> (accepted node indices along the path, bonus token)."""
    return walk_greedy(logits.argmax(-1).tolist(), tokens, parents)  # one sync for all rows


def walk_greedy(best: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """accept_greedy on the target's argmax per row, already on the host."""
    children = children_lists(parents)
    path, row = [], 0
    while True:
        want = best[row]
        nxt = next((c for c in children[row] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        row = nxt + 1


def sample_node(probs: torch.Tensor, candidates: list[int], generator=None) -> tuple[int | None, int]:
    """One node of the sampling walk. probs [V] sums to 1; candidates are token ids in order.

    -> (index into candidates of the accepted one, token) or (None, token sampled from the residual).
    """
    p = probs.clone()
    for i, tok in enumerate(candidates):
        px = float(p[tok])
        if px > 0 and torch.rand((), generator=generator, device=p.device).item() < px:
            return i, tok
        p[tok] = 0.0
        total = float(p.sum())
        if total <= 0:  # the target puts all its mass on rejected tokens: cannot happen for px < 1
            break
        p /= total
    return None, int(torch.multinomial(p, 1, generator=generator))


def accept_sample(logits: torch.Tensor, tokens: list[int], parents: list[int], temperature: float,
                  generator=None) -> tuple[list[int], int]:
    children = children_lists(parents)
    path, row = [], 0
    while True:
        probs = torch.softmax(logits[row] / temperature, dim=-1)
        kids = children[row]
        i, tok = sample_node(probs, [tokens[c] for c in kids], generator)
        if i is None:
            return path, tok
        path.append(kids[i])
        row = kids[i] + 1


def sample_token(logits: torch.Tensor, temperature: float, generator=None, on_device: bool = False):
    """A token from one row of logits: argmax at temperature 0, else a tempered sample.
    -> int, or with on_device a [1] tensor left on the device (no sync)."""
    if temperature <= 0:
        tok = logits.argmax(-1, keepdim=True)
    else:
        tok = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)
    return tok if on_device else int(tok)
