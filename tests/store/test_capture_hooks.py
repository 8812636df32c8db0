"""FeatureCapture pins the HF hidden_states convention: aux id k = hidden_states[k], final = hidden_states[n]."""

import pytest
import torch

from eyas.target.capture import FeatureCapture


def _reference(target, ids, mask):
    out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return out.hidden_states, out.logits


def _padded_batch(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)  # [B, L]
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    return ids, mask


def test_smollm2_hooks_equal_hidden_states_and_final_is_post_norm(smollm2):
    capture = FeatureCapture(smollm2, None)
    assert capture.aux_layers == [2, 15, 27]
    ids, mask = _padded_batch(smollm2.vocab_size, [21, 13])
    aux, final = capture(ids, mask)
    hidden, logits = _reference(smollm2, ids, mask)
    n, h = smollm2.num_layers, smollm2.hidden_size
    assert aux.shape == (2, 21, 3 * h) and final.shape == (2, 21, h)
    real = mask.bool()
    for j, k in enumerate(capture.aux_layers):
        torch.testing.assert_close(aux[..., j * h:(j + 1) * h][real], hidden[k][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final[real], hidden[n][real], rtol=1e-5, atol=1e-5)
    # hidden_states[n] is the lm_head's input: the final norm applied to the raw last layer output
    torch.testing.assert_close(smollm2.lm_head(final)[real], logits[real], rtol=1e-4, atol=1e-4)
    raw_last = smollm2.layers[-1](hidden[n - 1], position_embeddings=smollm2.decoder.rotary_emb(
        hidden[n - 1], torch.arange(21)[None]), attention_mask=None)
    raw_last = raw_last[0] if isinstance(raw_last, tuple) else raw_last
    assert not torch.allclose(raw_last[0, :13], final[0, :13], atol=1e-2)
    torch.testing.assert_close(smollm2.norm(raw_last)[0, :13], final[0, :13], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["tiny", "tiny-qwen2", "tiny-moe"])
def test_tiny_families(kind):
    from eyas.target import load_target

    target = load_target(kind, device="cpu", dtype="fp32")
    capture = FeatureCapture(target, [1, 3])
    ids, mask = _padded_batch(target.vocab_size, [9, 6, 4], seed=1)
    aux, final = capture(ids, mask)
    hidden, logits = _reference(target, ids, mask)
    real, h = mask.bool(), target.hidden_size
    torch.testing.assert_close(aux[..., :h][real], hidden[1][real])
    torch.testing.assert_close(aux[..., h:][real], hidden[3][real])
    torch.testing.assert_close(final[real], hidden[4][real])
    torch.testing.assert_close(target.lm_head(final)[real], logits[real], rtol=1e-4, atol=1e-4)


def test_rejects_final_index_as_aux(tiny_target):
    with pytest.raises(ValueError, match="out of range"):
        FeatureCapture(tiny_target, [2, 4])


def test_only_the_base_model_runs_no_lm_head_no_all_hidden_states(tiny_target):
    """Issue 4 (1): capture asks for no hidden_states list and never computes the V-wide lm_head."""
    calls = {"lm_head": 0, "kwargs": []}
    head = tiny_target.lm_head.register_forward_hook(lambda *_: calls.__setitem__("lm_head", calls["lm_head"] + 1))
    pre = tiny_target.decoder.register_forward_pre_hook(lambda _m, _a, kw: calls["kwargs"].append(dict(kw)),
                                                        with_kwargs=True)
    try:
        ids, mask = _padded_batch(tiny_target.vocab_size, [7, 3])
        FeatureCapture(tiny_target, [1, 3])(ids, mask)
    finally:
        head.remove()
        pre.remove()
    assert calls["lm_head"] == 0 and len(calls["kwargs"]) == 1
    assert not calls["kwargs"][0].get("output_hidden_states") and calls["kwargs"][0].get("use_cache") is False
