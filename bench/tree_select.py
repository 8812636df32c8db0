"""Tree shapes and selection rules for a trained draft, judged on the target's own greedy tokens.

    python bench/tree_select.py --draft DRAFT --bench humaneval --trees 16,5,64 16,6,80 --penalties 0,0.25

At temperature 0 the engine gives plain greedy decoding's tokens, so the tree drafted at a cycle that starts
after N committed tokens can be judged by the next tokens of that output: a node is accepted when its path
from the root spells them (the target's argmax rows the engine's walk would read). Per request the target
decodes once (plain, a few tokens past the limit so the last cycle can be judged), then runs once over
prompt + answer for the aux features; the draft runs once over the whole sequence, teacher-forced, which
makes the cache entries the engine's rebuilds make. A simulated cycle then costs the tree drafting alone,
and it uses the engine's own code (`tree_pool`, `select_tree`, `walk_greedy`). Every rule over one (topk,
depth) reuses its candidate pool at N.

Rules: `total` nodes kept (the tree's third number), and a depth penalty: a node's score is its cumulative
draft log-prob minus penalty x depth (0 is EAGLE-2's rule and the engine's), capped by its parent's so the
kept set stays closed under ancestors. A positive penalty moves kept nodes from deep, unlikely paths to
shallow alternatives at the same count of verified tokens; a negative one the other way. `--tails` hangs a
greedy chain of that many draft tokens under the pool's best node at the last level (when the tree kept it):
one 1-row draft step and one verified token per chain token, against a whole level of `topk` rows.

`--lookups LENGTH:MIN_N:MAX_N` merges a prompt-lookup chain into the tree (as n-gram speculation does alone):
the LENGTH tokens that followed the latest earlier occurrence of the context's last n tokens (the longest n
from MAX_N down to MIN_N that occurs), as one more path from the root; nodes it shares with the tree are not
counted twice. The walk accepts the longest matching path of either. `--trees none` leaves the lookup alone.
Not an engine feature: it measures how much of a turn plain copying would give (SmolLM2 loops).

`--check N` decodes the first N requests with the engine itself (dynamic path, same draft and shapes, no
penalty) and prints its tau beside the simulation's: they agree unless fp32 rounding flips a near tie between
the teacher-forced and the incremental draft cache.

Prints per rule: tau pooled (accepted + 1 per cycle, as `eyas eval`), cycles, the share of cycles whose
accepted path reached the tree's depth, the lookup nodes added per cycle, and tau after a repeated 8-token
context and elsewhere (`eyas eval`'s split). `--by-token` adds the draft's first guess at every answer position
(teacher-forced, the tree root's best child) by the class of the token to guess: whitespace, punctuation, a
token already in the context, or a new one.
"""

from __future__ import annotations

import argparse
import time

import torch

from eyas.speculative.build import build_engine
from eyas.data.template import stop_token_ids
from eyas.speculative.accept import walk_greedy
from eyas.speculative.bench import encode_turn, load_bench, parse_tree
from eyas.speculative.drafting import Pool, Proposal, kept_order, select_tree, tree_pool
from eyas.speculative.stats import NgramIndex, matched, repeat_split
from eyas.speculative.target import Positions, causal_mask
from eyas.target import load_target


def _penalised(pool: Pool, penalty: float) -> Pool:
    """Scores minus penalty x depth; a negative penalty (a bonus for depth) could rank a child above its
    parent, so each score is capped by its parent's (the pool lists parents before children)."""
    if not penalty:
        return pool
    scores: list[float] = []
    for s, d, parent in zip(pool.scores, pool.depths, pool.parents):
        s -= penalty * d
        scores.append(s if parent < 0 else min(s, scores[parent]))
    return Pool(scores, pool.depths, pool.parents, pool.ids, pool.num_fed, pool.last)


