"""SpecEngine: EAGLE-3 speculative decoding (chain or dynamic tree), DFlash chains, and plain decoding with the
same code.

One cycle, with N committed tokens (target cache 0..N-1, draft cache 0..N-1) and the pending token
x_N (known, not yet seen by the target):

1. draft: from the draft's last hidden output and logits, propose a chain or a tree (drafting.py);
2. verify: one target pass over [x_N, proposal...] with a causal or tree mask, positions N + depth;
3. accept (accept.py): a path of a nodes plus a bonus token; the target cache keeps the path entries
   (x_N and the a accepted tokens), the draft cache is cut back to N entries;
4. rebuild: the draft is fed the target's real aux features of the kept tokens, paired with the next
   token (the accepted tokens, then the bonus), at positions N..N+a. Its last output predicts the token
   after the bonus and starts the next cycle. N grows by a + 1 and the bonus is the new pending token.

Greedy output equals plain greedy decoding of the target; sampling follows its distribution.
Batch size 1. Times are wall-clock, synchronised on CUDA.

With `static=True`, greedy chains, trees and plain decoding run with fixed shapes instead
(graphs.py), replayed as CUDA graphs on a GPU; sampling keeps the dynamic path.

A DFlash draft (`draft.method == "dflash"`, eyas/draft/dflash.py) drafts a chain of k <= block_size - 1
tokens in one forward over the block [x_N, mask, ...] at positions N.., attending to a DFlashContext: the
fused target features of the committed tokens 0..N-1. Verification and acceptance are as above (its guesses
are greedy, so a deterministic proposal: sampling stays exact); the context then grows by the target's aux
states of x_N and the accepted tokens (the bonus has none yet: it anchors the next block). DFlash defines
no tree. Its greedy chains have a static path too (graph_dflash.py: CUDA graphs on a GPU); its draft passes
are not compiled (compile_draft is EAGLE-3's, and an engine asked for it says so once).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eyas.common import print0
from eyas.speculative.accept import accept_sample, sample_token, walk_greedy
from eyas.speculative.drafting import crop_cache, draft_chain, draft_tree
from eyas.speculative.graphs import GraphDecoder
from eyas.speculative.static_cache import chain_capacity, plain_capacity, tree_capacity
from eyas.speculative.target import Positions, TargetRunner, tree_mask, varying_shape_attention


@dataclass
class GenResult:
    tokens: list[int]  # new tokens only, cut at max_new_tokens and after the first eos
    num_cycles: int = 0
    accepted_per_cycle: list[int] = field(default_factory=list)  # accepted draft tokens; tau = this + 1
    accepted_depths: list[int] = field(default_factory=list)  # per cycle, proposal depth (positions tried)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    total_s: float = 0.0
    target_tokens_per_cycle: list[int] = field(default_factory=list)  # tokens fed to the target
    draft_tokens_per_cycle: list[int] = field(default_factory=list)  # tokens fed to the draft

    @property
    def tau(self) -> float:
        return (sum(self.accepted_per_cycle) + len(self.accepted_per_cycle)) / max(1, self.num_cycles)


def _finished(tokens: list[int], max_new: int, eos: set[int], start: int = 0) -> bool:
    """Enough tokens, or an eos among tokens[start:] (the ones added since the last check)."""
    return len(tokens) >= max_new or any(t in eos for t in tokens[start:])


def _cut(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


def _accept(logits: torch.Tensor, steps: int | None, proposal, temperature: float, generator):
    """The verified cycle's accepted path: proposal is a chain's `steps` drafted tokens (on the device) or,
    steps None, a tree's proposal -> (proposed tokens, path, bonus token, best); best is the target's argmax
    [k + 1] of a greedy chain, whose rebuild feeds those rows as they are, else None."""
    best = None
    if steps is not None:
        if temperature > 0:
            tokens, parents = proposal.tolist(), list(range(-1, steps - 1))
        else:
            best = logits.argmax(-1)  # [k + 1]
            both = torch.cat([proposal, best]).tolist()  # the cycle's one read of the device
            tokens, parents = both[:steps], list(range(-1, steps - 1))
    else:
        tokens, parents = proposal.tokens, proposal.parents
    if temperature > 0:
        path, bonus = accept_sample(logits, tokens, parents, temperature, generator)
    elif best is not None:
        path, bonus = walk_greedy(both[steps:], tokens, parents)
    else:
        path, bonus = walk_greedy(logits.argmax(-1).tolist(), tokens, parents)
    return tokens, path, bonus, best


def draft_method(draft) -> str | None:
    """"eagle3" or "dflash" (a draft's `method` attribute; EAGLE-3 drafts need none); None without a draft."""
    return None if draft is None else getattr(draft, "method", "eagle3")


class SpecEngine:
    """A target model plus an EAGLE-3 draft (Eagle3Draft or anything with its interface) or a DFlashDraft."""

    def __init__(self, target_model, draft=None, aux_layers: list[int] | None = None, sync_timing: bool = True,
                 static: bool = False, compile_draft: str | None = None):
        """sync_timing: synchronise the device between drafting and verification, so that draft_s and
        verify_s are exact on CUDA (False saves those waits; only total_s is then meaningful).
        static: greedy chains and plain decoding with fixed shapes (graphs.py): CUDA graphs on a GPU,
        the same passes eagerly elsewhere.
        compile_draft: a torch.compile backend ("inductor") for the draft's passes on the static path
        (graphs.GraphDecoder); None: eager.
        A DFlash draft reads the target's states at draft.cfg.target_layers (aux_layers may be None or must
        equal them); its static path runs the draft uncompiled (compile_draft is dropped, said once)."""
        self.method = draft_method(draft)
        if self.method == "dflash":
            if aux_layers is not None and list(aux_layers) != list(draft.cfg.target_layers):
                raise ValueError(f"the DFlash draft fuses the target layers {draft.cfg.target_layers} (its "
                                 f"cfg.target_layers), not the aux layers {list(aux_layers)} given")
            aux_layers = list(draft.cfg.target_layers)
            num_layers = len(target_model.model.layers)
            if not all(1 <= i <= num_layers - 1 for i in aux_layers):  # hooks read residual states 1..L-1
                raise ValueError(f"the DFlash draft's target layers {aux_layers} must lie in 1..{num_layers - 1} "
                                 f"(HF hidden_states ids of this {num_layers}-layer target)")
            if compile_draft:
                print0("DFlash draft: the compiled draft is EAGLE-3 only; the DFlash passes run uncompiled"
                       + (" (in CUDA graphs where the static path runs)" if static else ""))
                compile_draft = None
        elif self.method not in (None, "eagle3"):
            raise ValueError(f"draft method {self.method!r}: the engine decodes with eagle3 or dflash drafts")
        if compile_draft and not static:
            raise ValueError(f"compile_draft={compile_draft!r} needs static=True: only the static path's "
                             f"draft passes are compiled")
        self.model = target_model
        self.draft = draft
        self.runner = TargetRunner(target_model, aux_layers if draft is not None else None)
        self.device = next(target_model.parameters()).device
        first = next(iter(draft.parameters()), None) if draft is not None else None
        self.draft_dtype = first.dtype if first is not None else None  # scripted drafts have no parameters
        self.draft_forward_tokens = 0
        self.sync_timing = sync_timing
        self.static = static
        self.compile_draft = compile_draft
        self._decoder: GraphDecoder | None = None
        self._d2t = None
        self.context = None  # a DFlash draft's DFlashContext after the last generation (for inspection)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _split_sync(self) -> None:
        """Synchronise between phases only when draft_s/verify_s are wanted (it costs device idle time)."""
        if self.sync_timing:
            self._sync()

    def _static_decoder(self, need: int) -> GraphDecoder:
        """The fixed-shape decoder, made again (and its graphs captured again) only when a generation
        needs more than its capacity, which grows in steps of 1,024 tokens."""
        if self._decoder is None or self._decoder.capacity < need:
            self._decoder = None  # free the old buffers and graphs first
            self._decoder = GraphDecoder(self.runner, self.draft, -(-need // 1024) * 1024, graphs=True,
                                         compile_draft=self.compile_draft)
        return self._decoder

    def _ids(self, tokens) -> torch.Tensor:
        return torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(1, -1)

    def _draft_forward(self, aux, tokens, positions, cache):
        """Feed (fuse(aux_t), token_{t+1}) for aux [T, A*H], tokens [T] (device) at positions [1, T]
        -> (hidden [1,1,H], logits [Vd] of the last entry, cache)."""
        hidden = self.draft.fuse(aux.to(self.draft_dtype) if self.draft_dtype is not None else aux)[None]
        out = self.draft(hidden, tokens.view(1, -1), positions, past_key_values=cache)
        self.draft_forward_tokens += tokens.numel()
        return out.hidden_out[:, -1:], out.logits[0, -1], out.past_key_values

    def _d2t_host(self) -> list[int] | None:
        """The draft's d2t offsets as a host list (tree drafting maps ids on the host), read once."""
        d2t = getattr(self.draft, "d2t", None)
        if not isinstance(d2t, torch.Tensor) or d2t.numel() == 0:
            return None
        if self._d2t is None or self._d2t[0] is not d2t or self._d2t[1] != d2t._version:
            self._d2t = (d2t, d2t._version, d2t.tolist() if bool(d2t.any()) else None)
        return self._d2t[2]

    def _tree_inputs(self, pending: int, prop, past: int, pos: Positions):
        """(ids [1, T], positions [1, T], mask [1, 1, T, past + T]) of a tree verification with one copy
        to the device: tokens, depths and the ancestor mask travel in one int64 tensor."""
        t = len(prop) + 1
        anc = tree_mask(0, [-1] + [p + 1 for p in prop.parents], "cpu")[0, 0]  # [T, T]
        host = torch.cat([torch.tensor([[pending] + prop.tokens, [0] + prop.depths]), anc.long()])  # [2 + T, T]
        dev = host.to(self.device)
        mask = torch.cat([pos.all_true[0, 0, :, :past].expand(t, past), dev[2:].bool()], dim=1)
        return dev[0:1], dev[1:2] + past, mask[None, None]

    # ------------------------------------------------------------------ speculative

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, steps: int | None = None, tree: tuple | None = None,
                 temperature: float = 0.0, eos_token_ids=(), generator=None) -> GenResult:
        """Speculative decoding of one prompt (input_ids: list or [1, T]); `steps` = chain length k, or
        `tree` = (topk, depth, total).

        A greedy chain cycle reads the device once: its k draft tokens and the target's k + 1 argmax
        together; everything else it needs (positions, masks, the accepted tokens for the draft's
        rebuild) stays on the device. A tree cycle reads once per tree level and copies its inputs once.
        """
        if self.draft is None:
            raise ValueError("this engine has no draft; use plain_generate")
        if (steps is None) == (tree is None):
            raise ValueError("give exactly one of steps=K (chain) or tree=(topk, depth, total)")
        prompt = self._ids(input_ids)
        eos = set(int(e) for e in eos_token_ids)
        if self.method == "dflash":
            block = self.draft.cfg.block_size
            if tree is not None:
                raise ValueError(f"tree={tuple(tree)}: a DFlash draft proposes one chain per cycle (its block); "
                                 f"DFlash defines no tree: use steps=K, 1 <= K <= {block - 1}")
            if not 1 <= steps <= block - 1:
                raise ValueError(f"steps={steps}: a DFlash draft of block_size {block} guesses 1..{block - 1} "
                                 f"tokens per cycle")
            if self.static and temperature == 0:
                return self._static(prompt, max_new_tokens, eos, steps, None)
            with varying_shape_attention():
                return self._dflash(prompt, max_new_tokens, steps, temperature, eos, generator)
        if self.static and temperature == 0:
            return self._static(prompt, max_new_tokens, eos, steps, tree)
        with varying_shape_attention():
            return self._dynamic(prompt, max_new_tokens, steps, tree, temperature, eos, generator)

    def _prefill(self, prompt: torch.Tensor, capacity: int, temperature: float, generator):
        """The target's pass over the prompt into a new cache of `capacity` -> (cache, positions, the prompt's aux
        states [n, A*H], the first new token [1] on the device)."""
        n = prompt.shape[1]
        cache = self.runner.new_cache(capacity)
        pos = Positions(capacity, self.device)
        logits, aux = self.runner.forward(cache, prompt, pos.at(0, n), pos.causal(0, n), last_only=True)
        cache.advance(n)
        return cache, pos, aux, sample_token(logits[-1], temperature, generator, on_device=True)

    def _dynamic(self, prompt: torch.Tensor, max_new_tokens: int, steps: int | None, tree: tuple | None,
                 temperature: float, eos: set[int], generator) -> GenResult:
        """`generate` with growing caches and eager passes: sampling, and greedy decoding without `static`."""
        n = prompt.shape[1]
        width = steps if steps is not None else max(tree[1], tree[2])  # verify width, draft positions
        res = GenResult(tokens=[])
        self.runner.attach()
        try:
            self._sync()
            t0 = time.perf_counter()
            cache, pos, aux, pending_dev = self._prefill(prompt, n + max_new_tokens + width + 2, temperature, generator)
            pending = int(pending_dev)
            res.tokens.append(pending)
            hidden, dlogits, dcache = self._draft_forward(aux, torch.cat([prompt[0, 1:], pending_dev]), pos.at(0, n),
                                                          None)
            d2t = self._d2t_host() if tree is not None else None
            self._sync()
            res.prefill_s = time.perf_counter() - t0
            while not _finished(res.tokens, max_new_tokens, eos):
                big_n = cache.length
                t1 = time.perf_counter()
                if steps is not None:
                    proposal, dcache, fed = draft_chain(self.draft, dcache, hidden, dlogits, pos.at(big_n, steps),
                                                        steps)
                    feed = torch.cat([pending_dev, proposal]).view(1, -1)
                    positions, mask = pos.at(big_n, steps + 1), pos.causal(big_n, steps + 1)
                else:
                    proposal, dcache = draft_tree(self.draft, dcache, hidden, dlogits, pos.at(big_n, tree[1]), *tree,
                                                  d2t=d2t)
                    fed = proposal.num_fed
                    feed, positions, mask = self._tree_inputs(pending, proposal, big_n, pos)
                self.draft_forward_tokens += fed
                self._split_sync()
                t2 = time.perf_counter()
                logits, aux = self.runner.forward(cache, feed, positions, mask)
                tokens, path, bonus, best = _accept(logits, steps, proposal, temperature, generator)
                rows = [0] + [i + 1 for i in path]
                cache.keep(rows)
                self._split_sync()
                t3 = time.perf_counter()
                accepted = [tokens[i] for i in path]
                before = len(res.tokens)
                res.tokens.extend(accepted + [bonus])
                res.num_cycles += 1
                res.accepted_per_cycle.append(len(path))
                res.accepted_depths.append(steps if steps is not None else max(proposal.depths))
                res.target_tokens_per_cycle.append(feed.shape[1])
                pending = bonus
                if _finished(res.tokens, max_new_tokens, eos, before):
                    res.draft_s += t2 - t1
                    res.verify_s += t3 - t2
                    res.draft_tokens_per_cycle.append(fed)
                    break
                kept, pending_dev, aux_kept = self._rebuild_inputs(best, aux, len(path), rows, accepted + [bonus],
                                                                   chain=steps is not None)
                dcache = crop_cache(dcache, big_n)  # by length: the rebuild overwrites the drafted entries
                hidden, dlogits, dcache = self._draft_forward(aux_kept, kept, pos.at(big_n, len(rows)), dcache)
                self._split_sync()
                res.draft_s += (t2 - t1) + (time.perf_counter() - t3)
                res.verify_s += t3 - t2
                res.draft_tokens_per_cycle.append(fed + len(rows))
            self._sync()
            res.total_s = time.perf_counter() - t0
        finally:
            self.runner.detach()
        res.tokens = _cut(res.tokens, max_new_tokens, eos)
        return res

    def _dflash(self, prompt: torch.Tensor, max_new_tokens: int, steps: int, temperature: float, eos: set[int],
                generator) -> GenResult:
        """DFlash chain decoding: with N committed tokens (target cache and draft context 0..N-1) and the pending
        x_N, one draft forward over the block anchored at x_N guesses x_{N+1..N+k}; one causal target pass
        verifies [x_N, guesses]; the target states of x_N and the accepted guesses join the context."""
        from eyas.draft.dflash import DFlashContext, propose_block

        n = prompt.shape[1]
        res = GenResult(tokens=[])
        block = self.draft.cfg.block_size
        self.runner.attach()
        try:
            self._sync()
            t0 = time.perf_counter()
            cache, pos, aux, pending_dev = self._prefill(prompt, n + max_new_tokens + steps + 2, temperature, generator)
            res.tokens.append(int(pending_dev))
            context = self.context = DFlashContext(self.draft)
            context.append(aux, pos.at(0, n))  # the prompt's features: positions 0..n-1
            self.draft_forward_tokens += n
            self._sync()
            res.prefill_s = time.perf_counter() - t0
            while not _finished(res.tokens, max_new_tokens, eos):
                big_n = cache.length
                assert context.length == big_n, (context.length, big_n)
                t1 = time.perf_counter()
                proposal = propose_block(self.draft, context, pending_dev, big_n, steps)  # [k] target ids
                feed = torch.cat([pending_dev, proposal]).view(1, -1)
                self.draft_forward_tokens += block
                self._split_sync()
                t2 = time.perf_counter()
                logits, aux = self.runner.forward(cache, feed, pos.at(big_n, steps + 1), pos.causal(big_n, steps + 1))
                tokens, path, bonus, best = _accept(logits, steps, proposal, temperature, generator)
                a = len(path)
                cache.advance(a + 1)  # a chain's path is rows 1..a: x_N and the accepted guesses are in place
                self._split_sync()
                t3 = time.perf_counter()
                before = len(res.tokens)
                res.tokens.extend(tokens[:a] + [bonus])
                res.num_cycles += 1
                res.accepted_per_cycle.append(a)
                res.accepted_depths.append(steps)
                res.target_tokens_per_cycle.append(steps + 1)
                res.verify_s += t3 - t2
                if _finished(res.tokens, max_new_tokens, eos, before):
                    res.draft_s += t2 - t1
                    res.draft_tokens_per_cycle.append(block)
                    break
                context.append(aux[:a + 1], pos.at(big_n, a + 1))
                self.draft_forward_tokens += a + 1
                pending_dev = best[a:a + 1] if best is not None else self._ids([bonus])[0]
                self._split_sync()
                res.draft_s += (t2 - t1) + (time.perf_counter() - t3)
                res.draft_tokens_per_cycle.append(block + a + 1)  # the block's queries, the context's new rows
            self._sync()
            res.total_s = time.perf_counter() - t0
        finally:
            self.runner.detach()
        res.tokens = _cut(res.tokens, max_new_tokens, eos)
        return res

    def _rebuild_inputs(self, best, aux: torch.Tensor, a: int, rows: list[int], new: list[int], chain: bool):
        """What the draft's rebuild is fed after a cycle that kept `rows` of the verify input (a accepted drafts)
        and added the tokens `new` -> (tokens [a + 1], the pending token [1], aux states [a + 1, A*H])."""
        if best is not None:  # a greedy chain: accepted + bonus = the target's argmax rows 0..a
            return best[:len(rows)], best[a:len(rows)], aux[:len(rows)]
        kept = self._ids(new)[0]
        return kept, kept[-1:], aux[:len(rows)] if chain else aux[rows]

    def _static(self, prompt: torch.Tensor, max_new_tokens: int, eos: set[int], steps: int | None,
                tree: tuple | None) -> GenResult:
        res = GenResult(tokens=[])
        n = prompt.shape[1]
        self.runner.attach()
        try:
            if steps is not None:
                dec = self._static_decoder(chain_capacity(n, max_new_tokens, steps))
                dec._chain_buffers(steps)  # captured before the clock starts (once per chain length)
            else:
                dec = self._static_decoder(tree_capacity(n, max_new_tokens, *tree))
                dec._tree_buffers(*tree)  # captured before the clock starts (once per tree shape)
            dec.ready_prefill(n, with_draft=True)  # and the prefill (once per padded length)
            self._sync()
            t0 = time.perf_counter()
            if steps is not None:
                dec.chain(prompt, max_new_tokens, steps, eos, res, self.sync_timing)
            else:
                dec.tree(prompt, max_new_tokens, tuple(tree), eos, res, self.sync_timing)
            self._sync()
            res.total_s = time.perf_counter() - t0
        finally:
            self.runner.detach()
        self.draft_forward_tokens += n + sum(res.draft_tokens_per_cycle)
        res.tokens = _cut(res.tokens, max_new_tokens, eos)
        return res

    # ------------------------------------------------------------------ plain

    @torch.no_grad()
    def plain_generate(self, input_ids, max_new_tokens: int, temperature: float = 0.0, eos_token_ids=(),
                       generator=None) -> GenResult:
        """Target-only decoding, one token per forward, with the same cache and forward code.

        The host reads token t only after it has queued the forward of token t + 1, so on a GPU the
        read overlaps that forward instead of leaving the device idle; when token t ends the text, the
        queued step is simply dropped (its cache entry is never committed).
        """
        prompt = self._ids(input_ids)
        eos = set(int(e) for e in eos_token_ids)
        n = prompt.shape[1]
        res = GenResult(tokens=[])
        if self.static and temperature == 0:
            dec = self._static_decoder(plain_capacity(n, max_new_tokens))
            dec._plain_buffers()  # captured before the clock starts
            dec.ready_prefill(n, with_draft=False)
            self._sync()
            t0 = time.perf_counter()
            dec.plain(prompt, max_new_tokens, eos, res)
        else:
            self._sync()
            t0 = time.perf_counter()
            with varying_shape_attention():
                self._plain_dynamic(prompt, max_new_tokens, temperature, eos, generator, res, t0)
        res.num_cycles = len(res.tokens) - 1
        res.accepted_per_cycle = [0] * res.num_cycles
        res.target_tokens_per_cycle = [1] * res.num_cycles
        self._sync()
        res.total_s = time.perf_counter() - t0
        res.verify_s = res.total_s - res.prefill_s
        return res

    def _plain_dynamic(self, prompt, max_new_tokens, temperature, eos, generator, res, t0) -> None:
        n = prompt.shape[1]
        capacity = n + max_new_tokens + 1
        cache = self.runner.new_cache(capacity)
        pos = Positions(capacity, self.device)
        logits, _ = self.runner.forward(cache, prompt, pos.at(0, n), pos.causal(0, n), last_only=True, aux=False)
        cache.advance(n)
        queued = [sample_token(logits[-1], temperature, generator, on_device=True)]  # device tokens not yet read
        self._sync()
        res.prefill_s = time.perf_counter() - t0
        while queued:
            if len(res.tokens) + len(queued) < max_new_tokens:
                big_n = cache.length
                logits, _ = self.runner.forward(cache, queued[-1].view(1, 1), pos.at(big_n, 1), pos.causal(big_n, 1),
                                                aux=False)
                cache.advance(1)
                queued.append(sample_token(logits[-1], temperature, generator, on_device=True))
            res.tokens.append(int(queued.pop(0)))
            if res.tokens[-1] in eos or len(res.tokens) >= max_new_tokens:
                break
