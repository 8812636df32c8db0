"""Golden assistant masks for three template styles, found from the templates themselves."""

import pytest

from eyas.data.template import ChatTemplate, stop_token_ids
from eyas.target.tiny import make_tiny_tokenizer

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "assistant", "content": "Why did the chicken cross the road?"},
]

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Zephyr-like turns that inject a default system prompt when the conversation has none
DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|system|>\nYou are a kind assistant.</s>\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '</s>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def masked_runs(tok, ids, mask):
    """The decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def tiny_with(template, specials, eos):
    tok = make_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    tok.eos_token = eos
    return tok


def check_golden(tok, ct, conv, expected_runs, eot):
    t = ct.tokenize(conv)
    assert len(t.input_ids) == len(t.loss_mask)
    assert tok.decode(t.input_ids) == ct.render(conv)
    assert masked_runs(tok, t.input_ids, t.loss_mask) == expected_runs
    # the first assistant token is in, the token before it (end of the generation prompt) is out
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        prompt = ct.prompt_ids(conv[:i])
        assert t.input_ids[: len(prompt)] == prompt, "the prompt tokenizes as at inference"
        assert t.loss_mask[len(prompt) - 1] == 0 and t.loss_mask[len(prompt)] == 1
    # every end-of-turn token of an assistant turn is in; the next user header is out
    eot_id = tok.convert_tokens_to_ids(eot)
    eots = [k for k, i in enumerate(t.input_ids) if i == eot_id]
    masked_eots = [k for k in eots if t.loss_mask[k]]
    assert len(masked_eots) == sum(m["role"] == "assistant" for m in conv)
    first_end = masked_eots[0]
    assert t.loss_mask[first_end + 1] == 0  # what follows the end of the turn (newline / next header) is out
    return t


def test_chatml_smollm2_golden(smollm2):
    tok = smollm2.tokenizer
    ct = ChatTemplate(tok, stop_token_ids(tok, smollm2.model.generation_config))
    check_golden(tok, ct, CONV, ["Hello! How can I help?<|im_end|>", "Why did the chicken cross the road?<|im_end|>"],
                 "<|im_end|>")
    # SmolLM2's template injects its own system prompt when none is given; it stays out of the mask
    no_system = CONV[1:]
    t = check_golden(tok, ct, no_system, ["Hello! How can I help?<|im_end|>",
                                          "Why did the chicken cross the road?<|im_end|>"], "<|im_end|>")
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(t.input_ids)


def test_llama3_header_template_golden():
    tok = tiny_with(LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>")
    tok.bos_token = "<|begin_of_text|>"
    ct = ChatTemplate(tok)
    conv = [dict(m) for m in CONV]
    conv[2]["content"] = "  Hello! How can I help?\n"  # the template trims content: the mask follows the trimmed text
    t = check_golden(tok, ct, conv, ["Hello! How can I help?<|eot_id|>", "Why did the chicken cross the road?<|eot_id|>"],
                     "<|eot_id|>")
    assert t.input_ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>") and t.loss_mask[0] == 0


def test_default_system_template_golden():
    tok = tiny_with(DEFAULT_SYSTEM, ["<|system|>", "<|user|>", "<|assistant|>", "</s>"], "</s>")
    ct = ChatTemplate(tok)
    conv = CONV[1:]
    t = check_golden(tok, ct, conv, ["Hello! How can I help?</s>", "Why did the chicken cross the road?</s>"], "</s>")
    text = tok.decode(t.input_ids)
    assert text.startswith("<|system|>\nYou are a kind assistant.</s>")
    # the injected system turn ends with </s> too, and it is not the assistant's
    first_eos = t.input_ids.index(tok.convert_tokens_to_ids("</s>"))
    assert t.loss_mask[first_eos] == 0


def test_template_that_rewrites_history_is_reported():
    # renders only the last message: prefixes of the conversation are not prefixes of the render
    tok = make_tiny_tokenizer()
    tok.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    out = ChatTemplate(tok).tokenize_many([CONV])
    assert isinstance(out[0], ValueError)


def test_tokenizer_without_template_is_a_user_error():
    tok = make_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        ChatTemplate(tok)