def _chain(draft, pool: Pool, cache, past: int, positions, tail: int) -> tuple[int, list[int]]:
    """(pool index of the best node at the pool's last level, `tail` greedy draft ids after it): the leaf is fed
    with its parent's hidden output, seeing the committed past, its expanded ancestors and itself; each next
    token likewise, its chain included."""
    if not tail or pool.last is None:
        return -1, []
    frontier, hidden, slot_of = pool.last
    depth = max(pool.depths)
    leaf = max((i for i, d in enumerate(pool.depths) if d == depth), key=lambda i: (pool.scores[i], -i))
    seen, a = [], pool.parents[leaf]
    while a >= 0:
        seen.append(past + slot_of[a])
        a = pool.parents[a]
    h, tok, length, ids = hidden[:, frontier.index(pool.parents[leaf])][:, None], pool.ids[leaf], past + len(slot_of), []
    for j in range(tail):
        mask = torch.zeros(1, length + 1, dtype=torch.bool)
        mask[:, :past] = True
        mask[0, seen + [length]] = True
        out = draft(h, draft.to_target_ids(torch.tensor([tok])).view(1, 1), positions[:, depth - 1 + j:depth + j],
                    past_key_values=cache, attention_mask=mask[None, None])
        cache, h = out.past_key_values, out.hidden_out[:, -1:]
        seen.append(length)
        length += 1
        tok = int(out.logits[0, -1].argmax())
        ids.append(tok)
    return leaf, ids


def _with_tail(prop: Proposal, pool: Pool, total: int, leaf: int, chain: list[int], d2t) -> Proposal:
    """The proposal with the chain hung under its leaf, if the leaf was kept."""
    if not chain:
        return prop
    order = kept_order(pool, total)  # the proposal's nodes as pool indices
    if leaf not in order:
        return prop
    at, depth = order.index(leaf), pool.depths[leaf]
    tokens = prop.tokens + [t + (d2t[t] if d2t else 0) for t in chain]
    parents = prop.parents + [at] + [len(prop.tokens) + j for j in range(len(chain) - 1)]
    depths = prop.depths + [depth + 1 + j for j in range(len(chain))]
    return Proposal(tokens, parents, depths, prop.num_fed + len(chain))


def _shared(prop: Proposal, chain: list[int]) -> int:
    """How many leading tokens of `chain` the proposal already holds as a path from the root."""
    parent, k = -1, 0
    for t in chain:
        nxt = next((i for i, (u, p) in enumerate(zip(prop.tokens, prop.parents)) if p == parent and u == t), None)
        if nxt is None:
            break
        parent, k = nxt, k + 1
    return k


