"""The draft vocabulary: the `Vd` target token ids most often under the loss mask (docs/ALGORITHM.md section 2).

`d2t[i]` (int64 [Vd]) is an offset: target id = i + d2t[i]; `t2d` (bool [V]) marks the chosen target
ids. Draft ids are the chosen target ids in ascending order, so d2t is non-decreasing and the map is
a bijection from 0..Vd-1 onto the chosen set. Ranking is by count, ties broken by the lower target
id; ids never seen under the mask come after every seen id (they fill the set only when fewer than
`Vd` distinct ids were seen).
"""

from __future__ import annotations

from pathlib import Path

import torch


def count_tokens(batches, vocab_size: int) -> torch.Tensor:
    """token_counts int64 [V] from an iterable of (input_ids, loss_mask) sequence pairs."""
    from itertools import compress

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    masked: list[int] = []

    def flush() -> None:
        if masked:
            counts.add_(torch.bincount(torch.tensor(masked, dtype=torch.int64), minlength=vocab_size)[:vocab_size])
            masked.clear()

    # one bincount per million tokens: a [V] bincount per sample costs more than the counting itself
    for ids, mask in batches:
        if isinstance(ids, torch.Tensor):
            ids, mask = ids.tolist(), mask.tolist()
        masked.extend(compress(ids, mask))
        if len(masked) > 1 << 20:
            flush()
    flush()
    return counts


def build_vocab(counts: torch.Tensor, draft_vocab_size: int) -> dict[str, torch.Tensor]:
    """{d2t [Vd], t2d [V], token_counts [V]} for the `draft_vocab_size` most frequent ids."""
    vocab_size = counts.numel()
    vd = min(draft_vocab_size, vocab_size)
    ids = torch.arange(vocab_size)
    # one stable sort on -count keeps ascending ids among equal counts: deterministic ties,
    # and every unseen id (count 0) sorts after every seen one
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(ids[order[:vd]]).values  # [Vd] target ids, ascending
    d2t = chosen - torch.arange(vd)  # [Vd] offsets
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    t2d[chosen] = True
    return {"d2t": d2t.to(torch.int64), "t2d": t2d, "token_counts": counts.to(torch.int64)}


def coverage(vocab: dict[str, torch.Tensor]) -> float:
    """The share of masked tokens whose target id is in the draft vocabulary."""
    counts = vocab["token_counts"]
    total = int(counts.sum())
    return float(counts[vocab["t2d"]].sum()) / total if total else 0.0


def save_vocab(vocab: dict[str, torch.Tensor], path: str | Path) -> dict:
    """Write vocab.safetensors atomically (temporary file, fsync, rename); returns its metadata."""
    from safetensors.torch import save

    from eyas.common import atomic_write_bytes

    meta = {"draft_vocab_size": int(vocab["d2t"].numel()), "vocab_size": int(vocab["t2d"].numel()),
            "coverage": round(coverage(vocab), 6)}
    data = save({k: v.contiguous() for k, v in vocab.items()}, metadata={k: str(v) for k, v in meta.items()})
    atomic_write_bytes(path, data)
    return meta


def load_vocab(path: str | Path) -> dict[str, torch.Tensor]:
    """{d2t int64 [Vd], t2d bool [V], token_counts int64 [V]} as written by save_vocab."""
    from safetensors.torch import load_file

    from eyas.common import EyasError

    path = Path(path)
    if path.is_dir():
        path = path / "vocab.safetensors"
    if not path.is_file():
        raise EyasError(f"no draft vocabulary at {path}; run `eyas prepare` first")
    vocab = load_file(str(path))
    missing = {"d2t", "t2d", "token_counts"} - set(vocab)
    if missing:
        raise EyasError(f"{path} lacks {', '.join(sorted(missing))}; rerun `eyas prepare`")
    return vocab
