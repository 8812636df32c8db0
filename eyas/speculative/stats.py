"""Acceptance statistics of a benchmark run, and the per-position acceptance plot.

tau (acceptance length) of a cycle = accepted draft tokens + 1. Pooled tau = all tau / all cycles
(= tokens per target verification pass); per-request tau = the mean over requests of each request's
own pooled tau (a request = one prompt with all its turns). Peers mix the two up; we report both.
Acceptance at position i = share of cycles whose first i draft tokens were all accepted
(unconditional); `conditional` = the same given the first i-1 were.
"""

from __future__ import annotations

import math

from eyas.common import REPEAT_NGRAM, repeated_contexts  # REPEAT_NGRAM: the context that makes a cycle "in a repeat"


def position_acceptance(accepted: list[int], depth: int) -> tuple[list[float], list[float]]:
    """-> (unconditional [depth], conditional [depth]) acceptance rates per draft position."""
    n = max(1, len(accepted))
    reached = [sum(1 for a in accepted if a >= i) for i in range(depth + 1)]  # reached[0] = all cycles
    uncond = [reached[i] / n for i in range(1, depth + 1)]
    cond = [reached[i] / reached[i - 1] if reached[i - 1] else 0.0 for i in range(1, depth + 1)]
    return uncond, cond


def summarize(requests: list[dict], depth: int) -> dict:
    """requests: [{"accepted": [int per cycle], "num_tokens", "draft_s", "verify_s", "prefill_s", "total_s"}]."""
    accepted = [a for r in requests for a in r["accepted"]]
    cycles = len(accepted)
    per_request = [(sum(r["accepted"]) + len(r["accepted"])) / len(r["accepted"]) for r in requests if r["accepted"]]
    uncond, cond = position_acceptance(accepted, depth)
    tokens = sum(r["num_tokens"] for r in requests)
    total = sum(r["total_s"] for r in requests)
    return {
        "num_requests": len(requests),
        "num_tokens": tokens,
        "num_cycles": cycles,
        "tau_pooled": (sum(accepted) + cycles) / cycles if cycles else 0.0,
        "tau_per_request": sum(per_request) / len(per_request) if per_request else 0.0,
        "accept_at_position": uncond,
        "accept_at_position_conditional": cond,
        "draft_s": sum(r["draft_s"] for r in requests),
        "verify_s": sum(r["verify_s"] for r in requests),
        "prefill_s": sum(r["prefill_s"] for r in requests),
        "total_s": total,
        "tokens_per_s": tokens / total if total > 0 else 0.0,
    }


def repeat_split(tokens: list[int], accepted: list[int], n: int = REPEAT_NGRAM) -> tuple[list[int], list[int]]:
    """Each cycle's tau (accepted drafts + 1, as in tau_pooled) of one turn, split into (cycles whose n-token
    context repeats an n-gram that ended earlier in the turn's output, the other cycles). A small target
    decoding greedily falls into loops, and a draft predicts a loop almost perfectly: tau over repeats says
    little about tau elsewhere. The prefill commits the first token; each cycle its accepted drafts plus one
    token of the target's (the last cycle's may be cut by the token limit or the end of text)."""
    # the rule of eyas.common.repeated_contexts (training's held-out split uses it too), at every position up to
    # one past the last token: a cycle whose tokens were cut short still has a context there
    in_repeat = repeated_contexts(list(tokens) + [0], [True] * (len(tokens) + 1), n)
    repeat, fresh = [], []
    start = 1
    for a in accepted:
        (repeat if in_repeat[start] else fresh).append(a + 1)
        start = min(start + a + 1, len(tokens))
    return repeat, fresh


def repeat_summary(turns: list[dict], n: int = REPEAT_NGRAM) -> dict:
    """Over turns [{"tokens", "accepted"}]: the share of tokens (cycles x their tau) in repeats (repeat_split)
    and tau inside and outside them (None where there are no such cycles); with no repeats tau_elsewhere is
    tau_pooled."""
    repeat, fresh = [], []
    for t in turns:
        r, f = repeat_split(t["tokens"], t["accepted"], n)
        repeat += r
        fresh += f
    tokens = sum(repeat) + sum(fresh)
    return {"repeat_token_share": sum(repeat) / tokens if tokens else 0.0,
            "tau_in_repeats": sum(repeat) / len(repeat) if repeat else None,
            "tau_elsewhere": sum(fresh) / len(fresh) if fresh else None}


