"""Parity of a stored SmolLM2 capture with transformers' hidden_states, for fp32 and bf16 storage."""

import torch

from eyas.config import load_config
from eyas.store import StoreReader
from eyas.data.prepared import load_prepared_arrays
from store_helpers import capture, make_prepared


def test_stored_states_equal_hidden_states(tmp_path, smollm2):
    prepared = make_prepared(tmp_path / "prepared", num_samples=3, vocab=smollm2.vocab_size, min_len=6, max_len=14)
    data = load_prepared_arrays(prepared)
    n = smollm2.num_layers
    h = smollm2.hidden_size
    for dtype, tol in (("fp32", 1e-4), ("bf16", 1e-2)):
        cfg = load_config("demo", ["target.device=cpu", f"capture.dtype={dtype}", "capture.token_budget=64"])
        store = tmp_path / dtype
        summary = capture(cfg, prepared, store, target=smollm2)  # the 3 samples share one padded pass
        assert summary["complete"] and summary["aux_layers"] == [2, 15, 27]
        reader = StoreReader(store, expect={"aux_layers": [2, 15, 27], "target": smollm2.identity, "dtype": dtype})
        assert reader.manifest["target_config"]["num_hidden_layers"] == 30
        for i in range(len(reader)):
            s = reader[i]
            row = data.sample_ids.index(s["sample_id"])
            assert torch.equal(s["input_ids"], torch.from_numpy(data.input_ids(row)))
            assert torch.equal(s["loss_mask"], torch.from_numpy(data.loss_mask(row)).long())
            ref = smollm2.model(input_ids=s["input_ids"][None], output_hidden_states=True).hidden_states
            for j, k in enumerate([2, 15, 27]):
                got, want = s["aux_hidden"][:, j * h:(j + 1) * h], ref[k][0]
                assert (got - want).abs().max() <= tol * want.abs().max(), (dtype, k)
            assert (s["final_hidden"] - ref[n][0]).abs().max() <= tol * ref[n][0].abs().max()