class Request:
    """One turn: its prompt, the greedy continuation, and the draft's teacher-forced state over both."""

    def __init__(self, engine, prompt: list[int], answer: list[int], tail: int = 0):
        self.n, self.seq = len(prompt), prompt + answer
        runner, draft = engine.runner, engine.draft
        ids = torch.tensor([self.seq])
        m = len(self.seq) - 1  # the last token has no next token to pair with its features
        pos = Positions(len(self.seq) + 64, engine.device)  # room for the positions of a deep tree at the end
        runner.attach()
        try:
            cache = runner.new_cache(len(self.seq))
            _, aux = runner.forward(cache, ids[:, :m], pos.at(0, m), causal_mask(0, m, engine.device))
        finally:
            runner.detach()
        with torch.no_grad():
            out = draft(draft.fuse(aux)[None], ids[:, 1:m + 1], pos.at(0, m))
        self.hidden, self.logits, self.kv = out.hidden_out, out.logits[0], out.past_key_values
        self.pos = pos
        self.pools: dict[tuple[int, int, int], tuple[Pool, tuple[int, list[int]]]] = {}
        self.tail = tail  # chain tokens computed under each pool's best leaf (the longest tail asked)

    def pool(self, draft, big_n: int, topk: int, depth: int) -> tuple[Pool, tuple[int, list[int]]]:
        """The candidates of a tree drafted after big_n committed tokens (entry big_n - 1 is the root), and a
        greedy chain of `self.tail` draft ids continuing the pool's best node at the last level (its pool index)."""
        key, tail = (big_n, topk, depth), self.tail
        if key not in self.pools:
            k, v = self.kv
            cache = (k[:, :, :big_n], v[:, :, :big_n])  # a tuple is copied on its first append, never written
            positions = self.pos.at(big_n, depth + tail)
            with torch.no_grad():
                pool, cache = tree_pool(draft, cache, self.hidden[:, big_n - 1:big_n], self.logits[big_n - 1],
                                        positions, topk, depth)
                self.pools[key] = pool, _chain(draft, pool, cache, big_n, positions, tail)
        return self.pools[key]

    def simulate(self, draft, d2t, tree: tuple[int, int, int], penalty: float, max_new: int, eos: set[int],
                 tail: int = 0, lookup: tuple[int, int, int] = (0, 0, 0), extra: list[int] | None = None):
        """-> accepted drafts per cycle, as the engine's greedy tree decoding would have them. With `lookup`
        (length, min n, max n) a prompt-lookup chain is merged into the tree as a path from the root (a trie:
        the walk accepts the longest matching path); `extra` collects the nodes it adds per cycle."""
        topk, depth, total = tree
        big_n, made, accepted = self.n, 1, []  # the prefill made the first token (pending at n)
        index = NgramIndex(self.seq, lookup[1], lookup[2]) if lookup[0] else None
        if self.seq[self.n] in eos:
            return accepted
        while made < max_new:
            if total:
                pool, (leaf, chain) = self.pool(draft, big_n, topk, depth)
                pool = _penalised(pool, penalty)
                prop = _with_tail(select_tree(pool, total, d2t), pool, total, leaf, chain[:tail], d2t)
            else:  # no tree: the lookup chain alone (prompt-lookup decoding)
                prop = Proposal([], [], [])
            best = [self.seq[big_n + 1 + d] if big_n + 1 + d < len(self.seq) else -1 for d in [0] + prop.depths]
            path, _ = walk_greedy(best, prop.tokens, prop.parents)
            a = len(path)
            if lookup[0]:
                chain = index.propose(big_n + 1, lookup[0])  # the context: seq[:big_n + 1], the pending token last
                if extra is not None:
                    extra.append(len(chain) - _shared(prop, chain))
                a = max(a, matched(chain, self.seq, big_n + 1))  # the trie's walk takes the longer match
            accepted.append(a)
            new = self.seq[big_n + 1:big_n + 2 + a]
            made += a + 1
            big_n += a + 1
            if any(t in eos for t in new):
                break
        return accepted


