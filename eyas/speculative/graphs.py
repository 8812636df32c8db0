"""Greedy decoding with fixed shapes, replayed as CUDA graphs: plain decoding and EAGLE-3 chains.

Eagerly, a small target is bound by the host: each of SmolLM2's 30 layers is a dozen kernel launches
and each launch some microseconds of Python and driver work, so a forward costs far more on the host
than on the GPU. A CUDA graph records the launches once and replays them with one call. A graph fixes
every shape and every address, so in this path everything has one:

- the target's KV cache has a fixed capacity C; a forward writes its T entries at the slots named by a
  device tensor (slot = position) and attends over the first W slots with the mask `slot <= position`,
  W the attended width: every pass is captured once per width (multiples of WIDTH_STEP up to C) and the
  host replays the narrowest one that holds every slot the pass can touch (a 37-query attention over
  1,024 slots costs 29 us on an H200, over 256 slots 17.5 us: docs/PERFORMANCE.md, ninth session);
- the committed length n and the last cycle's accepted count a live in device scalars; the graphs
  update them themselves (n += a + 1), so the host never has to wait for the device to go on;
- the draft's cache works the same way (fixed storage, writes at device slots, masks over W slots);
- results land in buffers allocated before capture, never in a graph's private pool (whose memory a
  replay reuses), and reach the host through pinned memory and an event per read, one cycle late: the
  host queues cycle c + 1 before it reads cycle c, so the GPU does not idle while the host decides.

Three graphs per chain length k and attended width: `chain` (k draft tokens from the draft's last
state), `verify` (the target over the pending token and the k drafted ones, then the greedy acceptance
on the device: a = how many leading drafts equal the target's argmax) and `rebuild` (the draft fed the
real aux states of the k + 1 verified positions; its state is taken at row a). Rebuilding all k + 1
rows, not just the a + 1 kept ones, keeps the shape fixed: rows after a see only their past (causal),
and their cache slots are overwritten before any later query can see them. Plain decoding is one graph
per token.

The host keeps an upper bound of the device's n and never queues a pass that could write past C.
Cycles queued after the end of the text (one at most, or two plain steps) are dropped unread; their
time counts in `total_s`, as it does for a serving engine that runs ahead.

The prefill has a fixed shape too: the prompt is padded to a multiple of PREFILL_STEP tokens (at most C)
and one graph per padded length fills both caches and picks the first token at row n - 1. The padding's
entries lie after the committed length, where every pass masks a slot until it has written it (as it does
a rejected draft's), so they are never seen; eagerly, every new prompt length would be a new shape (SDPA's
cuDNN backend builds a plan per shape: 87 ms for a new length on an H200 against 27 ms for a known one,
docs/PERFORMANCE.md, tenth session).

Trees (EAGLE-2's dynamic tree, the rules of drafting.draft_tree) have the same three graphs with fixed
shapes: every level feeds its top-k nodes, the candidates are ranked on the device (by counting, not
with a sort), and the verify graph walks the greedy path itself and moves its entries into place (see
`_tree_buffers`), so a tree cycle reads the device once, like a chain's.

With compile_draft (`eyas eval --compile-draft`, on in the full preset), the draft-side passes (a chain's or a
tree's drafting with its ranking and masks, a rebuild) are compiled whole by torch.compile with static sizes
before their graphs are captured: the draft then attends over the whole capacity (its masks hide what it may
not see), so a pass has one shape at every attended width and compiles once. Fused, a tree 16,4,48's draft
phase costs 0.55 ms instead of 1.01 on an H200 (docs/PERFORMANCE.md, thirteenth session).

On a CPU, or with graphs off, the same functions run eagerly (same buffers, same order), which is
how the tests check this path against the dynamic engine without a GPU. Greedy only: sampling uses
the dynamic engine.
"""

from __future__ import annotations

import time

import torch

from eyas.common import EyasError, capture_cuda_graph
from eyas.draft.cache import DraftCache
from eyas.draft.model import DraftOutput
from eyas.speculative.target import KVCache, TargetRunner, cache_geometry, varying_shape_attention


WIDTH_STEP = 256  # attended widths are the multiples of this up to the capacity (and the capacity)
PREFILL_STEP = 64  # prompts are padded to a multiple of this for a graphed prefill; 0: eager, exact length
RECOMPILE_LIMIT = 64  # compile_draft: compiled entries per pass function (one per decoder and chain length)


def attended_widths(capacity: int) -> list[int]:
    """The widths a decoder of this capacity captures its passes for, ascending."""
    return sorted({min(w, capacity) for w in range(WIDTH_STEP, capacity + WIDTH_STEP, WIDTH_STEP)})


