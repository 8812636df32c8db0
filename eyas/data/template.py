"""Token ids and assistant loss masks, found from the target's own chat template.

No separators are hard-coded per model family. For a conversation with assistant turns at
message indices a_1 < a_2 < ..., the template renders:

- the whole conversation, S;
- for each turn k, the conversation before it with the generation prompt, P_k = render(m[:a_k], gen=True):
  what the target is given when it writes the turn (any default system prompt, role header or BOS the
  template injects is in it, so it is masked out);
- the conversation up to and including the turn, Q_k = render(m[:a_k + 1]).

A turn is masked when P_k and Q_k are prefixes of S; the span starts after P_k. Where P_k ends in text
that S does not hold (DeepSeek-R1's generation prompt ends in "<think>\n"), the conversation before the
turn, H_k = render(m[:a_k]), must be a prefix of both, and the span starts where S and P_k part: text that
only the generation prompt adds is the target's prompt, not its output. Inside the turn the assistant's
content is located, and the span ends at the first end-of-turn token after it (the target's stop
tokens, e.g. `<|im_end|>` or `<|eot_id|>`): what the assistant produces before generation stops is in the
mask; what the template adds after it (a newline) is not.

Each turn is checked on its own. Templates that render a turn differently once later messages follow
(Qwen3 drops the reasoning of earlier turns, and gives the last one an empty "<think>\n\n</think>\n\n")
fail the check for the earlier turns: those stay in the sample as unmasked context and are counted. The
last assistant turn must pass, or the conversation is a `TemplateMismatch`.

A regenerated last turn is the target's own output after P_k, so S must hold P_k followed by the
response verbatim (whitespace between them aside). A template that rewrites it (Qwen3 puts an empty
think block before a response that starts with "<think>" or was cut off inside its reasoning) would
teach the draft text the target does not write: that conversation is a `ResponseRewritten`.

The ids are those of S tokenized whole, and the mask is cut at the tokens' character offsets: a
SentencePiece-style tokenizer (Llama-2, Zephyr, Phi-3) puts a `▁` before any text it tokenizes alone, so
pieces tokenized alone would not add up to S. The text before each span (P_k, less what only the
generation prompt adds) must tokenize alone to the first tokens of S, as the target is given it at
inference; it is tokenized again from its last added token, since tokens never merge across one. Where
the tokenizer merges across that boundary (a byte-level BPE joining the header's "\n" with a tab that
opens the content), the conversation is tokenized piece by piece instead, each piece alone, so that the
prompt keeps its inference tokens.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import dataclass


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on the tokens the assistant produces, including its end-of-turn token
    num_unmasked_turns: int = 0  # earlier assistant turns the template renders differently once others follow


class TemplateMismatch(ValueError):
    """The template did not render this conversation as a sequence of prefixes."""


class ResponseRewritten(TemplateMismatch):
    """The template does not render a regenerated response verbatim after the target's prompt."""


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids that end an assistant turn: the tokenizer's eos and the generation config's eos ids."""
    ids: list[int] = []
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


@dataclass
class Rendered:
    text: str  # S
    spans: list[tuple[int, int]]  # [start, end) characters of the masked assistant turns
    num_unmasked_turns: int


class ChatTemplate:
    """Renders conversations with a tokenizer's chat template and builds (ids, mask) pairs.

    `chat_template_kwargs` go to every render (data.chat_template_kwargs, e.g. {"enable_thinking": False}).
    """

    def __init__(self, tokenizer, stop_ids: list[int] | None = None, chat_template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the target tokenizer has no chat_template; give the target a tokenizer with one")
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids if stop_ids is not None else stop_token_ids(tokenizer)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # special tokens are matched as text in the rendered string
        self.stop_texts = [t for t in tokenizer.convert_ids_to_tokens(self.stop_ids) if t]
        self.added_ids = set(tokenizer.get_added_vocab().values())

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **self.chat_template_kwargs)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """What the target is given to write the next assistant turn (the generation prompt included)."""
        return self._ids(self.render(messages, add_generation_prompt=True))

    def _turn(self, messages: list[dict], i: int, full: str, verbatim: bool) -> tuple[int, int]:
        """[start, end) characters of assistant message i in `full`; raises TemplateMismatch if it has none."""
        prompt = self.render(messages[:i], add_generation_prompt=True) if i else ""
        upto = self.render(messages[: i + 1])
        if full.startswith(prompt):
            history = start = len(prompt)
        else:  # text only the generation prompt adds (R1's "<think>\n"): the turn starts where S and P_k part
            before = self.render(messages[:i])
            if not (full.startswith(before) and prompt.startswith(before)):
                raise TemplateMismatch(f"message {i}: the template renders the conversation before this turn "
                                       f"differently once later messages follow")
            history = len(before)
            start = history + len(os.path.commonprefix([prompt[history:], full[history:len(prompt)]]))
        if not full.startswith(upto):
            raise TemplateMismatch(f"message {i}: the template renders this turn differently once later messages "
                                   f"follow")
        stop, content = len(upto), messages[i]["content"]
        if verbatim:
            # whitespace the template puts first is allowed: SentencePiece decoding drops a response's leading
            # space, and templates (Llama-2, Mistral) put it back
            lead = len(full[start:stop]) - len(full[start:stop].lstrip())
            at = full.find(content, start, start + lead + len(content))
            if at < 0 and content != content.rstrip():  # a template that trims (Llama-3) drops trailing spacing:
                content = content.rstrip()  # the rest is the target's own text, and the turn still ends there
                at = full.find(content, start, start + lead + len(content))
            if start < len(prompt) or at < 0:
                raise ResponseRewritten(f"message {i}: the template renders {full[start:start + 50]!r} where the "
                                        f"target wrote {content[:50]!r} after its prompt")
        else:
            if start < len(prompt):  # the content may begin as what only the prompt adds: "</s>..."
                start = next((c for c in range(start, history - 1, -1) if full.startswith(content, c)), start)
            # templates may trim the content, so look for the trimmed text
            at = full.find(content, start, stop)
            if at < 0:
                content = content.strip()
                at = full.find(content, start, stop)
            if at < 0:
                raise TemplateMismatch(f"message {i}: the assistant content is not in the rendered turn")
        end = at + len(content)
        ends = [full.find(t, end, stop) for t in self.stop_texts]
        ends = [e + len(t) for e, t in zip(ends, self.stop_texts) if e >= 0]
        if ends:
            return start, min(ends)
        return start, start + len(full[start:stop].rstrip())  # no stop token in the turn: up to the suffix

    def spans(self, messages: list[dict], verbatim_last: bool = False) -> Rendered:
        """S and the character spans of the assistant's output; `verbatim_last`: the last assistant turn is
        the target's own response (regenerated) and must be rendered as written."""
        full = self.render(messages)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        spans, num_unmasked = [], 0
        for i in turns:
            last = i == turns[-1]
            try:
                spans.append(self._turn(messages, i, full, verbatim_last and last))
            except Exception:  # noqa: BLE001 -- a template may raise (jinja's raise_exception) on a prefix
                if last:
                    raise
                num_unmasked += 1
        return Rendered(full, spans, num_unmasked)

    def tokenize(self, messages: list[dict], verbatim_last: bool = False) -> Tokenized | TemplateMismatch:
        return self.tokenize_many([messages], verbatim_last)[0]

    def tokenize_many(self, conversations: list[list[dict]],
                      verbatim_last: bool = False) -> list[Tokenized | TemplateMismatch]:
        """Batch version: two calls into the tokenizer for all conversations (S, then the ends of the prompts)."""
        rendered: list[Rendered | TemplateMismatch] = []
        for messages in conversations:
            try:
                rendered.append(self.spans(messages, verbatim_last))
            except TemplateMismatch as e:
                rendered.append(e)
            except Exception as e:  # noqa: BLE001 -- a template may raise (jinja's raise_exception) on any input
                rendered.append(TemplateMismatch(f"{type(e).__name__}: {e}"))
        ok = [r for r in rendered if isinstance(r, Rendered)]
        if not ok:
            return rendered
        fast = bool(getattr(self.tokenizer, "is_fast", False))
        encoded = self.tokenizer([r.text for r in ok], add_special_tokens=False, return_offsets_mapping=fast)
        all_ids = encoded["input_ids"]
        starts = [[a for a, _ in offsets] for offsets in encoded["offset_mapping"]] if fast else [None] * len(ok)
        tails = []  # (conversation, token index j, text): each prompt tokenizes alone to S's ids[:j] + tokens of text
        for k, r in enumerate(ok):
            for start, _ in r.spans:
                j = self._last_added_token(all_ids[k], starts[k], encoded["offset_mapping"][k], start) if fast else 0
                tails.append((k, j, r.text[starts[k][j] if j else 0:start]))
        texts = [text for _, _, text in tails]
        tail_ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        prompt_ends: list[list[int | None]] = [[] for _ in ok]  # token index where each turn starts; None: merged
        for (k, j, _), t in zip(tails, tail_ids):
            prompt_ends[k].append(j + len(t) if all_ids[k][j:j + len(t)] == t else None)
        each = iter(zip(ok, all_ids, starts, prompt_ends))
        return [r if isinstance(r, TemplateMismatch) else self._masked(*next(each)) for r in rendered]

    def _last_added_token(self, ids: list[int], starts: list[int], offsets: list[tuple[int, int]], at: int) -> int:
        """The last added token (a special token, or one such as Qwen3's <think>) that ends by character `at`;
        0 if none. Tokens never merge across an added token, so the text before `at` tokenizes to the ids up
        to it followed by the tokens of the text from it."""
        for j in range(bisect_left(starts, at) - 1, 0, -1):
            if ids[j] in self.added_ids and offsets[j][1] <= at:
                return j
        return 0

    def _masked(self, r: Rendered, ids: list[int], starts: list[int] | None,
                prompt_ends: list[int | None]) -> Tokenized:
        if None in prompt_ends:  # the tokenizer merges across the end of a prompt
            ids, mask = self._piecewise(r)
            return Tokenized(ids, mask, r.num_unmasked_turns)
        mask = [0] * len(ids)
        for (_, end), first in zip(r.spans, prompt_ends):
            # tokens that start before `end` (a tokenizer without offsets counts those of the text before it)
            last = bisect_left(starts, end) if starts is not None else len(self._ids(r.text[:end]))
            mask[first:last] = [1] * (last - first)
        return Tokenized(ids, mask, r.num_unmasked_turns)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _piecewise(self, r: Rendered) -> tuple[list[int], list[int]]:
        """Ids and mask of S cut at the span boundaries, each piece tokenized alone."""
        parts, pos = [], 0
        for start, end in r.spans:
            if start > pos:
                parts.append((r.text[pos:start], 0))
            parts.append((r.text[start:end], 1))
            pos = end
        if pos < len(r.text):
            parts.append((r.text[pos:], 0))
        encoded = self.tokenizer([text for text, _ in parts], add_special_tokens=False)["input_ids"]
        ids, mask = [], []
        for piece, (_, flag) in zip(encoded, parts):
            ids.extend(piece)
            mask.extend([flag] * len(piece))
        return ids, mask
