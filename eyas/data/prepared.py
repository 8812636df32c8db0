"""Read a prepared directory (docs/INTERNALS.md "Prepared data") into flat token arrays, for capture and online
training."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eyas.common import EyasError, read_json


@dataclass
class Prepared:
    path: str
    sample_ids: list[str]  # [N]
    tokens: np.ndarray  # [sum T_i] int64
    masks: np.ndarray  # [sum T_i] uint8
    offsets: np.ndarray  # [N+1] int64
    fingerprint: str  # sha256 prefix of the content (ids, tokens, masks)
    info: dict  # prepare.json, or {} when absent

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)  # [N]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def input_ids(self, row: int) -> np.ndarray:
        return self.tokens[self.offsets[row]:self.offsets[row + 1]]

    def loss_mask(self, row: int) -> np.ndarray:
        return self.masks[self.offsets[row]:self.offsets[row + 1]]


class PreparedSamples:
    """Map-style samples `{input_ids, loss_mask}` (int64 tensors [T]) over a prepared directory: what online
    training reads, the target computing each batch's features as it goes."""

    def __init__(self, prepared: Prepared):
        self.prepared = prepared

    def __len__(self) -> int:
        return len(self.prepared)

    def __getitem__(self, i: int) -> dict:
        import torch

        return {"input_ids": torch.from_numpy(self.prepared.input_ids(i).copy()),
                "loss_mask": torch.from_numpy(self.prepared.loss_mask(i).astype("int64"))}


def _open_dataset(path: Path):
    from eyas.data.prepare import load_prepared

    return load_prepared(path)


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """A (chunked) arrow list column -> (values [sum T], offsets [N+1])."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = np.asarray(array.offsets.to_numpy(), dtype=np.int64)
    values = array.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    return values, offsets - offsets[0]


def load_prepared_arrays(path: str | Path) -> Prepared:
    path = Path(path)
    if not (path / "dataset").is_dir():
        raise EyasError(f"{path} is not a prepared directory (no dataset/ inside); create it with `eyas prepare`")
    ds = _open_dataset(path)
    missing = {"sample_id", "input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise EyasError(f"{path}/dataset lacks the column(s) {sorted(missing)}; recreate it with `eyas prepare`")
    if getattr(ds, "_indices", None) is not None:
        ds = ds.flatten_indices()
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    tokens, offsets = _flat(table.column("input_ids"))
    masks, mask_offsets = _flat(table.column("loss_mask"))
    if not np.array_equal(offsets, mask_offsets):
        raise EyasError(f"{path}/dataset: input_ids and loss_mask differ in length for some samples; re-run `eyas prepare`")
    sample_ids = [str(s) for s in table.column("sample_id").to_pylist()]
    if len(set(sample_ids)) != len(sample_ids):
        raise EyasError(f"{path}/dataset: sample_id values are not unique; re-run `eyas prepare`")
    if len(sample_ids) and np.diff(offsets).min() < 1:
        raise EyasError(f"{path}/dataset holds empty samples; re-run `eyas prepare`")
    tokens, masks = tokens.astype(np.int64), masks.astype(np.uint8)
    h = hashlib.sha256()
    for part in ("\n".join(sample_ids).encode(), offsets.tobytes(), tokens.tobytes(), masks.tobytes()):
        h.update(part)
    info = read_json(path / "prepare.json") if (path / "prepare.json").is_file() else {}
    return Prepared(str(path.resolve()), sample_ids, tokens, masks, offsets, h.hexdigest()[:16], info)
