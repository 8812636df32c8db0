"""Greedy decoding with fixed shapes, replayed as CUDA graphs: plain decoding, EAGLE-3 chains and trees, DFlash chains.

A CUDA graph fixes every shape and every address (graph_steps.py: why graphs pay for a small target, how
results reach the host), so in this path everything has one:

- both caches have a fixed capacity C and take writes at slots named by device tensors (static_cache.py);
  a pass attends over the first W slots, W the attended width: every pass is captured once per width
  (multiples of WIDTH_STEP up to C) and the host replays the narrowest one that holds every slot the pass
  can touch (a 37-query attention over 1,024 slots costs 29 us on an H200, over 256 slots 17.5 us:
  docs/PERFORMANCE.md);
- the committed length n and the last cycle's accepted count a live in device scalars; the graphs
  update them themselves (n += a + 1), so the host never has to wait for the device to go on.

The passes of each mode are made in graph_modes.py (plain steps, chains and the rebuild), graph_tree.py
(trees) and graph_dflash.py (DFlash chains: the draft's context in a fixed store per layer); this module holds
the decoder's state, the passes' shared calls of the target and the draft, the prefill and the host's side of
decoding. Cycles queued after the end of the text (one at most, or two plain
steps) are dropped unread; their time counts in `total_s`, as it does for a serving engine that runs ahead.

The prefill has a fixed shape too: the prompt is padded to a multiple of PREFILL_STEP tokens (at most C)
and one graph per padded length fills both caches and picks the first token at row n - 1. The padding's
entries lie after the committed length, where every pass masks a slot until it has written it (as it does
a rejected draft's), so they are never seen; eagerly, every new prompt length would be a new shape (SDPA's
cuDNN backend builds a plan per shape: 87 ms for a new length on an H200 against 27 ms for a known one,
docs/PERFORMANCE.md).

On a CPU, or with graphs off, the same functions run eagerly (same buffers, same order), which is
how the tests check this path against the dynamic engine without a GPU. Greedy only: sampling uses
the dynamic engine.
"""

from __future__ import annotations

import time

import torch

from eyas.draft.model import DraftOutput
from eyas.speculative.graph_dflash import context_stores, dflash_buffers, write_context
from eyas.speculative.graph_modes import chain_buffers, plain_buffers
from eyas.speculative.graph_steps import _Step, allow_recompiles, compiled_pass
from eyas.speculative.graph_tree import _stable_order, tree_buffers  # noqa: F401 (_stable_order: tests import it here)
from eyas.speculative.static_cache import (StaticDraftCache, StaticKVCache, chain_capacity, draft_pass, plain_capacity,
                                           tree_capacity)
from eyas.speculative.target import TargetRunner, cache_geometry, varying_shape_attention


# read here at call time, so that bench scripts and tests can set them on this module
WIDTH_STEP = 256  # attended widths are the multiples of this up to the capacity (and the capacity)
PREFILL_STEP = 64  # prompts are padded to a multiple of this for a graphed prefill; 0: eager, exact length
RECOMPILE_LIMIT = 64  # compile_draft: compiled entries per pass function (one per decoder and chain length)