def plain_capacity(n: int, max_new: int) -> int:
    """Cache slots that plain decoding of max_new tokens after an n-token prompt may write (two steps ahead)."""
    return n + max_new + 3


def chain_capacity(n: int, max_new: int, k: int) -> int:
    """Cache slots that chains of k may write: up to two cycles in flight beyond the host's last read, and
    each cycle writes k + 1 slots after the committed ones."""
    return n + max_new + 3 * (k + 1) + 1


def tree_capacity(n: int, max_new: int, topk: int, depth: int, total: int) -> int:
    """Cache slots that trees may write: as for chains, with a cycle writing up to max(total + 1 target
    slots, (depth - 1) * topk draft slots, depth + 1 rebuilt ones) after the committed ones."""
    return n + max_new + 3 * max(total + 1, (depth - 1) * topk, depth + 1) + 1


def _stable_order(keys: torch.Tensor) -> torch.Tensor:
    """Indices that sort keys [n] ascending, ties in index order: a stable argsort by counting, for the
    small n of a tree (a few hundred). Element-wise work only, so it can be captured in a CUDA graph
    (CUB's stable sorts cannot always be)."""
    idx = torch.arange(keys.numel(), device=keys.device)
    before = (keys[None, :] < keys[:, None]) | ((keys[None, :] == keys[:, None]) & (idx[None, :] < idx[:, None]))
    rank = before.sum(1)  # [n]: a permutation of 0..n-1
    return torch.empty_like(idx).scatter_(0, rank, idx)


class StaticKVCache(KVCache):
    """The target's cache with writes at device slots (`self.slots`, set before each forward) and reads
    of the first `self.width` slots; the caller's mask hides what a query may not see."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots: torch.Tensor | None = None
        self.width = self.capacity

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.slots, key_states)
        self.values[layer_idx].index_copy_(2, self.slots, value_states)
        return self.keys[layer_idx][:, :, :self.width], self.values[layer_idx][:, :, :self.width]


class StaticDraftCache(DraftCache):
    """The draft's cache with writes at device slots and reads of the first `self.width` slots (see above)."""

    __slots__ = ("slots", "width")

    def __init__(self, k_store: torch.Tensor, v_store: torch.Tensor):
        super().__init__(k_store, v_store)
        self.slots: torch.Tensor | None = None
        self.width = k_store.shape[2]

    @property
    def key(self) -> torch.Tensor:
        return self.k_store[:, :, :self.width]

    @property
    def value(self) -> torch.Tensor:
        return self.v_store[:, :, :self.width]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> "StaticDraftCache":
        self.k_store.index_copy_(2, self.slots, k)
        self.v_store.index_copy_(2, self.slots, v)
        return self


def draft_pass(draft, hidden, ids, position_ids, mask, k_store, v_store, slots):
    """The draft's forward over its whole static cache given as tensors (entries written at `slots`): what
    `GraphDecoder._draft` runs under compile_draft, so that a compiled pass traces no writes to the decoder's
    cache object. -> (hidden_out [1, T, H], logits [1, T, Vd])."""
    cache = StaticDraftCache(k_store, v_store)  # reads every slot: its width is the stores'
    cache.slots = slots
    out = draft(hidden, ids, position_ids, past_key_values=cache, attention_mask=mask)
    return out.hidden_out, out.logits


class _Step:
    """`fn` (which writes its results into persistent buffers) captured as a CUDA graph and replayed,
    or simply called when graphs are off."""

    def __init__(self, fn, device: torch.device, graphs: bool, name: str, pool=None):
        self.fn, self.graph = fn, None
        if graphs:
            self.graph = capture_cuda_graph(fn, device, f"the {name} pass", "Decode eagerly instead with `eyas eval "
                                            "--no-cuda-graphs` (or --set eval.cuda_graphs=false)", pool=pool)

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class _Reads:
    """Small device results copied to pinned host memory without waiting, read back later in order."""

    def __init__(self, width: int, device: torch.device, slots: int = 4):
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(slots, width, dtype=torch.long, pin_memory=self.cuda)
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(slots)]  # re-recorded per push

    def push(self, i: int, src: torch.Tensor) -> None:
        s = i % len(self.events)
        self.host[s].copy_(src, non_blocking=self.cuda)
        if self.cuda:
            self.events[s].record()

    def get(self, i: int) -> list[int]:
        s = i % len(self.events)
        if self.cuda:
            self.events[s].synchronize()
        return self.host[s].tolist()


