"""The pipeline's stages as Python calls: each `run(cfg, inputs, out) -> summary` does one stage's whole work.

    prepare.run(cfg, prepare.Inputs(data=[...]), OUT)                 conversations -> OUT (dataset, vocab)
    capture.run(cfg, capture.Inputs(prepared=DIR), STORE)             hidden states -> a packed store
    train.run(cfg, train.Inputs(store=STORE, vocab=VOCAB), RUN)       the draft, with training-time test
    eval.run(cfg, eval.Inputs(draft=RUN), EVAL_DIR)                   speculative decoding on benchmarks
    export.run(cfg, export.Inputs(draft=RUN), EXPORT_DIR)             checkpoints for SGLang, vLLM, speculators

`inputs` names what the stage reads besides the config (paths, given explicitly: a stage never guesses where
another stage wrote); `out` is the directory it writes, ending with OUT/summary.json (wall_s and a rate) that
the run report reads. Stages that run the target take an already loaded one as `target=` (a bench script or
a test loads it once); otherwise they load cfg.target.model. The `eyas` commands parse arguments into these
calls; `eyas run` starts each stage as its command in its own process (eyas/pipeline/).
"""
