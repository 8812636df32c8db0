"""SpecEngine: EAGLE-3 speculative decoding (chain or dynamic tree), and plain decoding with the same code.

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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eyas.spec.accept import accept_greedy, accept_sample, sample_token
from eyas.spec.drafting import draft_chain, draft_tree
from eyas.spec.target import TargetRunner, causal_mask, tree_mask


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


def _finished(tokens: list[int], max_new: int, eos: set[int]) -> bool:
    return len(tokens) >= max_new or any(t in eos for t in tokens)


def _cut(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


class SpecEngine:
    """A target model plus an EAGLE-3 draft (Eagle3Draft or anything with its interface)."""

    def __init__(self, target_model, draft=None, aux_layers: list[int] | None = None):
        self.model = target_model
        self.draft = draft
        self.runner = TargetRunner(target_model, aux_layers if draft is not None else None)
        self.device = next(target_model.parameters()).device
        first = next(iter(draft.parameters()), None) if draft is not None else None
        self.draft_dtype = first.dtype if first is not None else None  # scripted drafts have no parameters
        self.draft_forward_tokens = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _ids(self, tokens) -> torch.Tensor:
        return torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(1, -1)

    def _draft_forward(self, aux, tokens, start: int, cache):
        """Feed (fuse(aux_t), token_{t+1}) at positions start.. and return (hidden [1,1,H], logits [Vd], cache)."""
        hidden = self.draft.fuse(aux.to(self.draft_dtype) if self.draft_dtype is not None else aux)[None]
        ids = self._ids(tokens)
        pos = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        out = self.draft(hidden, ids, pos, past_key_values=cache)
        self.draft_forward_tokens += ids.shape[1]
        return out.hidden_out[:, -1:], out.logits[0, -1], out.past_key_values

    # ------------------------------------------------------------------ speculative

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, steps: int | None = None, tree: tuple | None = None,
                 temperature: float = 0.0, eos_token_ids=(), generator=None) -> GenResult:
        """Speculative decoding of one prompt (input_ids: list or [1, T]); `steps` = chain length k, or
        `tree` = (topk, depth, total)."""
        if self.draft is None:
            raise ValueError("this engine has no draft; use plain_generate")
        if (steps is None) == (tree is None):
            raise ValueError("give exactly one of steps=K (chain) or tree=(topk, depth, total)")
        prompt = self._ids(input_ids)
        eos = set(int(e) for e in eos_token_ids)
        n = prompt.shape[1]
        width = steps if steps is not None else tree[2]
        res = GenResult(tokens=[])
        self.runner.attach()
        try:
            self._sync()
            t0 = time.perf_counter()
            cache = self.runner.new_cache(n + max_new_tokens + width + 2)
            logits, aux = self.runner.forward(cache, prompt, torch.arange(n, device=self.device)[None],
                                              causal_mask(0, n, self.device), last_only=True)
            cache.advance(n)
            pending = sample_token(logits[-1], temperature, generator)
            res.tokens.append(pending)
            hidden, dlogits, dcache = self._draft_forward(aux, prompt[0, 1:].tolist() + [pending], 0, None)
            self._sync()
            res.prefill_s = time.perf_counter() - t0
            while not _finished(res.tokens, max_new_tokens, eos):
                big_n = cache.length
                t1 = time.perf_counter()
                if steps is not None:
                    prop, dcache = draft_chain(self.draft, dcache, hidden, dlogits, big_n, steps)
                else:
                    prop, dcache = draft_tree(self.draft, dcache, hidden, dlogits, big_n, *tree)
                self.draft_forward_tokens += prop.num_fed
                self._sync()
                t2 = time.perf_counter()
                feed = [pending] + prop.tokens
                pos = torch.tensor([[0] + prop.depths], device=self.device) + big_n
                mask = causal_mask(big_n, len(feed), self.device) if steps is not None else \
                    tree_mask(big_n, [-1] + [p + 1 for p in prop.parents], self.device)
                logits, aux = self.runner.forward(cache, self._ids(feed), pos, mask)
                if temperature > 0:
                    path, bonus = accept_sample(logits, prop.tokens, prop.parents, temperature, generator)
                else:
                    path, bonus = accept_greedy(logits, prop.tokens, prop.parents)
                rows = [0] + [i + 1 for i in path]
                cache.keep(rows)
                self._sync()
                t3 = time.perf_counter()
                accepted = [prop.tokens[i] for i in path]
                res.tokens.extend(accepted + [bonus])
                res.num_cycles += 1
                res.accepted_per_cycle.append(len(path))
                res.accepted_depths.append(max(prop.depths))
                res.target_tokens_per_cycle.append(len(feed))
                pending = bonus
                if _finished(res.tokens, max_new_tokens, eos):
                    res.draft_s += t2 - t1
                    res.verify_s += t3 - t2
                    res.draft_tokens_per_cycle.append(prop.num_fed)
                    break
                dcache = (dcache[0][:, :, :big_n], dcache[1][:, :, :big_n])
                hidden, dlogits, dcache = self._draft_forward(aux[rows], accepted + [bonus], big_n, dcache)
                self._sync()
                res.draft_s += (t2 - t1) + (time.perf_counter() - t3)
                res.verify_s += t3 - t2
                res.draft_tokens_per_cycle.append(prop.num_fed + len(rows))
            res.total_s = time.perf_counter() - t0
        finally:
            self.runner.detach()
        res.tokens = _cut(res.tokens, max_new_tokens, eos)
        return res

    # ------------------------------------------------------------------ plain

    @torch.no_grad()
    def plain_generate(self, input_ids, max_new_tokens: int, temperature: float = 0.0, eos_token_ids=(),
                       generator=None) -> GenResult:
        """Target-only decoding, one token per forward, with the same cache and forward code."""
        prompt = self._ids(input_ids)
        eos = set(int(e) for e in eos_token_ids)
        n = prompt.shape[1]
        res = GenResult(tokens=[])
        self._sync()
        t0 = time.perf_counter()
        cache = self.runner.new_cache(n + max_new_tokens + 1)
        logits, _ = self.runner.forward(cache, prompt, torch.arange(n, device=self.device)[None],
                                        causal_mask(0, n, self.device), last_only=True, aux=False)
        cache.advance(n)
        res.tokens.append(sample_token(logits[-1], temperature, generator))
        self._sync()
        res.prefill_s = time.perf_counter() - t0
        while not _finished(res.tokens, max_new_tokens, eos):
            t1 = time.perf_counter()
            big_n = cache.length
            logits, _ = self.runner.forward(cache, self._ids(res.tokens[-1:]), torch.tensor([[big_n]], device=self.device),
                                            causal_mask(big_n, 1, self.device), aux=False)
            cache.advance(1)
            res.tokens.append(sample_token(logits[-1], temperature, generator))
            res.num_cycles += 1
            res.accepted_per_cycle.append(0)
            res.target_tokens_per_cycle.append(1)
            self._sync()
            res.verify_s += time.perf_counter() - t1
        res.total_s = time.perf_counter() - t0
        res.tokens = _cut(res.tokens, max_new_tokens, eos)
        return res