def token_classes(requests: list[Request], tok, d2t, max_new: int) -> dict[str, list[int]]:
    """The draft's first guess at each answer position (the tree root's best child, teacher-forced) by the
    class of the token it had to guess: whitespace (indentation, newlines), punctuation, a token already in
    the context (copyable), or new. -> {class: [right, count]}."""
    out = {c: [0, 0] for c in ("whitespace", "punctuation", "in the context", "new")}
    for r in requests:
        for big_n in range(r.n, min(len(r.seq) - 1, r.n + max_new)):
            want = r.seq[big_n + 1]
            text = tok.decode([want])
            if not text.strip():
                cls = "whitespace"
            elif not any(ch.isalnum() for ch in text):
                cls = "punctuation"
            else:
                cls = "in the context" if want in r.seq[:big_n + 1] else "new"
            guess = int(r.logits[big_n - 1].argmax())
            guess += d2t[guess] if d2t else 0
            out[cls][0] += guess == want
            out[cls][1] += 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", required=True, help="a run's train dir, a checkpoint or an export")
    p.add_argument("--bench", action="append", default=[], help="mt-bench | humaneval | FILE.jsonl (repeatable)")
    p.add_argument("--limit", type=int, default=12, help="requests per benchmark (the full preset's eval: 12)")
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--trees", nargs="+", default=["16,5,64"],
                   help="topk,depth,total shapes; none: no tree (with --lookups: prompt lookup alone)")
    p.add_argument("--penalties", default="0", help="comma list of depth penalties (nats per level)")
    p.add_argument("--tails", default="0", help="comma list of chain lengths hung under the best deepest node")
    p.add_argument("--lookups", default="0",
                   help="comma list of prompt-lookup chains LENGTH:MIN_N:MAX_N merged into the tree (0: none)")
    p.add_argument("--check", type=int, default=0, help="also decode the first N requests with the engine")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--by-token", action="store_true",
                   help="also the draft's first guess by the class of the token to guess (teacher-forced)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("smollm2", device="cpu", dtype="fp32")
    engine, _ = build_engine(target, args.draft)
    draft, d2t, tok = engine.draft, engine._d2t_host(), target.tokenizer
    eos = stop_token_ids(tok, getattr(target.model, "generation_config", None))
    trees = [parse_tree(t) if t != "none" else (0, 0, 0) for t in args.trees]
    penalties = [float(x) for x in args.penalties.split(",")]
    tails = [int(x) for x in args.tails.split(",")]
    lookups = [tuple(int(v) for v in (x.split(":") + ["1", "3"])[:3]) if x != "0" else (0, 0, 0)
               for x in args.lookups.split(",")]
    extra = max([t[1] for t in trees] + [lk[0] for lk in lookups]) + max(tails) + 2
    rows = []
    for bench in args.bench or ["humaneval"]:
        t0 = time.perf_counter()
        requests: list[Request] = []
        for req in load_bench(bench, args.limit):
            history = []
            for text in req["turns"]:
                history.append({"role": "user", "content": text})
                ids = encode_turn(tok, history)
                res = engine.plain_generate(ids, args.max_new + extra, eos_token_ids=eos)
                requests.append(Request(engine, ids, res.tokens, max(tails)))
                shown = res.tokens[:args.max_new]
                shown = shown[:next((i + 1 for i, t in enumerate(shown) if t in eos), len(shown))]
                history.append({"role": "assistant", "content": tok.decode(shown, skip_special_tokens=True)})
        print(f"{bench}: {len(requests)} turns decoded and scored in {time.perf_counter() - t0:.0f} s", flush=True)
        if args.by_token:
            classes = token_classes(requests, tok, d2t, args.max_new)
            total = sum(n for _, n in classes.values())
            print(f"  first guess (root's best child), {total} positions: " + "; ".join(
                f"{c} {100 * n / total:.0f} % of tokens, right {100 * k / max(n, 1):.1f} %" for c, (k, n) in classes.items()))
        for tree in trees:
            for penalty, tail, look in [(pen, t, lk) for pen in penalties for t in tails for lk in lookups]:
                t1, added, acc, rep, fresh = time.perf_counter(), [], [], [], []
                for r in requests:
                    got = r.simulate(draft, d2t, tree, penalty, args.max_new, set(eos), tail, look, added)
                    acc += got
                    split = repeat_split(r.seq[r.n:r.n + args.max_new], got)
                    rep, fresh = rep + split[0], fresh + split[1]
                deep = sum(a >= tree[1] for a in acc) / max(1, len(acc))
                name = ":".join(map(str, look)) if look[0] else "-"
                rows.append((bench, ",".join(map(str, tree)), penalty, tail, name, (sum(acc) + len(acc)) / max(1, len(acc)),
                             len(acc), deep, sum(added) / max(1, len(added)),
                             f"{sum(rep) / max(1, len(rep)):.2f} / {sum(fresh) / max(1, len(fresh)):.2f}"))
                print(f"  tree {rows[-1][1]} penalty {penalty} tail {tail} lookup {name}: tau {rows[-1][5]:.3f} over "
                      f"{len(acc)} cycles, {rows[-1][8]:.2f} lookup nodes added a cycle "
                      f"({time.perf_counter() - t1:.0f} s)", flush=True)
        for tree in trees[:1] if args.check else []:
            sim, real = [], []
            for r in requests[:args.check]:
                sim += r.simulate(draft, d2t, tree, 0.0, args.max_new, set(eos))
                res = engine.generate(r.seq[:r.n], args.max_new, tree=tree, eos_token_ids=eos)
                real += res.accepted_per_cycle
            print(f"  check, tree {tree}, first {args.check} turns: simulated tau {(sum(sim) + len(sim)) / len(sim):.3f} "
                  f"over {len(sim)} cycles, engine {(sum(real) + len(real)) / len(real):.3f} over {len(real)}")
    print("\n| benchmark | tree | depth penalty | tail | lookup | tau (pooled) | cycles | cycles reaching the depth "
          "| lookup nodes added | tau after a repeated context / elsewhere |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for bench, tree, penalty, tail, look, tau, cycles, deep, added, split in rows:
        print(f"| {bench} | {tree} | {penalty:g} | {tail} | {look} | {tau:.3f} | {cycles} | {100 * deep:.0f} % "
              f"| {added:.2f} | {split} |")


if __name__ == "__main__":
    main()
