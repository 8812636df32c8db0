"""Token ids and assistant loss masks, found from the target's own chat template.

No separators are hard-coded per model family. For a conversation with assistant turns at
message indices a_1 < a_2 < ..., the template is rendered three ways:

- the whole conversation, S;
- the prefix before each assistant turn with the generation prompt, P_k = render(m[:a_k], gen=True):
  where the assistant starts writing (any default system prompt, role header or BOS the template
  injects is inside P_k, so it is masked out);
- the prefix including that turn, Q_k = render(m[:a_k + 1]).

P_k and Q_k must be prefixes of S (templates that rewrite earlier turns fail this check and the
conversation is skipped as `template_mismatch`). Inside S[len(P_k):len(Q_k)] the assistant's content
is located, and the turn's end is the first end-of-turn token (the target's stop tokens, e.g.
`<|im_end|>` or `<|eot_id|>`) after it: that is what the assistant produces before generation stops,
so it is in the mask; what the template adds after it (a newline) is not.

S is then cut at these character boundaries and each piece is tokenized on its own, so the prompt
part P_k tokenizes exactly as it does at inference, when the target is given P_k and writes the rest.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on the tokens the assistant produces, including its end-of-turn token


class TemplateMismatch(ValueError):
    """The template did not render this conversation as a sequence of prefixes."""


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


class ChatTemplate:
    """Renders conversations with a tokenizer's chat template and builds (ids, mask) pairs."""

    def __init__(self, tokenizer, stop_ids: list[int] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the target tokenizer has no chat_template; give the target a tokenizer with one")
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids if stop_ids is not None else stop_token_ids(tokenizer)
        # special tokens are matched as text in the rendered string
        self.stop_texts = [t for t in tokenizer.convert_ids_to_tokens(self.stop_ids) if t]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """What the target is given to write the next assistant turn (the generation prompt included)."""
        text = self.render(messages, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the [start, end) character spans of the assistant's output."""
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            if not full.startswith(before) or not full.startswith(upto) or len(upto) < len(before):
                raise TemplateMismatch(f"message {i}: the template does not render prefixes of the conversation")
            start, stop = len(before), len(upto)
            content = m["content"]
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
                end = min(ends)
            else:  # a template with no stop token in the turn: the assistant writes up to the suffix
                end = start + len(full[start:stop].rstrip())
            spans.append((start, end))
        return full, spans

    def tokenize(self, messages: list[dict]) -> Tokenized:
        return self.tokenize_many([messages])[0]

    def tokenize_many(self, conversations: list[list[dict]]) -> list[Tokenized | TemplateMismatch]:
        """Batch version: one call into the fast tokenizer for all pieces of all conversations."""
        pieces: list[str] = []
        layout: list[list[tuple[int, int]] | TemplateMismatch] = []  # per conversation: (piece index, is_assistant)
        for messages in conversations:
            try:
                full, spans = self.spans(messages)
            except TemplateMismatch as e:
                layout.append(e)
                continue
            except Exception as e:  # noqa: BLE001 -- a template may raise (jinja's raise_exception) on any input
                layout.append(TemplateMismatch(f"{type(e).__name__}: {e}"))
                continue
            parts, pos = [], 0
            for start, end in spans:
                if start > pos:
                    parts.append((full[pos:start], 0))
                parts.append((full[start:end], 1))
                pos = end
            if pos < len(full):
                parts.append((full[pos:], 0))
            layout.append([(len(pieces) + j, flag) for j, (_, flag) in enumerate(parts)])
            pieces.extend(text for text, _ in parts)
        encoded = self.tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
        out: list[Tokenized | TemplateMismatch] = []
        for entry in layout:
            if isinstance(entry, TemplateMismatch):
                out.append(entry)
                continue
            ids, mask = [], []
            for index, flag in entry:
                ids.extend(encoded[index])
                mask.extend([flag] * len(encoded[index]))
            out.append(Tokenized(ids, mask))
        return out
