"""Plain decoding and EAGLE-3 chains on the static path: their buffers, made before capture, and their passes.

Three graphs per chain length k and attended width: `chain` (k draft tokens from the draft's last
state), `verify` (the target over the pending token and the k drafted ones, then the greedy acceptance
on the device: a = how many leading drafts equal the target's argmax) and `rebuild` (the draft fed the
real aux states of the k + 1 verified positions; its state is taken at row a). Rebuilding all k + 1
rows, not just the a + 1 kept ones, keeps the shape fixed: rows after a see only their past (causal),
and their cache slots are overwritten before any later query can see them. Plain decoding is one graph
per token.

Each function takes the GraphDecoder `dec` (graphs.py) whose caches, device scalars (n, a) and passes
(`_target`, `_draft`) the passes use; the buffers come back as a dict whose "passes" are
{width: {name: _Step}}.
"""

from __future__ import annotations

import torch

from eyas.speculative.graph_steps import _Reads


def plain_buffers(dec) -> dict:
    """The plain step: the target over the last token at slot n, its argmax the next token."""
    b = {"ids": torch.zeros(1, 1, dtype=torch.long, device=dec.device), "reads": _Reads(1, dec.device)}  # [1, 1]
    dec.n.zero_()

    def step():
        logits, _ = dec._target(b["ids"], dec.n.view(1), aux=False)
        b["ids"].copy_(logits.argmax(-1).view(1, 1))
        dec.n.add_(1)

    b["passes"] = dec._capture({"step": step}, "plain")
    return b


def rebuild_draft(dec, b: dict) -> None:
    """The draft fed the real aux states b["aux"] [W, A*H] of the kept positions n.. with the target's
    argmax b["best"] [W] as next tokens; its state is taken at row a, and n grows by a + 1. All W rows
    are fed (a fixed shape): rows after a see only their past, and their slots are overwritten before
    any later query can see them."""
    rows = b["best"].shape[0]
    fused = dec.draft.fuse(b["aux"].to(dec.ddtype))[None]  # [1, W, H]
    out = dec._draft(fused, b["best"].view(1, -1), dec.n + dec.cols[:rows])
    row = dec.a.view(1)
    dec.hidden.copy_(out.hidden_out.index_select(1, row))
    dec.dlogits.copy_(out.logits[0].index_select(0, row)[0])
    b["ids"][0, :1].copy_(b["best"].index_select(0, row))  # the bonus token is the next pending one
    dec.n.add_(dec.a + 1)


def verify_chain(dec, b: dict, k: int) -> None:
    """The target over b["ids"] (the pending token and k drafted ones) at n..n + k, then the greedy acceptance
    on the device: a = how many leading drafts equal the target's argmax; the argmax rows and aux states are
    kept for the rebuild, and drafts, argmax and a go to b["read"] for the host (EAGLE-3 and DFlash chains)."""
    logits, aux = dec._target(b["ids"], dec.n + b["rows"], aux=True)
    best = logits.argmax(-1)  # [k + 1]
    drafted = b["ids"][0, 1:]
    dec.a.copy_((drafted == best[:k]).long().cumprod(0).sum())
    b["best"].copy_(best)
    b["aux"].copy_(aux)
    b["read"][:k].copy_(drafted)
    b["read"][k:2 * k + 1].copy_(best)
    b["read"][2 * k + 1:].copy_(dec.a.view(1))


def chain_buffers(dec, k: int) -> dict:
    """The passes of chains of k: `chain`, `verify` and `rebuild` (see the module docstring)."""
    dev = dec.device
    b = {"ids": torch.zeros(1, k + 1, dtype=torch.long, device=dev),  # [1, k + 1]: pending + drafted, verify's input
         "best": torch.zeros(k + 1, dtype=torch.long, device=dev),  # [k + 1]: the target's argmax per row
         "aux": torch.zeros(k + 1, len(dec.runner.aux_layers) * dec.hidden_size, dtype=dec.dtype, device=dev),
         "read": torch.zeros(2 * k + 2, dtype=torch.long, device=dev),  # drafted, argmax, a: the host's read
         "rows": torch.arange(k + 1, device=dev),  # [k + 1]
         "reads": _Reads(2 * k + 2, dev)}  # pinned once per decoder, not per generation
    dec.runner.attach()  # the verify pass needs the aux hooks while it is traced

    def chain():
        hidden, logits = dec.hidden, dec.dlogits
        for i in range(k):
            tok = dec.draft.to_target_ids(logits.argmax(-1, keepdim=True))  # [1]
            b["ids"][0, i + 1:i + 2].copy_(tok)
            if i == k - 1:
                break
            out = dec._draft(hidden, tok.view(1, 1), (dec.n + i).view(1))
            hidden, logits = out.hidden_out[:, -1:], out.logits[0, -1]

    def verify():
        verify_chain(dec, b, k)

    def rebuild():
        rebuild_draft(dec, b)

    b["passes"] = dec._capture({"chain": dec._compiled(chain, f"chain-{k}"), "verify": verify,
                                "rebuild": dec._compiled(rebuild, f"chain-{k} rebuild")}, f"chain-{k}")
    return b
