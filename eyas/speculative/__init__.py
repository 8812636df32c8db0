"""Speculative decoding with an EAGLE-3 draft: chain and EAGLE-2 tree drafting, lossless acceptance,
acceptance statistics and benchmarks (docs/ALGORITHM.md section 4); with a DFlash draft, chains of one
block per cycle (engine.py).

    engine = SpecEngine(target.model, draft, aux_layers)          # aux ids in the HF convention
    res = engine.generate(ids, 128, steps=5)                       # or tree=(topk, depth, total)
    res.tokens, res.num_cycles, res.accepted_per_cycle, res.draft_s, res.verify_s, res.tau
    engine.plain_generate(ids, 128)                                # the target alone, same cache code

Modules: target.py (preallocated KV cache, masks, one target forward with aux hooks), drafting.py
(chain, tree), accept.py (greedy and sampling rules), engine.py (the cycle), stats.py (tau, per
position acceptance, plot), bench.py (MT-bench, HumanEval, JSONL; baselines; result files),
oracle.py (scripted drafts for tests and the engine's ceiling). `eyas eval` is eyas/stages/eval.py; build.py loads a draft into an engine.
"""

from eyas.speculative.engine import GenResult, SpecEngine

__all__ = ["SpecEngine", "GenResult"]
