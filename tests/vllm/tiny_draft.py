"""A draft trained in seconds for the head_dim-32 tiny Llama of vllm_models: the real trainer (`eyas.train.train`)
on the target's own greedy answers to a few chat prompts, features captured by `FeatureCapture` in memory, a draft
vocabulary of the most frequent answer tokens (so that exports carry d2t/t2d). Acceptance is low but not nil."""

import torch

QUESTIONS = ["hello there", "what is two plus two?", "name a colour", "say something", "count to five",
             "write a word", "tell me a story", "what time is it?"]
AUX = [1, 2, 3]
DRAFT_VOCAB = 160  # of the tiny vocabulary's 320
STEPS = 40


def chat_prompts(target, questions=QUESTIONS) -> list[list[int]]:
    """Each question as a one-turn conversation, rendered as `eyas eval` renders a benchmark turn."""
    from eyas.speculative.bench import encode_turn

    return [encode_turn(target.tokenizer, [{"role": "user", "content": q}]) for q in questions]


def eos_ids(target) -> list[int]:
    from eyas.data.template import stop_token_ids

    return stop_token_ids(target.tokenizer, target.model.generation_config)


def train_tiny_draft(target, run_dir, new_tokens: int = 24, steps: int = STEPS):
    """-> run_dir holding a checkpoint of a draft trained on the target's greedy answers to QUESTIONS."""
    from eyas.config import load_config
    from eyas.data.vocab import build_vocab, count_tokens
    from eyas.speculative.engine import SpecEngine
    from eyas.target.capture import FeatureCapture
    from eyas.train import TrainSource, train

    plain, eos = SpecEngine(target.model), eos_ids(target)
    capture = FeatureCapture(target, AUX)
    samples = []
    for i, prompt in enumerate(chat_prompts(target)):
        answer = plain.plain_generate(prompt, new_tokens, eos_token_ids=eos).tokens
        ids = torch.tensor([prompt + answer])
        aux, final = capture(ids, torch.ones_like(ids, dtype=torch.bool))
        samples.append({"sample_id": str(i), "input_ids": ids[0],
                        "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(answer)),
                        "aux_hidden": aux[0].clone(), "final_hidden": final[0].clone()})
    vocab = build_vocab(count_tokens(((s["input_ids"].tolist(), s["loss_mask"].tolist()) for s in samples),
                                     target.vocab_size), DRAFT_VOCAB)
    source = TrainSource(samples=samples, lengths=[len(s["input_ids"]) for s in samples],
                         embed_weight=target.embed_tokens.weight.detach(),
                         lm_head_weight=target.lm_head.weight.detach(), target_config=target.config.to_dict(),
                         target=target.identity, aux_layers=AUX, d2t=vocab["d2t"], t2d=vocab["t2d"],
                         target_model=str(target.path))
    longest = max(source.lengths)
    cfg = load_config("tiny", [f"train.steps={steps}", "train.ttt=3", "train.lr=5e-3", "train.warmup_steps=3",
                               f"train.batch_tokens={longest * len(samples)}", f"train.log_every={steps}",
                               f"train.save_every={steps}", "train.keep_last=1", "train.dtype=fp32",
                               "train.seed=0"])
    train(cfg, run_dir, source, device="cpu")
    return run_dir
