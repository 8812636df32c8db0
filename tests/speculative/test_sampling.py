"""Sampling is lossless: emitted tokens follow the target's tempered distribution (chi-square tests), for EAGLE-3
chains and trees and for DFlash chains."""

import pytest
import torch

from eyas.speculative.accept import accept_greedy, sample_node
from eyas.speculative.engine import SpecEngine
from eyas.speculative.oracle import ScriptedDraft

PROMPT = [1, 72, 101, 108, 108, 111, 2]


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test; categories with small expected counts are pooled."""
    n = observed.sum()
    expected = expected_probs * n
    big = expected >= min_expected
    obs = torch.cat([observed[big], observed[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    assert dof >= 5, f"only {dof + 1} categories: the test has no power"
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


def test_sample_node_follows_target_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(12, generator=g) * 1.5, dim=-1)
    candidates = [int(probs.argmax()), 3, int(probs.argmax())]  # best, another, and a duplicate
    n = 20000
    counts = torch.zeros(12)
    for _ in range(n):
        _, tok = sample_node(probs, candidates, g)
        counts[tok] += 1
    assert chi_square_p(counts, probs) > 1e-3


def test_greedy_walks_tree():
    logits = torch.zeros(5, 10)
    # nodes: 0 (tok 4, root child), 1 (tok 5, root child), 2 (tok 6, child of 1), 3 (tok 7, child of 2)
    tokens, parents = [4, 5, 6, 7], [-1, -1, 1, 2]
    logits[0, 5] = logits[2, 6] = logits[3, 9] = 1.0  # root -> 5 (node 1) -> 6 (node 2) -> 9 (bonus)
    assert accept_greedy(logits, tokens, parents) == ([1, 2], 9)


def exact_pair_distribution(model, prompt, temperature):
    """p(x1, x2) = p(x1) p(x2 | x1) of the target, [V, V]."""
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)  # [V]
        v = first.numel()
        batch = torch.cat([torch.tensor([prompt]).expand(v, -1), torch.arange(v)[:, None]], dim=1)
        second = torch.softmax(model(batch).logits[:, -1] / temperature, -1)  # [V, V]
    return first[:, None] * second


@pytest.mark.parametrize("setting", [dict(tree=(3, 1, 3)), dict(steps=1)], ids=["tree-siblings", "chain"])
def test_speculative_sampling_matches_target(tiny_target, setting):
    """Joint distribution of the first two tokens: the second one goes through the acceptance rule
    (tree: three siblings tried in turn, then the residual; chain: one proposal)."""
    temperature = 0.3  # the random tiny model is nearly flat at 1.0; 0.3 gives ~30 testable pairs
    joint = exact_pair_distribution(tiny_target.model, PROMPT, temperature)
    v = joint.shape[0]
    # after x1 the draft proposes the three likeliest x2 given x1, so that accepts and rejects both happen
    second = joint / joint.sum(1, keepdim=True).clamp_min(1e-30)
    best = second.topk(3, dim=1).indices  # [V, 3]

    def logits_at(p, token):
        logits = torch.zeros(v)
        logits[best[token]] = torch.tensor([9.0, 8.0, 7.0])
        return logits

    draft = ScriptedDraft(PROMPT, v)
    draft._logits_at = logits_at
    engine = SpecEngine(tiny_target.model, draft, [1, 2, 3])
    assert_pairs_follow(engine, joint, temperature, seed=1, **setting)


def assert_pairs_follow(engine, joint, temperature, seed, n=1200, **setting):
    """Decode the first two tokens n times: both branches of the acceptance rule happen on the second, and the
    pairs follow `joint` [V, V] (chi-square)."""
    v = joint.shape[0]
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(v * v)
    accepted = 0
    for _ in range(n):
        res = engine.generate(PROMPT, 2, temperature=temperature, generator=g, **setting)
        counts[res.tokens[0] * v + res.tokens[1]] += 1
        accepted += res.accepted_per_cycle[0]
    assert 0.05 * n < accepted < 0.95 * n, accepted  # both branches of the rule were exercised
    assert chi_square_p(counts, joint.flatten()) > 1e-3


def test_dflash_sampling_matches_target(tiny_target):
    """A DFlash chain through the same rule: the block anchored at the first sampled token proposes the likeliest
    second token (a point-mass draft), and the pair still follows the target's tempered joint distribution."""
    from eyas.draft.dflash import DFlashConfig, DFlashDraft

    temperature = 0.3
    joint = exact_pair_distribution(tiny_target.model, PROMPT, temperature)
    v = joint.shape[0]
    likeliest = (joint / joint.sum(1, keepdim=True).clamp_min(1e-30)).argmax(1)  # [V]: x2 given x1

    class LikeliestNext(DFlashDraft):
        """Slot 1 of a block anchored at x scores likeliest[x]; the context (fuse, context_kv) is DFlashDraft's."""

        def __init__(self, cfg):
            super().__init__(cfg)
            self.lm_head = torch.nn.Identity()  # forward returns logits

        def forward(self, block_ids, positions, ctx_kv, attention_mask=None):
            logits = torch.zeros(1, self.cfg.block_size, v)
            logits[0, 1, likeliest[int(block_ids[0, 0])]] = 1.0
            return logits

    cfg = DFlashConfig.from_target_config(tiny_target.config.to_dict(), target_layers=[1, 2, 3],
                                          mask_token_id=v - 1, block_size=4)
    engine = SpecEngine(tiny_target.model, LikeliestNext(cfg).eval())
    assert_pairs_follow(engine, joint, temperature, seed=2, steps=1)
