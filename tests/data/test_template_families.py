"""Masks beyond ChatML: ids equal the whole text tokenized (SentencePiece-style tokenizers too), thinking
templates (Qwen3, DeepSeek-R1) with multi-turn conversations and regenerated responses, and
data.chat_template_kwargs from the config to the template and to the endpoint's requests."""

import pytest

from eyas.data.template import ChatTemplate, ResponseRewritten, TemplateMismatch, stop_token_ids
from eyas.target.tiny import make_tiny_tokenizer

from test_template import CONV, DEFAULT_SYSTEM, LLAMA3, masked_runs, tiny_with

# Qwen3's chat template (Qwen3-8B's tokenizer_config.json) without its tool-call and tool-response branches
QWEN3 = """
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# DeepSeek-R1's shape: earlier reasoning is dropped, and the generation prompt opens the reasoning
R1 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
      "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
      "{% else %}{% set c = m['content'] %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
      "{{ '<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")
# Mistral v0.3's shape: no generation prompt, and a space before the answer (SentencePiece drops it in decoding)
MISTRAL = ("{{ bos_token }}{% for m in messages %}"
           "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
           "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
ZEPHYR_SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>"]


def sentencepiece_bpe(template: str, legacy: bool = False, specials: list[str] = ()):
    """A small BPE with byte fallback that writes spaces as ▁, as Llama-2, Mistral and Phi-3 do: either a
    Metaspace pre-tokenizer that puts a ▁ before the first word only, or (`legacy`) a normalizer that puts
    one before every piece of text between special tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    if legacy:
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    corpus = [m["content"] for m in CONV] * 20 + ["You are a kind assistant.", "[INST] Sure, here is a plan. [/INST]"]
    trainer = trainers.BpeTrainer(vocab_size=220, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=["\n"],
                                  show_progress=False)
    tk.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    return tok


def qwen3_like():
    tok = make_tiny_tokenizer()  # byte-level, with <|im_start|> and <|im_end|>
    tok.add_tokens(["<think>", "</think>"])  # added, not special: they stay in a decoded response
    tok.chat_template = QWEN3
    return tok


def r1_like():
    tok = tiny_with(R1, ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                    "<｜end▁of▁sentence｜>")
    tok.bos_token = "<｜begin▁of▁sentence｜>"
    return tok


def check_whole(tok, ct, conv, expected_runs, unmasked=()):
    """The ids are the whole rendered text tokenized, the mask as expected, and each masked turn's prompt as at
    inference (the turns at the message indices `unmasked` are context)."""
    t = ct.tokenize(conv)
    text = ct.render(conv)
    assert t.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert masked_runs(tok, t.input_ids, t.loss_mask) == expected_runs
    assert t.num_unmasked_turns == len(unmasked)
    for i, m in enumerate(conv):
        if m["role"] == "assistant" and i not in unmasked:
            prompt = ct.prompt_ids(conv[:i])
            assert t.input_ids[:len(prompt)] == prompt and t.loss_mask[len(prompt) - 1:len(prompt) + 1] == [0, 1]
    return t


def test_ids_are_the_whole_text_tokenized_for_chatml_llama3_and_sentencepiece(smollm2):
    runs = ["Hello! How can I help?", "Why did the chicken cross the road?"]
    smol = smollm2.tokenizer
    check_whole(smol, ChatTemplate(smol, stop_token_ids(smol, smollm2.model.generation_config)), CONV,
                [r + "<|im_end|>" for r in runs])
    llama3 = tiny_with(LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                       "<|eot_id|>")
    check_whole(llama3, ChatTemplate(llama3), CONV, [r + "<|eot_id|>" for r in runs])
    for legacy in (False, True):
        zephyr = sentencepiece_bpe(DEFAULT_SYSTEM, legacy, ZEPHYR_SPECIALS)
        t = check_whole(zephyr, ChatTemplate(zephyr), CONV[1:], [r + "</s>" for r in runs])
        if not legacy:  # (a legacy tokenizer puts a ▁ after every special token: its text is not S)
            assert zephyr.decode(t.input_ids) == ChatTemplate(zephyr).render(CONV[1:])
        # no stray ▁ where a turn's content begins (nor after its </s>: the ids are those of S)
        first = t.loss_mask.index(1)
        assert zephyr.convert_ids_to_tokens(t.input_ids[first - 1:first + 1]) == ["\n", "H"]


