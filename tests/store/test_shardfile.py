"""Shard files are written in one streaming pass from parts, hashing as they go: byte for byte what
safetensors' save_file writes, and the returned sha256 is the file's."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import save_file

from eyas.store.shardfile import write_shard_file
from eyas.store.staging import ShardBuffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_streamed_parts_equal_save_file(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    num_tokens = 53
    aux = (torch.randn(num_tokens, 12, generator=g) * 10).to(dtype)  # [T, A*H]
    final = torch.randn(num_tokens, 4, generator=g).to(dtype)  # [T, H]
    tensors = {"input_ids": torch.arange(num_tokens, dtype=torch.int32), "loss_mask": torch.ones(num_tokens, dtype=torch.uint8),
               "offsets": torch.tensor([0, 20, 53]), "sample_index": torch.tensor([4, 1]), "aux_hidden": aux,
               "final_hidden": final, "aux_scale": torch.rand(num_tokens, 3, generator=g),
               "final_scale": torch.rand(num_tokens, 1, generator=g), "flags": torch.tensor([True, False])}
    metadata = {"eyas": json.dumps({"sample_ids": ["a", 'b"c'], "dtype": str(dtype)}, sort_keys=True)}
    save_file(tensors, str(tmp_path / "reference"), metadata=metadata)
    parts = dict(tensors, aux_hidden=[aux[:7], aux[7:7], aux[7:]], final_hidden=[final[:30], final[30:]])
    digest = write_shard_file(tmp_path / "streamed", parts, metadata)
    data = (tmp_path / "streamed").read_bytes()
    assert data == (tmp_path / "reference").read_bytes()
    assert digest == hashlib.sha256(data).hexdigest()


def test_shard_buffer_places_passes_in_order():
    layout = {"aux_hidden": (6, torch.bfloat16), "final_hidden": (2, torch.bfloat16)}
    buf = ShardBuffer(layout, capacity=10)
    first = {"aux_hidden": torch.ones(4, 6), "final_hidden": torch.ones(4, 2)}
    second = {"aux_hidden": torch.full((5, 6), 2.0), "final_hidden": torch.full((5, 2), 2.0)}
    buf.put(first)
    buf.put(second)
    assert buf.rows == 9 and buf.view("aux_hidden").shape == (9, 6) and buf.view("aux_hidden").is_contiguous()
    assert torch.equal(buf.view("final_hidden")[:, 0], torch.tensor([1.0] * 4 + [2.0] * 5, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="cannot take"):
        buf.put(second)
    buf.reset()
    assert buf.rows == 0