def attended_widths(capacity: int) -> list[int]:
    """The widths a decoder of this capacity captures its passes for, ascending."""
    return sorted({min(w, capacity) for w in range(WIDTH_STEP, capacity + WIDTH_STEP, WIDTH_STEP)})



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
        self.cols = torch.arange(capacity, device=dev)  # [C]: slot indices
        self.widths = attended_widths(capacity)
        # the graphs run one at a time on one stream and keep their results in buffers made before capture,
        # so they can share one memory pool (one per width and pass would multiply the memory)
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.n = torch.zeros((), dtype=torch.long, device=dev)  # committed length = position of the pending token
        self.a = torch.zeros((), dtype=torch.long, device=dev)  # drafts accepted by the last verification
        self.steps: dict = {}
        self.dflash = getattr(draft, "method", None) == "dflash"
        if self.dflash:  # the draft's context: each layer's keys and values, one fixed store per layer
            if compile_draft:
                raise ValueError("compile_draft: DFlash passes are captured uncompiled")
            self.ddtype = next(draft.parameters()).dtype
            self.dctx = context_stores(draft, capacity, dev)
        elif draft is not None:
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
        self.draft_full_width = bool(compile_draft) and draft is not None
        if self.draft_full_width:
            allow_recompiles(RECOMPILE_LIMIT)
        self._set_width(capacity)

    # ---------------------------------------------------------------- attended widths

    def _set_width(self, width: int) -> None:
        """Passes run (or traced) from now on attend over the first `width` slots of both caches."""
        self.width = width
        self.wcols = self.cols[:width]  # the mask's columns
        self.cache.width = width
        if self.draft is not None and not self.dflash:
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
        """`fn` (a draft-side pass) compiled whole by the compile_draft backend (graph_steps.compiled_pass), or
        `fn` itself without one."""
        return compiled_pass(fn, self.compile_draft, name) if self.draft_full_width else fn

    # ---------------------------------------------------------------- the passes of each mode, made once

    def _chain_buffers(self, k: int) -> dict:
        """The passes of chains of k for this decoder's draft: EAGLE-3's (graph_modes.py) or DFlash's
        (graph_dflash.py), driven alike by `chain`."""
        if ("chain", k) not in self.steps:
            self.steps[("chain", k)] = (dflash_buffers if self.dflash else chain_buffers)(self, k)
        return self.steps[("chain", k)]

    def _tree_buffers(self, topk: int, depth: int, total: int) -> dict:
        key = ("tree", topk, depth, total)
        if key not in self.steps:
            self.steps[key] = tree_buffers(self, topk, depth, total)
        return self.steps[key]

    def _plain_buffers(self) -> dict:
        if "plain" not in self.steps:
            self.steps["plain"] = plain_buffers(self)
        return self.steps["plain"]

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
        b = {"ids": torch.zeros(1, length, dtype=torch.long, device=dev),  # [1, L]: the prompt, then padding
             "next": torch.zeros(1, length, dtype=torch.long, device=dev),  # [1, L]: the prompt from its 2nd token on
             "last": torch.zeros(1, dtype=torch.long, device=dev),  # n - 1: the row whose logits count
             "pending": torch.zeros(1, dtype=torch.long, device=dev),
             "width": self._width_for(length)}
        positions = self.cols[:length]

        def prefill():
            logits, aux = self._target(b["ids"], positions, aux=with_draft, keep=b["last"])
            b["pending"].copy_(logits[0].argmax(-1, keepdim=True))
            if with_draft and self.dflash:  # every padded row's features: those past n are never attended
                write_context(self, aux, positions)
            elif with_draft:  # the draft's row t pairs the target's state at t with token t + 1
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
            if with_draft and self.dflash:
                write_context(self, aux, positions)
            elif with_draft:
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
        """Greedy chain decoding (EAGLE-3's k drafted tokens or DFlash's k guesses) into `res`: one cycle queued
        ahead of the host's read, or none (and a synchronisation between the phases) when `sync_timing` asks for
        exact draft/verify times. A DFlash cycle feeds its draft the block and k + 1 context rows (all the
        verified ones: a fixed shape), an EAGLE-3 cycle k - 1 drafting rows and k + 1 rebuilt ones."""
        n = prompt.shape[1]
        if chain_capacity(n, max_new, k) > self.capacity:
            raise RuntimeError(f"{n} + {max_new} tokens and chains of {k} do not fit a static cache of {self.capacity}")

        def read(got: list[int]) -> tuple[list[int], int, int]:
            drafted, best, a = got[:k], got[k:2 * k + 1], got[2 * k + 1]
            return drafted[:a] + [best[a]], a, k

        draft_width = self.draft.cfg.block_size + k + 1 if self.dflash else 2 * k
        self._cycles(prompt, max_new, self._chain_buffers(k), "chain", read, k + 1, draft_width, eos, res,
                     sync_timing, span=k + 1, advance=k + 1)

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