# a first differing token whose plain top-2 margin lies below max(NEAR_TIE_ABS, NEAR_TIE_REL * |top-1 logit|) is a
# near tie: a difference in rounding between the speculative and the plain pass can flip it
NEAR_TIE_ABS, NEAR_TIE_REL = 0.1, 0.005
NEAR_TIE_RULE = f"margin < max({NEAR_TIE_ABS}, {NEAR_TIE_REL} * |top-1 logit|)"


def first_difference(tokens: list[int], plain: list[int]) -> int | None:
    """The first position where a turn's tokens differ from plain decoding's (the shorter one's length when
    one is a prefix of the other); None when they are equal."""
    for i, (a, b) in enumerate(zip(tokens, plain)):
        if a != b:
            return i
    return None if len(tokens) == len(plain) else min(len(tokens), len(plain))


def is_near_tie(margin: float, top_logit: float) -> bool:
    return margin < max(NEAR_TIE_ABS, NEAR_TIE_REL * abs(top_logit))


def logit_steps(margin: float, top_logit: float, eps: float) -> float:
    """The margin in units of the spacing between representable values at the top-1 logit, for a float format of
    machine epsilon `eps` (bf16 2**-7: 0.125 between 16 and 32, 0.25 between 32 and 64). Logits computed in bf16 lie
    on that grid, so a margin of one or two steps is one or two roundings."""
    if top_logit == 0:
        return float("inf") if margin else 0.0
    return margin / (eps * 2.0 ** math.floor(math.log2(abs(top_logit))))


