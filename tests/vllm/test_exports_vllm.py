"""eyas's exports served by vLLM itself: a draft trained for the tiny Llama (head_dim 32), exported as `vllm` and
`speculators`, each loaded with speculative_config {"method": "eagle3", "num_speculative_tokens": K} on the CPU in
fp32. Greedy output must be plain vLLM decoding's token for token, and vLLM's counters (drafts, accepted tokens,
accepted per position) must equal what eyas's own engine counts on the same prompt ids, request by request (one
request per generate call, counters read around it), and so must vLLM's per-request report, cycle by cycle.
The plain engine and the one serving the vllm export are the session's (shared with test_eval_vllm.py); the one
serving the speculators export starts here, once."""

import pytest
from conftest import DRAFT_K, ENGINE, EXPORT_FORMATS, require_vllm
from tiny_draft import chat_prompts, eos_ids

require_vllm()

K = DRAFT_K
NEW = 16
FORMATS = EXPORT_FORMATS


@pytest.fixture(scope="module")
def prompts(tiny_llama_target):
    return chat_prompts(tiny_llama_target)[:5]


@pytest.fixture(scope="module")
def eyas_counts(tiny_llama_target, tiny_llama_draft, prompts):
    """eyas's engine (what `eyas eval --steps K` runs) on the same prompt ids: tokens and counts per request."""
    from eyas.speculative.build import build_engine

    engine, _ = build_engine(tiny_llama_target, tiny_llama_draft)
    out = []
    for ids in prompts:
        res = engine.generate(ids, NEW, eos_token_ids=eos_ids(tiny_llama_target), steps=K)
        out.append({"tokens": res.tokens, "drafts": res.num_cycles, "accepted": sum(res.accepted_per_cycle),
                    "per_position": [sum(a > p for a in res.accepted_per_cycle) for p in range(K)],
                    "per_cycle": res.accepted_per_cycle})
    return out


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tiny_llama_target, tiny_llama_exports, tiny_llama_plain, tiny_llama_eagle3, prompts):
    """{"plain" | format: [per request {"tokens", "drafts", "accepted", "per_position" (vLLM's counters over the
    call), "per_cycle" (its per-request report)}]} from vLLM, one request per generate call: plain decoding in the
    session's plain engine (conftest.tiny_llama_plain), each format in an engine of its own, one at a time: the
    vllm export (conftest.tiny_llama_exports) in the session's engine for it (conftest.tiny_llama_eagle3), the
    speculators export in one started here."""
    import contextlib

    from eyas.stages.eval_vllm import ServingEngine, sampling

    assert tiny_llama_exports.keys() == set(FORMATS)
    params = sampling(0.0, NEW, eos_ids(tiny_llama_target))
    shared = {None: tiny_llama_plain, tiny_llama_exports["vllm"]: tiny_llama_eagle3}
    out = {}
    for name, draft_dir in [("plain", None), *tiny_llama_exports.items()]:
        started = (contextlib.nullcontext(shared[draft_dir]) if draft_dir in shared else
                   ServingEngine(str(tiny_llama_dir), dtype="fp32", engine=ENGINE, draft_dir=draft_dir, k=K))
        with started as engine:
            out[name] = []
            for ids in prompts:
                (output,), _, counts = engine.generate([ids], params)
                out[name].append({"tokens": output["tokens"], "per_cycle": output["accepted"], **counts})
    return out


def test_plain_vllm_agrees_with_eyas(served, eyas_counts):
    """The reference itself: vLLM's plain greedy decoding is eyas's (speculative, lossless) output."""
    assert [r["tokens"] for r in served["plain"]] == [r["tokens"] for r in eyas_counts]
    assert all(len(r["tokens"]) == NEW for r in served["plain"])  # the random target never writes its eos
    assert all(r["drafts"] == 0 for r in served["plain"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_served_by_vllm_is_lossless(served, fmt):
    assert [r["tokens"] for r in served[fmt]] == [r["tokens"] for r in served["plain"]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_vllm_counters_equal_eyas_engine_per_request(served, eyas_counts, fmt):
    got = [{k: r[k] for k in ("drafts", "accepted", "per_position")} for r in served[fmt]]
    want = [{k: r[k] for k in ("drafts", "accepted", "per_position")} for r in eyas_counts]
    assert got == want
    # vLLM's own per-request report: the accepted drafts of each verification, cycle by cycle eyas's
    assert [r["per_cycle"] for r in served[fmt]] == [r["per_cycle"] for r in eyas_counts]
    assert sum(r["accepted"] for r in want) > 0  # the draft is accepted at times: the comparison has content
    assert any(r["per_position"][K - 1] for r in want)  # up to the last position


def test_counters_stay_the_engines_own_after_another_engine_started(served, tiny_llama_eagle3, prompts,
                                                                     tiny_llama_target):
    """`served` started (and ended) the speculators export's engine after the session's engine for the vllm export;
    each engine start replaces the metrics in prometheus' process-wide registry (what `llm.get_metrics()` reads),
    yet the session engine's counters still count its own drafts, as its per-request report does."""
    from eyas.stages.eval_vllm import sampling

    (output,), _, counts = tiny_llama_eagle3.generate([prompts[0]], sampling(0.0, NEW, eos_ids(tiny_llama_target)))
    assert counts["drafts"] == len(output["accepted"]) > 0
    assert counts["accepted"] == sum(output["accepted"])
    assert sum(counts["per_position"]) == counts["accepted"]