class GraphDecoder:
    """Static buffers of capacity C for one target (and optionally one Eagle3Draft), and the graphs
    over them, captured on first use per chain length. Made by SpecEngine; see the module docstring."""

    def __init__(self, runner: TargetRunner, draft, capacity: int, graphs: bool, compile_draft: str | None = None):
        """compile_draft: a torch.compile backend ("inductor") for the draft-side passes (a chain's or a tree's
        drafting with its bookkeeping, a rebuild), each compiled whole with static sizes before its graphs are
        captured, so that their small kernels fuse; None: eager. On an H200 a tree 16,4,48 cycle's drafting
        fell from 1.01 to 0.55 ms (bench/cycle_phases.py --compile-draft, docs/PERFORMANCE.md)."""
        model = runner.model
        p = next(model.parameters())
        self.device, self.runner, self.draft, self.capacity = p.device, runner, draft, capacity
        self.dtype, self.hidden_size = p.dtype, model.config.hidden_size
        self.compile_draft = compile_draft
        self.graphs = graphs and self.device.type == "cuda"
        dev = self.device
        self.cache = StaticKVCache(*cache_geometry(model.config), capacity, p.dtype, dev)
        self.cols = torch.arange(capacity, device=dev)  # slot indices
        self.widths = attended_widths(capacity)
        # the graphs run one at a time on one stream and keep their results in buffers made before capture,
        # so they can share one memory pool (one per width and pass would multiply the memory)
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.n = torch.zeros((), dtype=torch.long, device=dev)  # committed length = position of the pending token
        self.a = torch.zeros((), dtype=torch.long, device=dev)  # drafts accepted by the last verification
        self.steps: dict = {}
        if draft is not None:
            if not hasattr(draft, "cfg"):
                raise ValueError("the static (CUDA graph) path needs an Eagle3Draft, not a scripted draft")
            dc = draft.cfg
            self.ddtype = next(draft.parameters()).dtype
            store = torch.zeros(1, dc.num_key_value_heads, capacity, dc.head_dim, dtype=self.ddtype, device=dev)
            self.dcache = StaticDraftCache(store, store.clone())
            self.hidden = torch.zeros(1, 1, dc.hidden_size, dtype=self.ddtype, device=dev)  # the draft's last state
            self.dlogits = torch.zeros(dc.draft_vocab_size, dtype=self.ddtype, device=dev)
        # compile_draft: each draft-side pass (a chain's or a tree's drafting, a rebuild) is compiled whole, with
        # static sizes, before its graphs are captured. The draft then attends over the whole capacity in every
        # pass (its masks hide the slots it may not see), so that a pass has one shape at every attended width
        # and compiles once: one decoder layer reads a few MB of cache more, against hundreds of launches fused.
        # fullgraph: a graph break would be an error, not a silent eager pass
        self.draft_full_width = bool(compile_draft) and draft is not None
        if self.draft_full_width:
            import torch._dynamo as dynamo

            # one entry per pass and decoder: chains of several lengths and rebuilds share code objects
            dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._set_width(capacity)

    # ---------------------------------------------------------------- attended widths

    def _set_width(self, width: int) -> None:
        """Passes run (or traced) from now on attend over the first `width` slots of both caches."""
        self.width = width
        self.wcols = self.cols[:width]  # the mask's columns
        self.cache.width = width
        if self.draft is not None:
            self.dcache.width = self.capacity if self.draft_full_width else width
            self.dcols = self.cols if self.draft_full_width else self.wcols  # the draft's mask columns

    def _capture(self, fns: dict, label: str, widths: list[int] | None = None) -> dict[int, dict]:
        """{width: {name: _Step}}: every pass of `fns` captured (or, without graphs, kept) once per attended
        width (`widths`, default all), each capture run from n = 0 so that its slots stay inside the cache."""
        counted = self.runner.forward_tokens
        passes = {}
        for width in widths or self.widths:
            self._set_width(width)
            self.n.zero_()
            self.a.zero_()
            passes[width] = {name: _Step(fn, self.device, self.graphs, f"{label} {name} (width {width})", self.pool)
                             for name, fn in fns.items()}
        self.runner.forward_tokens = counted  # capture ran the passes; only real replays count
        return passes

    def _width_for(self, need: int) -> int:
        """The narrowest attended width holding `need` slots."""
        width = next((w for w in self.widths if w >= need), None)
        if width is None:
            raise RuntimeError(f"a pass may touch {need} cache slots, more than the capacity {self.capacity}: "
                               f"this is a bug in eyas (the capacity checks should have refused the request)")
        return width

    def _at(self, b: dict, need: int) -> dict:
        """The passes of b for the narrowest width holding `need` slots (eager passes read it when they run)."""
        width = self._width_for(need)
        self._set_width(width)
        return b["passes"][width]

    # ---------------------------------------------------------------- passes (traced into graphs)

    def _target(self, ids: torch.Tensor, positions: torch.Tensor, aux: bool, last_only: bool = False,
                slots: torch.Tensor | None = None, mask: torch.Tensor | None = None, keep: torch.Tensor | None = None):
        """The target over ids [1, T] at positions [T], written at `slots` [T] (default: the positions),
        attending where `mask` [T, C] says (default: every slot <= its position); logits as runner.forward."""
        self.cache.slots = positions if slots is None else slots
        if mask is None:
            mask = self.wcols[None, :] <= positions[:, None]  # [T, W]
        return self.runner.forward(self.cache, ids, positions[None], mask[None, None], last_only=last_only, aux=aux,
                                   keep=keep)

    def _draft(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor | None = None, mask: torch.Tensor | None = None):
        """The draft over (hidden [1, T, H], ids [1, T]) at positions [T]; slots and mask as in `_target`,
        over the draft's own columns (`dcols`)."""
        slots = positions if slots is None else slots
        if mask is None:
            mask = self.dcols[None, :] <= positions[:, None]  # [T, W]
        if self.draft_full_width:  # traced inside a compiled pass: the cache as tensors, no attribute writes
            hidden_out, logits = draft_pass(self.draft, hidden, ids, positions[None], mask, self.dcache.k_store,
                                            self.dcache.v_store, slots)
            return DraftOutput(hidden_out, logits, self.dcache)
        self.dcache.slots = slots
        return self.draft(hidden, ids, positions[None], past_key_values=self.dcache, attention_mask=mask)

    def _compiled(self, fn, name: str):
        """`fn` (a draft-side pass) compiled whole by the compile_draft backend, static sizes, or `fn` itself
        without one. A compiler failure, at the first call, becomes an EyasError naming the way out."""
        if not self.draft_full_width:
            return fn
        import torch._dynamo as dynamo

        # FailOnRecompileLimitHit (fullgraph cannot fall back to eager) is not a TorchDynamoException
        limit_hit = getattr(dynamo.exc, "FailOnRecompileLimitHit", None)
        errors = (dynamo.exc.TorchDynamoException,) + ((limit_hit,) if limit_hit else ())
        try:
            compiled = torch.compile(fn, backend=self.compile_draft, dynamic=False, fullgraph=True)
        except errors as e:  # an unknown backend, say
            raise self._compile_failed(e, name) from e

        def run() -> None:
            try:
                with torch.no_grad():  # one grad mode whoever calls: another would be another compilation
                    compiled()
            except errors as e:  # compiling happens at the first call
                raise self._compile_failed(e, name) from e

        return run

    def _compile_failed(self, e: Exception, name: str) -> EyasError:
        first = " ".join([line.strip() for line in str(e).splitlines() if line.strip()][:2])[:300]
        return EyasError(f"torch.compile (backend {self.compile_draft!r}) failed on the draft's pass ({name}): "
                         f"{type(e).__name__}: {first}. Compiling the draft is an experiment (eval.compile_draft); "
                         f"run without --compile-draft (or --set eval.compile_draft=false)")

    def _tree_mask(self, local: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """[T, W] over the slots `cols` [W]: every committed slot (< n), plus the slots n + j for which
        local [T, L] is True."""
        width = local.shape[1]
        rel = cols - self.n  # [W]: slot relative to the committed length
        inside = (rel >= 0) & (rel < width)
        return (rel < 0)[None, :] | (local[:, rel.clamp(0, width - 1)] & inside[None, :])

    def _rebuild(self, b: dict) -> None:
        """The draft fed the real aux states b["aux"] [W, A*H] of the kept positions n.. with the target's
        argmax b["best"] [W] as next tokens; its state is taken at row a, and n grows by a + 1. All W rows
        are fed (a fixed shape): rows after a see only their past, and their slots are overwritten before
        any later query can see them."""
        rows = b["best"].shape[0]
        fused = self.draft.fuse(b["aux"].to(self.ddtype))[None]  # [1, W, H]
        out = self._draft(fused, b["best"].view(1, -1), self.n + self.cols[:rows])
        row = self.a.view(1)
        self.hidden.copy_(out.hidden_out.index_select(1, row))
        self.dlogits.copy_(out.logits[0].index_select(0, row)[0])
        b["ids"][0, :1].copy_(b["best"].index_select(0, row))  # the bonus token is the next pending one
        self.n.add_(self.a + 1)

    def _chain_buffers(self, k: int) -> dict:
        if ("chain", k) in self.steps:
            return self.steps[("chain", k)]
        dev = self.device
        b = {"ids": torch.zeros(1, k + 1, dtype=torch.long, device=dev),  # pending + drafted: the verify input
             "best": torch.zeros(k + 1, dtype=torch.long, device=dev),  # the target's argmax per row
             "aux": torch.zeros(k + 1, len(self.runner.aux_layers) * self.hidden_size, dtype=self.dtype, device=dev),
             "read": torch.zeros(2 * k + 2, dtype=torch.long, device=dev),  # drafted, argmax, a: the host's read
             "rows": torch.arange(k + 1, device=dev),
             "reads": _Reads(2 * k + 2, dev)}  # pinned once per decoder, not per generation
        self.runner.attach()  # the verify pass needs the aux hooks while it is traced

        def chain():
            hidden, logits = self.hidden, self.dlogits
            for i in range(k):
                tok = self.draft.to_target_ids(logits.argmax(-1, keepdim=True))  # [1]
                b["ids"][0, i + 1:i + 2].copy_(tok)
                if i == k - 1:
                    break
                out = self._draft(hidden, tok.view(1, 1), (self.n + i).view(1))
                hidden, logits = out.hidden_out[:, -1:], out.logits[0, -1]

        def verify():
            logits, aux = self._target(b["ids"], self.n + b["rows"], aux=True)
            best = logits.argmax(-1)  # [k + 1]
            drafted = b["ids"][0, 1:]
            self.a.copy_((drafted == best[:k]).long().cumprod(0).sum())
            b["best"].copy_(best)
            b["aux"].copy_(aux)
            b["read"][:k].copy_(drafted)
            b["read"][k:2 * k + 1].copy_(best)
            b["read"][2 * k + 1:].copy_(self.a.view(1))

        def rebuild():
            self._rebuild(b)

        b["passes"] = self._capture({"chain": self._compiled(chain, f"chain-{k}"), "verify": verify,
                                     "rebuild": self._compiled(rebuild, f"chain-{k} rebuild")}, f"chain-{k}")
        self.steps[("chain", k)] = b
        return b

    def _tree_buffers(self, topk: int, depth: int, total: int) -> dict:
        """Buffers and graphs of EAGLE-2 dynamic trees (drafting.draft_tree's rules, fixed shapes).

        `tree`: `depth` levels of drafting; each level after the first feeds its `topk` best nodes (by
        cumulative draft log-prob) at draft slots n + (level - 1) * topk + row, each seeing the committed
        slots, its expanded ancestors and itself. The `total` best of all candidates (a parent always
        scores at least as well as its child, and ties go to the earlier candidate, so the set is closed
        under ancestors) are ordered parents first, siblings by score. `verify`: the target over the
        pending token and the nodes at slots n.. (positions n + depth) with the ancestor mask; the greedy
        path is walked on the device (a node is accepted when its token is the target's argmax at its
        parent and its parent is accepted) and its depth + 1 entries are moved to slots n..n + depth.
        `rebuild` is the chain's, over depth + 1 rows.
        """
        key = ("tree", topk, depth, total)
        if key in self.steps:
            return self.steps[key]
        dev, vocab = self.device, self.dlogits.shape[0]
        if topk > vocab:
            raise ValueError(f"tree top-k {topk} exceeds the draft vocabulary ({vocab})")
        pool = topk + (depth - 1) * topk * topk  # candidates drafted per cycle
        m = min(total, pool)
        width = (depth - 1) * topk  # draft slots the expanded levels take
        b = {"ids": torch.zeros(1, m + 1, dtype=torch.long, device=dev),  # pending + nodes: the verify input
             "depths": torch.zeros(m + 1, dtype=torch.long, device=dev),  # 0 for the pending token
             "parents": torch.zeros(m + 1, dtype=torch.long, device=dev),  # row of each row's parent (root: 0)
             "anc": torch.zeros(m + 1, m + 1, dtype=torch.bool, device=dev),  # row sees row (ancestors, itself)
             "rows": torch.arange(m + 1, device=dev),
             "best": torch.zeros(depth + 1, dtype=torch.long, device=dev),  # the target's argmax along the path
             "aux": torch.zeros(depth + 1, len(self.runner.aux_layers) * self.hidden_size, dtype=self.dtype,
                                device=dev),
             "read": torch.zeros(depth + 3, dtype=torch.long, device=dev),  # best along the path, a, tree depth
             "reads": _Reads(depth + 3, dev), "size": m}
        self.runner.attach()  # the verify pass needs the aux hooks while it is traced
        eye = torch.eye(topk, dtype=torch.bool, device=dev)

        def tree():
            top = torch.log_softmax(self.dlogits.float(), dim=-1).topk(topk)
            scores, ids, levels, parents = [top.values], [top.indices], [torch.ones_like(top.indices)], \
                [torch.full_like(top.indices, -1)]
            front, front_ids, front_scores = torch.arange(topk, device=dev), top.indices, top.values
            front_hidden = self.hidden.expand(1, topk, self.hidden.shape[-1])
            front_anc = torch.zeros(topk, width, dtype=torch.bool, device=dev)  # expanded ancestors' draft slots
            start = topk
            for d in range(1, depth):
                seen = front_anc.clone()
                seen[:, (d - 1) * topk:d * topk] |= eye  # each frontier node sees its own new slot
                slots = self.n + (d - 1) * topk + self.cols[:topk]
                out = self._draft(front_hidden, self.draft.to_target_ids(front_ids).view(1, topk),
                                  (self.n + (d - 1)).expand(topk), slots=slots, mask=self._tree_mask(seen, self.dcols))
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
            scores, ids, levels, parents = (torch.cat(x) for x in (scores, ids, levels, parents))
            # the m best by score (ties: the earlier, i.e. shallower, candidate), then parents first
            chosen = _stable_order(-scores)[:m]
            order = chosen[_stable_order(levels[chosen])]
            row_of = torch.zeros(pool, dtype=torch.long, device=dev).scatter_(0, order, self.cols[1:m + 1])
            par = parents[order]  # pool indices; row_of maps them to verify rows (1..m)
            b["parents"][1:].copy_(torch.where(par >= 0, row_of[par.clamp(min=0)], 0))
            b["ids"][0, 1:].copy_(self.draft.to_target_ids(ids[order]))
            b["depths"][1:].copy_(levels[order])
            anc = torch.eye(m + 1, dtype=torch.bool, device=dev)
            up = b["rows"]
            for _ in range(depth):
                up = b["parents"][up]
                anc.scatter_(1, up[:, None], True)
            b["anc"].copy_(anc)

        def verify():
            logits, aux = self._target(b["ids"], self.n + b["depths"], aux=True, slots=self.n + b["rows"],
                                       mask=self._tree_mask(b["anc"], self.wcols))
            best = logits.argmax(-1)  # [m + 1]
            match = (b["ids"][0] == best[b["parents"]]) | (b["rows"] == 0)
            accepted = match
            for _ in range(depth):
                accepted = match & accepted[b["parents"]]
            # the deepest accepted node (one per depth), kept a 1-element tensor: indexing with a 0-dim tensor
            # reads it on the host, which a CUDA graph capture refuses
            node = torch.where(accepted, b["depths"], -1).argmax().view(1)
            self.a.copy_(b["depths"].index_select(0, node).view(()))
            path = node.expand(depth + 2).clone()  # rows along the path by depth; later entries repeat the node
            path.scatter_(0, torch.where(b["anc"].index_select(0, node)[0], b["depths"], depth + 1), b["rows"])
            path = path[:depth + 1]
            slots, dest = self.n + path, self.n + self.cols[:depth + 1]
            for store in (self.cache.keys, self.cache.values):  # the path's entries move to slots n..n + depth
                store.index_copy_(3, dest, store.index_select(3, slots))
            b["best"].copy_(best[path])
            b["aux"].copy_(aux[path])
            b["read"][:depth + 1].copy_(b["best"])
            b["read"][depth + 1:depth + 2].copy_(self.a.view(1))
            b["read"][depth + 2:].copy_(b["depths"].max().view(1))

        def rebuild():
            self._rebuild(b)

        name = f"tree {topk},{depth},{total}"
        b["passes"] = self._capture({"tree": self._compiled(tree, name), "verify": verify,
                                     "rebuild": self._compiled(rebuild, f"{name} rebuild")}, name)
        self.steps[key] = b
        return b

    def _plain_buffers(self) -> dict:
        if "plain" in self.steps:
            return self.steps["plain"]
        b = {"ids": torch.zeros(1, 1, dtype=torch.long, device=self.device), "reads": _Reads(1, self.device)}
        self.n.zero_()

        def step():
            logits, _ = self._target(b["ids"], self.n.view(1), aux=False)
            b["ids"].copy_(logits.argmax(-1).view(1, 1))
            self.n.add_(1)

        b["passes"] = self._capture({"step": step}, "plain")
        self.steps["plain"] = b
        return b

    # ---------------------------------------------------------------- prefill

    def _prefill_buffers(self, n: int, with_draft: bool) -> dict:
        """The prefill pass for prompts of n tokens: padded to the next multiple of PREFILL_STEP (at most the
        capacity) and captured once per padded length. The padding's cache entries sit after the committed
        length, where every later pass masks a slot until it has written it, like a rejected draft's."""
        length = min(-(-n // PREFILL_STEP) * PREFILL_STEP, self.capacity)
        key = ("prefill", length, with_draft)
        if key in self.steps:
            return self.steps[key]
        dev = self.device
        b = {"ids": torch.zeros(1, length, dtype=torch.long, device=dev),  # the prompt, then padding
             "next": torch.zeros(1, length, dtype=torch.long, device=dev),  # the prompt from its 2nd token on
             "last": torch.zeros(1, dtype=torch.long, device=dev),  # n - 1: the row whose logits count
             "pending": torch.zeros(1, dtype=torch.long, device=dev),
             "width": self._width_for(length)}
        positions = self.cols[:length]

        def prefill():
            logits, aux = self._target(b["ids"], positions, aux=with_draft, keep=b["last"])
            b["pending"].copy_(logits[0].argmax(-1, keepdim=True))
            if with_draft:  # the draft's row t pairs the target's state at t with token t + 1
                tokens = b["next"].index_copy(1, b["last"], b["pending"].view(1, 1))
                out = self._draft(self.draft.fuse(aux.to(self.ddtype))[None], tokens, positions)
                self.hidden.copy_(out.hidden_out.index_select(1, b["last"]))
                self.dlogits.copy_(out.logits[0].index_select(0, b["last"])[0])

        b["pass"] = self._capture({"prefill": prefill}, f"{length} tokens", [b["width"]])[b["width"]]["prefill"]
        self.steps[key] = b
        return b

    def ready_prefill(self, n: int, with_draft: bool) -> None:
        """Capture the prefill pass for n-token prompts now (before a clock starts), if prefills are graphed."""
        if PREFILL_STEP and n + 1 <= self.capacity:
            self._prefill_buffers(n, with_draft)

    def _prefill(self, prompt: torch.Tensor, with_draft: bool) -> torch.Tensor:
        """Fill both caches with the prompt [1, n]; -> the first new token [1] (on the device)."""
        n = prompt.shape[1]
        if n + 1 > self.capacity:
            raise RuntimeError(f"prompt of {n} tokens does not fit a static cache of {self.capacity}")
        if not PREFILL_STEP:
            pending = self._prefill_eager(prompt, with_draft)
        else:
            b = self._prefill_buffers(n, with_draft)
            b["ids"][0, :n].copy_(prompt[0])
            b["ids"][0, n:].zero_()
            b["next"][0, :n - 1].copy_(prompt[0, 1:])
            b["next"][0, n - 1:].zero_()
            b["last"].fill_(n - 1)
            self._set_width(b["width"])
            counted = self.runner.forward_tokens
            b["pass"]()
            self.runner.forward_tokens = counted + n  # the prompt, not its padding (nor nothing, when replayed)
            pending = b["pending"]
        self.n.fill_(n)
        self.cache.length = n
        return pending

    def _prefill_eager(self, prompt: torch.Tensor, with_draft: bool) -> torch.Tensor:
        """`_prefill` at the prompt's own length, without a graph (PREFILL_STEP = 0)."""
        n = prompt.shape[1]
        positions = self.cols[:n]
        self._set_width(self.capacity)
        with varying_shape_attention():  # a new length each prompt: no per-shape cuDNN plans
            logits, aux = self._target(prompt, positions, aux=with_draft, last_only=True)
            pending = logits[-1].argmax(-1, keepdim=True)  # [1]
            if with_draft:
                out = self._draft(self.draft.fuse(aux.to(self.ddtype))[None],
                                  torch.cat([prompt[0, 1:], pending])[None], positions)
                self.hidden.copy_(out.hidden_out[:, -1:])
                self.dlogits.copy_(out.logits[0, -1])
        return pending

    # ---------------------------------------------------------------- generation

    def plain(self, prompt: torch.Tensor, max_new: int, eos: set[int], res) -> None:
        """Greedy plain decoding into `res` (a GenResult): two steps queued ahead of the host's reads."""
        b = self._plain_buffers()
        t0 = time.perf_counter()
        n = prompt.shape[1]
        if plain_capacity(n, max_new) > self.capacity:
            raise RuntimeError(f"{n} + {max_new} tokens do not fit a static cache of {self.capacity}")
        reads = b["reads"]
        b["ids"].copy_(self._prefill(prompt, False).view(1, 1))
        reads.push(0, b["ids"][0])
        launched, ahead = 1, 2 if self.graphs else 0
        while True:
            while launched < min(len(res.tokens) + 1 + ahead, max_new):
                self._at(b, n + launched)["step"]()  # step `launched` writes slot n + launched - 1
                reads.push(launched, b["ids"][0])
                launched += 1
            res.tokens.append(reads.get(len(res.tokens))[0])
            if len(res.tokens) == 1:
                res.prefill_s = time.perf_counter() - t0
            if res.tokens[-1] in eos or len(res.tokens) >= max_new:
                break
        self.runner.forward_tokens += launched - 1  # the prefill counted itself

    def chain(self, prompt: torch.Tensor, max_new: int, k: int, eos: set[int], res, sync_timing: bool) -> None:
        """Greedy EAGLE-3 chain decoding into `res`: one cycle queued ahead of the host's read, or none
        (and a synchronisation between the phases) when `sync_timing` asks for exact draft/verify times."""
        n = prompt.shape[1]
        if chain_capacity(n, max_new, k) > self.capacity:
            raise RuntimeError(f"{n} + {max_new} tokens and chains of {k} do not fit a static cache of {self.capacity}")

        def read(got: list[int]) -> tuple[list[int], int, int]:
            drafted, best, a = got[:k], got[k:2 * k + 1], got[2 * k + 1]
            return drafted[:a] + [best[a]], a, k

        self._cycles(prompt, max_new, self._chain_buffers(k), "chain", read, k + 1, 2 * k, eos, res, sync_timing,
                     span=k + 1, advance=k + 1)

    def tree(self, prompt: torch.Tensor, max_new: int, tree: tuple[int, int, int], eos: set[int], res,
             sync_timing: bool) -> None:
        """Greedy EAGLE-3 decoding with dynamic trees (topk, depth, total) into `res`, as `chain` does."""
        topk, depth, total = tree
        n = prompt.shape[1]
        if tree_capacity(n, max_new, topk, depth, total) > self.capacity:
            raise RuntimeError(f"{n} + {max_new} tokens and trees of {tree} do not fit a static cache of "
                               f"{self.capacity}")
        b = self._tree_buffers(topk, depth, total)

        def read(got: list[int]) -> tuple[list[int], int, int]:
            a = got[depth + 1]
            return got[:a + 1], a, got[depth + 2]  # the target's argmax along the path: accepted + bonus

        self._cycles(prompt, max_new, b, "tree", read, b["size"] + 1, (depth - 1) * topk + depth + 1, eos, res,
                     sync_timing, span=max(b["size"] + 1, (depth - 1) * topk, depth + 1), advance=depth + 1)

    def _cycles(self, prompt, max_new: int, b: dict, draft_step: str, read, target_width: int, draft_width: int,
                eos: set[int], res, sync_timing: bool, span: int, advance: int) -> None:
        """The host side of speculative cycles over the passes draft_step, "verify" and "rebuild" of b:
        `read(row)` turns a cycle's read into (new tokens, accepted drafts, depth tried). A cycle writes
        at most `span` slots from the committed length on and commits at most `advance` of them."""
        t0 = time.perf_counter()
        ahead = 0 if (sync_timing or not self.graphs) else 1
        reads = b["reads"]
        n0 = prompt.shape[1]
        pending = self._prefill(prompt, True)
        b["ids"][0, :1].copy_(pending)
        res.tokens.append(int(pending))
        res.prefill_s = time.perf_counter() - t0
        sync = sync_timing and self.device.type == "cuda"
        launched = done = 0
        while True:
            while launched <= done + ahead and len(res.tokens) + launched - done < max_new:
                # the committed length when this cycle starts is at most the one the host has read
                # (n0 + tokens - 1) plus what each cycle still in flight may add
                passes = self._at(b, n0 + len(res.tokens) - 1 + (launched - done) * advance + span)
                t1 = time.perf_counter()
                passes[draft_step]()
                if sync:
                    torch.cuda.synchronize(self.device)
                t2 = time.perf_counter()
                passes["verify"]()
                if sync:
                    torch.cuda.synchronize(self.device)
                t3 = time.perf_counter()
                passes["rebuild"]()
                reads.push(launched, b["read"])
                if sync:
                    torch.cuda.synchronize(self.device)
                if sync or not self.graphs:  # queued graphs return at once: their phases cannot be timed
                    res.draft_s += (t2 - t1) + (time.perf_counter() - t3)
                    res.verify_s += t3 - t2
                launched += 1
            if done == launched:  # nothing queued: max_new reached
                break
            new, a, tried = read(reads.get(done))
            done += 1
            before = len(res.tokens)
            res.tokens.extend(new)
            res.num_cycles += 1
            res.accepted_per_cycle.append(a)
            res.accepted_depths.append(tried)
            res.target_tokens_per_cycle.append(target_width)
            res.draft_tokens_per_cycle.append(draft_width)
            if len(res.tokens) >= max_new or any(t in eos for t in res.tokens[before:]):
                break
        self.runner.forward_tokens += launched * target_width  # the prefill counted itself