def test_a_response_sentencepiece_decodes_without_its_space_is_verbatim():
    """Mistral's template puts the space back that SentencePiece decoding drops from the response."""
    tok = sentencepiece_bpe(MISTRAL)
    ct = ChatTemplate(tok)
    conv = [{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Sure, here is a plan."}]
    t = ct.tokenize(conv, verbatim_last=True)
    assert t.input_ids == tok(ct.render(conv), add_special_tokens=False)["input_ids"]
    assert masked_runs(tok, t.input_ids, t.loss_mask) == ["Sure, here is a plan.</s>"]


SMOL_CONVS = [
    CONV,
    [{"role": "user", "content": "Write code"},
     {"role": "assistant", "content": "```python\ndef f(x):\n    return x\n```\n"},
     {"role": "user", "content": "  more  "}, {"role": "assistant", "content": " Sure: 1, 2, 3.\n\nDone."}],
    [{"role": "user", "content": "é ü 中文 🙂"}, {"role": "assistant", "content": "日本語 ok 🙂\n- a"},
     {"role": "user", "content": "x"}, {"role": "assistant", "content": "\nleading newline"},
     {"role": "user", "content": "y"}, {"role": "assistant", "content": "trailing spaces   "}],
    # the header's "\n" and the tab merge into one token of the whole text: the prompt keeps its own tokens
    [{"role": "user", "content": "tabs"}, {"role": "assistant", "content": "\t indented\r\n reply <|im_start|> x"}],
]


def test_smollm2_ids_are_those_of_its_pieces_tokenized_alone(smollm2):
    """Byte-level BPE: the ids are exactly what eyas gave when it tokenized each piece alone."""
    tok = smollm2.tokenizer
    ct = ChatTemplate(tok, stop_token_ids(tok, smollm2.model.generation_config))
    for conv in SMOL_CONVS:
        t = ct.tokenize(conv)
        assert (t.input_ids, t.loss_mask) == ct._piecewise(ct.spans(conv))
        for i, m in enumerate(conv):
            if m["role"] == "assistant":
                prompt = ct.prompt_ids(conv[:i])
                assert t.input_ids[:len(prompt)] == prompt and t.loss_mask[len(prompt) - 1:len(prompt) + 1] == [0, 1]
    whole = tok(ct.render(SMOL_CONVS[-1]), add_special_tokens=False)["input_ids"]
    assert ct.tokenize(SMOL_CONVS[-1]).input_ids != whole  # the merged token was not taken


def test_a_tokenizer_without_offsets_gives_the_same_ids_and_mask():
    class NoOffsets:
        is_fast = False

        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
            assert not return_offsets_mapping
            return self.tok(text, add_special_tokens=add_special_tokens)

    tok = sentencepiece_bpe(DEFAULT_SYSTEM, specials=ZEPHYR_SPECIALS)
    fast, slow = ChatTemplate(tok).tokenize(CONV[1:]), ChatTemplate(NoOffsets(tok)).tokenize(CONV[1:])
    assert (slow.input_ids, slow.loss_mask) == (fast.input_ids, fast.loss_mask)


# ---------------------------------------------------------------- thinking templates

QA = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
      {"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Why did the chicken cross?"}]


def test_qwen3_multi_turn_masks_the_last_turn_and_counts_the_earlier_one():
    """Qwen3 renders an earlier turn without the think block it gets as the last one: that turn is context."""
    tok = qwen3_like()
    t = check_whole(tok, ChatTemplate(tok), QA, ["<think>\n\n</think>\n\nWhy did the chicken cross?<|im_end|>"],
                    unmasked=[1])
    assert t.num_unmasked_turns == 1
    assert "<|im_start|>assistant\nHello!<|im_end|>" in tok.decode(t.input_ids)
    # {enable_thinking: false}: the empty think block is the prompt's, the answer alone is the target's
    ct = ChatTemplate(tok, chat_template_kwargs={"enable_thinking": False})
    assert ct.render(QA[:3], add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    t = check_whole(tok, ct, QA, ["Why did the chicken cross?<|im_end|>"], unmasked=[1])
    assert t.num_unmasked_turns == 1
    assert ChatTemplate(tok).tokenize(QA[:2]).num_unmasked_turns == 0  # one turn: nothing left out


def test_a_regenerated_response_may_lose_its_trailing_spacing_to_a_trimming_template():
    """Llama-3's template trims the content: a response cut at the token limit after a newline is still the
    target's own text up to there, so it is kept (the newline is not trained on); a rewritten start is not."""
    llama3 = tiny_with(LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                       "<|eot_id|>")
    ct = ChatTemplate(llama3)
    conv = [{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Sure, a joke:\n\n"}]
    t = ct.tokenize(conv, verbatim_last=True)
    assert masked_runs(llama3, t.input_ids, t.loss_mask) == ["Sure, a joke:<|eot_id|>"]
    conv[1]["content"] = "  Sure"  # trimmed at its start: not what the target wrote after its prompt
    assert isinstance(ct.tokenize(conv, verbatim_last=True), ResponseRewritten)


def test_qwen3_regenerated_responses_must_be_rendered_as_written():
    tok = qwen3_like()
    think = "<think>\nThe user wants a joke.\n</think>\n\nWhy did the chicken cross?"
    t = ChatTemplate(tok).tokenize(QA[:3] + [{"role": "assistant", "content": think}], verbatim_last=True)
    assert masked_runs(tok, t.input_ids, t.loss_mask) == [think + "<|im_end|>"]
    # cut off inside its reasoning: the template wraps it in an empty think block the target never wrote
    cut = {"role": "assistant", "content": "<think>\nThe user wants a joke. Let me"}
    out = ChatTemplate(tok).tokenize(QA[:3] + [cut], verbatim_last=True)
    assert isinstance(out, ResponseRewritten) and "<think>\\n\\n</think>" in str(out)
    assert not isinstance(ChatTemplate(tok).tokenize(QA[:3] + [cut]), TemplateMismatch)  # not regenerated: kept
    # a server that does not think answered: the template adds the empty think block unless told so
    plain = QA[:3] + [{"role": "assistant", "content": "Why did the chicken cross?"}]
    assert isinstance(ChatTemplate(tok).tokenize(plain, verbatim_last=True), ResponseRewritten)
    t = ChatTemplate(tok, chat_template_kwargs={"enable_thinking": False}).tokenize(plain, verbatim_last=True)
    assert masked_runs(tok, t.input_ids, t.loss_mask) == ["Why did the chicken cross?<|im_end|>"]


def test_deepseek_r1_generation_prompt_text_is_prompt():
    """R1's generation prompt ends in "<think>\\n", which the rendered conversation does not hold: every turn is
    masked from the assistant's header on; a regenerated response loses its reasoning, so it is rewritten."""
    tok = r1_like()
    ct = ChatTemplate(tok)
    t = ct.tokenize(QA)
    assert t.input_ids == tok(ct.render(QA), add_special_tokens=False)["input_ids"] and t.num_unmasked_turns == 0
    assert masked_runs(tok, t.input_ids, t.loss_mask) == ["Hello!<｜end▁of▁sentence｜>",
                                                          "Why did the chicken cross?<｜end▁of▁sentence｜>"]
    # a turn that begins as the prompt's "<think>\n" does is still found after the assistant's header
    t = ct.tokenize(QA[:3] + [{"role": "assistant", "content": "<thanks>"}])
    assert masked_runs(tok, t.input_ids, t.loss_mask)[-1] == "<thanks><｜end▁of▁sentence｜>"
    own = QA[:3] + [{"role": "assistant", "content": "A joke, then.\n</think>\n\nWhy did the chicken cross?"}]
    assert isinstance(ct.tokenize(own, verbatim_last=True), ResponseRewritten)


def test_the_last_turn_must_pass():
    tok = qwen3_like()
    tok.chat_template = "{{ messages[-1]['content'] }}"
    assert isinstance(ChatTemplate(tok).tokenize(QA), TemplateMismatch)


# ---------------------------------------------------------------- data.chat_template_kwargs

def test_chat_template_kwargs_setting():
    from eyas.config import ConfigError, load_config

    assert load_config("tiny").data.chat_template_kwargs == {}
    cfg = load_config("tiny", ["data.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    for bad, words in (("[1, 2]", "expected a mapping"), ("{tokenize: false}", "eyas sets itself"),
                       ("{when: 2024-01-01}", "JSON values")):
        with pytest.raises(ConfigError, match=words):
            load_config("tiny", [f"data.chat_template_kwargs={bad}"])


def test_endpoint_requests_carry_chat_template_kwargs(tmp_path, monkeypatch):
    from eyas.data import endpoint

    bodies = []

    def answer(url, body, timeout):
        bodies.append(body)
        return {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}], "usage": {}}

    monkeypatch.setattr(endpoint, "_request", answer)
    prompts = [{"id": "a", "messages": [{"role": "user", "content": "Hi"}]}]
    endpoint.regenerate_endpoint("http://x/v1", prompts, tmp_path / "a.jsonl", max_new_tokens=4, model="m",
                                 chat_template_kwargs={"enable_thinking": False})
    endpoint.regenerate_endpoint("http://x/v1", prompts, tmp_path / "b.jsonl", max_new_tokens=4, model="m")
    assert bodies[0]["chat_template_kwargs"] == {"enable_thinking": False} and "chat_template_kwargs" not in bodies[1]


def test_prepare_counts_rewritten_responses_and_unmasked_turns(capsys):
    from eyas.config import load_config
    from eyas.data.prepare import _Report, _tokenize
    from eyas.data.readers import Conversation

    tok = qwen3_like()
    convs = [Conversation("a", QA[:3] + [{"role": "assistant", "content": "<think>\nok\n</think>\n\nFine."}], "f:1"),
             Conversation("b", QA[:3] + [{"role": "assistant", "content": "Fine."}], "f:2")]
    report = _Report()
    cols, stats = _tokenize(load_config("tiny"), ChatTemplate(tok), convs, report)  # regenerated: verbatim
    assert cols["sample_id"] == ["a"] and stats["num_unmasked_turns"] == 1
    assert dict(report.counts) == {"template_rewrites_response": 1}
    assert report.first == {"template_rewrites_response": "f:2"}
    assert "1 earlier assistant turn(s) stay out of the loss" in capsys.readouterr().out
    cols, _ = _tokenize(load_config("tiny", ["data.regenerate=none"]), ChatTemplate(tok), convs, _Report())
    assert cols["sample_id"] == ["a", "b"]  # conversations as given: the template's rendering is the data
