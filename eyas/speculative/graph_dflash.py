"""DFlash chains on the static path: the draft's context buffers, the passes of a chain of k, made before capture.

The draft's context (each layer's keys and values of the committed tokens' fused features) lives in one fixed
store per layer, capacity C like the target's cache, written at device slots. Three passes per chain length k
and attended width, named as EAGLE-3's so that GraphDecoder._cycles drives both:

- `chain`: one draft forward over the block [pending, mask, ..., mask] at positions n..n + block_size - 1,
  attending to the context slots < n (the committed ones) and to the whole block; its k guesses are written
  after the pending token into the verify input;
- `verify`: the target over [pending, guesses] and the greedy acceptance on the device (EAGLE-3's pass);
- `rebuild`: the features of all k + 1 verified rows join the context at slots n..n + k, the bonus token
  (the target's argmax at row a) becomes the pending one, and n grows by a + 1. Rows after a belong to
  rejected guesses: they sit at slots >= the new n, which the next block does not see, and the next
  rebuild overwrites them. A fixed shape, as EAGLE-3's rebuild of all k + 1 rows.

The decoding these passes replay is eyas/speculative/engine.py's `_dflash` (the dynamic path); greedy only.
"""

from __future__ import annotations

import torch

from eyas.speculative.graph_modes import verify_chain
from eyas.speculative.graph_steps import _Reads


def context_stores(draft, capacity: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per draft layer, (keys, values) [1, kv_heads, C, head_dim] in the draft's dtype."""
    cfg = draft.cfg
    dtype = next(draft.parameters()).dtype
    shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]


def write_context(dec, aux: torch.Tensor, positions: torch.Tensor) -> None:
    """The fused features of aux [T, A*H] (the target's states at the draft's target layers) into every layer's
    context store at slots `positions` [T] (slot = position)."""
    draft = dec.draft
    new = draft.context_kv(draft.fuse(aux.to(dec.ddtype))[None], positions[None])
    for (k_store, v_store), (k, v) in zip(dec.dctx, new):
        k_store.index_copy_(2, positions, k)
        v_store.index_copy_(2, positions, v)


def dflash_buffers(dec, k: int) -> dict:
    """The passes of DFlash chains of k guesses: `chain`, `verify` and `rebuild` (see the module docstring)."""
    dev, draft = dec.device, dec.draft
    block = draft.cfg.block_size
    b = {"ids": torch.zeros(1, k + 1, dtype=torch.long, device=dev),  # [1, k + 1]: pending + guesses, verify's input
         "block": torch.full((1, block), draft.cfg.mask_token_id, dtype=torch.long, device=dev),  # the draft's input
         "offsets": torch.arange(block, device=dev),
         "own": torch.ones(block, block, dtype=torch.bool, device=dev),  # a block sees all of itself
         "best": torch.zeros(k + 1, dtype=torch.long, device=dev),  # [k + 1]: the target's argmax per row
         "aux": torch.zeros(k + 1, len(dec.runner.aux_layers) * dec.hidden_size, dtype=dec.dtype, device=dev),
         "read": torch.zeros(2 * k + 2, dtype=torch.long, device=dev),  # guesses, argmax, a: the host's read
         "rows": torch.arange(k + 1, device=dev),
         "reads": _Reads(2 * k + 2, dev)}
    dec.runner.attach()  # the verify pass needs the aux hooks while it is traced

    def chain():
        b["block"][0, :1].copy_(b["ids"][0, :1])
        width = dec.width
        seen = (dec.wcols < dec.n)[None, :].expand(block, width)  # [block, W]: committed context slots
        mask = torch.cat([seen, b["own"]], dim=1)[None, None]  # [1, 1, block, W + block]
        context = [(k_store[:, :, :width], v_store[:, :, :width]) for k_store, v_store in dec.dctx]
        hidden = draft(b["block"], (dec.n + b["offsets"])[None], context, mask)  # [1, block, H]
        b["ids"][0, 1:].copy_(draft.lm_head(hidden[0, 1:k + 1]).argmax(-1))

    def verify():
        verify_chain(dec, b, k)

    def rebuild():
        write_context(dec, b["aux"], dec.n + b["rows"])
        b["ids"][0, :1].copy_(b["best"].index_select(0, dec.a.view(1)))  # the bonus token anchors the next block
        dec.n.add_(dec.a + 1)

    b["passes"] = dec._capture({"chain": chain, "verify": verify, "rebuild": rebuild}, f"dflash chain-{k}")
    return b
