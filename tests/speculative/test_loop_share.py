"""eyas.speculative.stats.repeat_split (eval summaries) and bench/loop_share.py: cycles split by whether their
context repeats earlier output."""

import importlib.util
from pathlib import Path

from eyas.speculative.stats import NgramIndex, format_summary, ngram_accepted, ngram_summary, repeat_summary, repeat_split

_spec = importlib.util.spec_from_file_location("loop_share", Path(__file__).resolve().parents[2] / "bench" / "loop_share.py")
loop_share = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loop_share)


def test_cycles_after_a_repeated_context_count_as_repeats():
    # the prefill commits token 0; then cycles of 3, 3, 3, 3 tokens over "1 2 3" said four times
    tokens = [0] + [1, 2, 3] * 4
    repeat, fresh = repeat_split(tokens, [2, 2, 2, 2], n=3)
    # contexts: [0] (short), [1 2 3] (first time), [1 2 3] (seen), [1 2 3] (seen)
    assert fresh == [3, 3] and repeat == [3, 3]


def test_a_context_is_not_its_own_earlier_occurrence_and_a_cut_cycle_keeps_its_tau():
    tokens = [0, 5, 6, 7, 8, 9]
    repeat, fresh = repeat_split(tokens, [1, 1, 4], n=2)
    # cycles commit 2, 2 and (cut by the token limit) 1, with tau 2, 2 and 5 as tau_pooled counts them;
    # no 2-gram occurs twice
    assert repeat == [] and fresh == [2, 2, 5]


def test_the_summary_of_a_result_file(tmp_path):
    path = tmp_path / "mt-bench-chain-3.json"
    turn = {"tokens": [0] + [1, 2, 3] * 4, "accepted": [2, 2, 2, 2]}
    path.write_text('{"prompts": [{"turns": [%s]}], "summary": {"speedup_vs_plain": 1.5}}'
                    % str(turn).replace("'", '"'))
    row = loop_share.summarise(path, 3)
    assert row["cycles"] == 4 and row["tokens"] == 12 and row["repeat_cycle_share"] == 0.5
    assert row["tau_repeat"] == row["tau_fresh"] == 3.0 and row["speedup"] == 1.5


def test_eval_summaries_carry_the_split_and_print_it():
    turns = [{"tokens": [0] + [1, 2, 3] * 4, "accepted": [2, 2, 2, 2]}, {"tokens": [0, 5, 6], "accepted": [1]}]
    got = repeat_summary(turns, 3)
    assert got == {"repeat_token_share": 6 / 14, "tau_in_repeats": 3.0, "tau_elsewhere": 8 / 3}
    summary = {"tau_pooled": 2.0, "tau_per_request": 2.0, "num_tokens": 15, "num_cycles": 5, "num_requests": 1,
               "accept_at_position": [0.5], "tokens_per_s": 1.0, "draft_s": 0, "verify_s": 0, "prefill_s": 0, **got}
    assert "43 % of the tokens follow a context the answer already had: tau 3.00 there, 2.67 elsewhere" in \
        format_summary("x", summary)
    assert repeat_summary([], 3) == {"repeat_token_share": 0.0, "tau_in_repeats": None, "tau_elsewhere": None}


def test_without_repeats_tau_elsewhere_is_tau_pooled():
    from eyas.speculative.stats import summarize

    turns = [{"tokens": list(range(20)), "accepted": [2, 0, 3, 1, 4, 2, 5]}]  # the last cycle cut at 20 tokens
    stats = [{"accepted": t["accepted"], "num_tokens": 20, "draft_s": 0, "verify_s": 0, "prefill_s": 0,
              "total_s": 1.0} for t in turns]
    got = repeat_summary(turns, 3)
    assert got["repeat_token_share"] == 0 and got["tau_elsewhere"] == summarize(stats, 3)["tau_pooled"]


def test_ngram_lookup_guesses_only_from_the_context():
    """n-gram lookup: the tokens after the latest earlier occurrence of the context's last n tokens, the longest
    n first, never past the context's end."""
    seq = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3, 99, 98]
    # the context seq[:11] ends "7 2 3" (nowhere earlier), then "2 3": latest earlier at 5..6, followed by
    # 5 7 2 3 and the context's end
    assert NgramIndex(seq).propose(11, 8) == [5, 7, 2, 3]
    assert NgramIndex(seq).propose(11, 2) == [5, 7]
    assert NgramIndex(seq, 3, 3).propose(11, 8) == []
    assert NgramIndex([4, 5, 6]).propose(3, 4) == []
    index = NgramIndex(seq)  # growing contexts reuse the index: the same answers as a fresh one
    assert [index.propose(e, 3) for e in range(1, 14)] == [NgramIndex(seq).propose(e, 3) for e in range(1, 14)]


def test_ngram_cycles_accept_what_copying_gives():
    # the prefill makes 7; the context then ends "5 7", whose "7" the prompt holds followed by 8 9 5: the cycle
    # accepts 8 9 and the target adds 6; the next context ends "9 6", never seen: nothing to guess
    prompt, tokens = [7, 8, 9, 5], [7, 8, 9, 6, 1]
    assert ngram_accepted(prompt, tokens, 3) == [2, 0]
    # nothing to copy: every cycle accepts none, one token a cycle as plain decoding
    assert ngram_accepted([1, 2], [3, 4, 5], 4) == [0, 0]
    s = ngram_summary([{"prompt_ids": prompt}, {"prompt_ids": [1, 2]}], [tokens, [3, 4, 5]], 3)
    assert s == {"ngram_k": 3, "ngram_tau": (2 + 4) / 4}  # 3 + 1 tokens over 2 cycles, 2 over 2


def test_the_tree_bench_merges_a_lookup_chain_into_its_tree():
    spec = importlib.util.spec_from_file_location("tree_select", Path(__file__).resolve().parents[2] / "bench"
                                                  / "tree_select.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # the chain shares its first tokens with a proposal's path from the root; those are not added twice
    prop = bench.Proposal([5, 8, 7], [-1, -1, 0], [1, 1, 2])
    assert bench._shared(prop, [5, 7, 2]) == 2 and bench._shared(prop, [6]) == 0
