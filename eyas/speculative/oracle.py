"""Scripted drafts with Eagle3Draft's interface: the classic test cases and the engine's ceiling in benchmarks.

`ScriptedDraft` knows the sequence the target will produce (prompt + its greedy output) and, for the
entry at position p (which carries token p+1), proposes token p+2 of that sequence: an oracle.
`wrong_at(p)` may mark positions where it proposes a wrong token first and the right one second, so
that chains break there while trees still find the right branch; `never_right` keeps the right token
out of its top three. Its cache stores positions only.
"""

from __future__ import annotations

import torch

from eyas.draft import DraftConfig, DraftOutput, Eagle3Draft
from eyas.layers import resolve_aux_layers


class ScriptedDraft:
    def __init__(self, sequence: list[int], vocab_size: int, wrong_at=lambda p: False, never_right: bool = False,
                 hidden_size: int = 8):
        self.sequence = list(sequence)
        self.never_right = never_right
        self.vocab_size = vocab_size
        self.wrong_at = wrong_at
        self.hidden_size = hidden_size
        self.d2t = torch.zeros(vocab_size, dtype=torch.long)
        self.num_fed = 0

    def parameters(self):
        return iter(())

    def fuse(self, aux_hidden):
        return torch.zeros(*aux_hidden.shape[:-1], self.hidden_size, device=aux_hidden.device)

    def to_target_ids(self, draft_ids):
        return draft_ids

    def _logits_at(self, p: int, token: int) -> torch.Tensor:
        logits = torch.zeros(self.vocab_size)
        right = self.sequence[p + 2] if p + 2 < len(self.sequence) else 0
        wrong = (right + 1) % self.vocab_size
        first, second = (wrong, right) if self.wrong_at(p) else (right, wrong)
        third = (right + 7) % self.vocab_size
        if self.never_right:
            first, second, third = wrong, (right + 2) % self.vocab_size, (right + 3) % self.vocab_size
        logits[first], logits[second], logits[third] = 9.0, 8.0, 7.0
        return logits

    def __call__(self, hidden, input_ids, position_ids, past_key_values=None, attention_mask=None):
        b, t = input_ids.shape
        self.num_fed += t
        rows = [self._logits_at(int(p), int(x)) for p, x in zip(position_ids[0].tolist(), input_ids[0].tolist())]
        logits = torch.stack(rows)[None].to(input_ids.device)  # [1, T, V]
        new = position_ids.float().view(b, 1, t, 1)
        k = new if past_key_values is None else torch.cat([past_key_values[0], new], dim=2)
        return DraftOutput(torch.zeros(b, t, self.hidden_size, device=input_ids.device), logits, (k, k))


def always_wrong(sequence: list[int], vocab_size: int) -> ScriptedDraft:
    return ScriptedDraft(sequence, vocab_size, never_right=True)


def untrained_draft(target, draft_vocab_size: int | None = None, target_ids: torch.Tensor | None = None,
                    seed: int = 0) -> tuple[Eagle3Draft, list[int]]:
    """A randomly initialised (seeded) EAGLE-3 draft for `target` with the target's embedding, on the
    target's device and dtype, and the default aux layers: the untrained baseline of tests and benchmarks.

    draft_vocab_size defaults to the target's vocabulary; `target_ids` ([Vd], ascending) gives the draft a
    non-identity vocabulary (a real d2t offset table, as a trained draft has). -> (draft, aux layer ids).
    """
    aux = resolve_aux_layers(None, target.num_layers)
    vd = draft_vocab_size or target.vocab_size
    cfg = DraftConfig.from_target_config(target.config.to_dict(), draft_vocab_size=vd, num_aux_layers=len(aux))
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg).eval()
    draft.embed_tokens.weight.data.copy_(target.embed_tokens.weight.detach().cpu())
    if target_ids is not None:
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        draft.set_vocab(target_ids - torch.arange(vd), t2d)
    return draft.to(device=target.device, dtype=target.dtype), aux