def margin_summary(divergences: list[dict]) -> dict:
    """The distribution of the plain path's top-2 margins at the first differing token of each turn that
    differs (bench.plain_divergence): count, min/median/max (None without any) and how many are near ties."""
    margins = sorted(d["margin"] for d in divergences if d.get("margin") is not None)
    n = len(margins)
    median = None if not n else margins[n // 2] if n % 2 else (margins[n // 2 - 1] + margins[n // 2]) / 2
    return {"count": len(divergences), "measured": n, "min": margins[0] if n else None, "median": median,
            "max": margins[-1] if n else None, "near_ties": sum(1 for d in divergences if d.get("near_tie")),
            "near_tie_rule": NEAR_TIE_RULE,
            # in steps of the logits' own format at the top-1 logit (plain_divergence's margin_steps)
            "max_steps": max(steps) if (steps := [d["margin_steps"] for d in divergences
                                                  if d.get("margin_steps") is not None]) else None,
            "within_2_steps": sum(1 for s in steps if s <= 2)}


def format_margins(m: dict) -> str:
    """One line for eval's output under the warning about turns that differ from plain decoding."""
    if not m["measured"]:
        return "  no margin measured at the first differing tokens"
    steps = (f"; {m['within_2_steps']} within 2 steps of the logits' format at the top-1 logit (largest "
             f"{m['max_steps']:.3g})" if m.get("max_steps") is not None else "")
    return (f"  first differing tokens: plain top-2 logit margin min {m['min']:.4g}, median {m['median']:.4g}, max "
            f"{m['max']:.4g} over {m['measured']} turns; {m['near_ties']} near ties ({m['near_tie_rule']}; "
            f"teacher-forced forward of the target on the plain prefix){steps}")


NGRAM_MIN, NGRAM_MAX = 1, 3  # the n-gram lengths n-gram lookup tries, longest first (vLLM's ngram defaults)


class NgramIndex:
    """Where each n-gram (n in min_n..max_n) of a growing token sequence last ended, for n-gram lookup
    (prompt-lookup decoding): the tokens that followed the latest earlier occurrence of the context's last
    n tokens are its guess of the next ones."""

    def __init__(self, seq: list[int], min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX):
        self.seq, self.min_n, self.max_n = seq, min_n, max_n
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> the end index of its latest indexed occurrence
        self.indexed = 0  # n-grams ending before this index are in `last`

    def propose(self, end: int, k: int) -> list[int]:
        """Up to k tokens after the latest occurrence, ending before end - 1, of the last n tokens of the context
        seq[:end] (the longest n that occurs), cut at the context's end; [] when none occurs. `end` must not
        decrease from call to call."""
        for j in range(self.indexed, end - 1):  # the context's own last n-grams are not earlier occurrences
            for n in range(self.min_n, min(self.max_n, j + 1) + 1):
                self.last[tuple(self.seq[j + 1 - n:j + 1])] = j
        self.indexed = max(self.indexed, end - 1)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            j = self.last.get(tuple(self.seq[end - n:end]))
            if j is not None:
                return self.seq[j + 1:min(j + 1 + k, end)]
        return []


def matched(guess: list[int], seq: list[int], at: int) -> int:
    """How many leading tokens of `guess` equal seq[at:] (a guessed chain's accepted length)."""
    a = 0
    while a < len(guess) and at + a < len(seq) and guess[a] == seq[at + a]:
        a += 1
    return a


def ngram_accepted(prompt: list[int], tokens: list[int], k: int, min_n: int = NGRAM_MIN,
                   max_n: int = NGRAM_MAX) -> list[int]:
    """Accepted guesses per cycle of greedy n-gram lookup with k tokens a cycle (no draft model) whose output
    is `tokens`: what the same target would accept from copying alone. As in the engine, the prefill makes
    the first token and a cycle adds its accepted guesses plus the target's next token; the last cycle is cut
    at the end of `tokens`."""
    seq, n0 = list(prompt) + list(tokens), len(prompt)
    index, made, accepted = NgramIndex(seq, min_n, max_n), 1, []
    while made < len(tokens):
        a = matched(index.propose(n0 + made, k), tokens, made)
        accepted.append(a)
        made += a + 1
    return accepted


def ngram_summary(turns: list[dict], plain_tokens: list[list[int]], k: int) -> dict:
    """tau of n-gram lookup with k tokens a cycle over the turns' contexts ("prompt_ids") and plain decoding's
    tokens for them: the baseline a draft has to beat (vLLM serves it as method "ngram")."""
    accepted = [a for t, out in zip(turns, plain_tokens) for a in ngram_accepted(t["prompt_ids"], out, k)]
    return {"ngram_k": k, "ngram_tau": (sum(accepted) + len(accepted)) / len(accepted) if accepted else None}


def plot_acceptance(summary: dict, title: str, path) -> None:
    """A bar chart of unconditional and conditional acceptance per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uncond, cond = summary["accept_at_position"], summary["accept_at_position_conditional"]
    xs = list(range(1, len(uncond) + 1))
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.bar([x - 0.2 for x in xs], uncond, width=0.4, label="accepted (all earlier too)")
    ax.bar([x + 0.2 for x in xs], cond, width=0.4, label="accepted | earlier accepted")
    ax.set_xlabel("draft position")
    ax.set_ylabel("rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(xs)
    ax.set_title(f"{title}: tau {summary['tau_pooled']:.2f} pooled, {summary['tau_per_request']:.2f} per request",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def format_summary(name: str, s: dict) -> str:
    pos = " ".join(f"{x:.2f}" for x in s["accept_at_position"])
    lines = [
        f"{name}: tau {s['tau_pooled']:.2f} pooled, {s['tau_per_request']:.2f} per request "
        f"({s['num_tokens']} tokens, {s['num_cycles']} cycles, {s['num_requests']} requests)",
        f"  acceptance by position: {pos}",
        f"  {s['tokens_per_s']:.1f} tok/s | " + (f"draft {s['draft_s']:.1f} s, verify {s['verify_s']:.1f} s, "
                                                 if s["draft_s"] or s["verify_s"] else
                                                 "draft/verify split not timed (cycles queued ahead), ")
        + f"prefill {s['prefill_s']:.1f} s",
    ]
    if s.get("tau_elsewhere") is not None and s.get("tau_in_repeats") is not None:
        lines.append(f"  {100 * s['repeat_token_share']:.0f} % of the tokens follow a context the answer already "
                     f"had: tau {s['tau_in_repeats']:.2f} there, {s['tau_elsewhere']:.2f} elsewhere")
    if s.get("ngram_tau") is not None:
        lines.append(f"  n-gram lookup alone ({s['ngram_k']} tokens a cycle, no draft) would accept tau "
                     f"{s['ngram_tau']:.2f} on the same turns")
    if "speedup_vs_plain" in s:
        line = f"  speedup {s['speedup_vs_plain']:.2f}x vs plain decoding ({s['plain_tokens_per_s']:.1f} tok/s)"
        if "speedup_vs_hf" in s:
            line += f", {s['speedup_vs_hf']:.2f}x vs transformers generate ({s['hf_tokens_per_s']:.1f} tok/s)"
        lines.append(line)
    return "\n".join(lines)
