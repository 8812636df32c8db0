"""The speculators-format export, loaded by the `speculators` package from PyPI with its own config and
model classes, computes the same draft logits as eyas (fp32, three TTT steps).

speculators cannot be installed into the project's environment (see speculators_env.py for why), so
the comparison runs in a subprocess that can import it (an overlay over the project's python, else a separate
venv; built once per machine and cached under $EYAS_CACHE). Inputs and outputs cross as safetensors files.
"""

import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.formats import export, load_draft
from speculators_env import speculators_command
from test_export import sample_inputs, ttt_logits

SCRIPT = Path(__file__).with_name("speculators_logits.py")
TTT_STEPS = 3
T = 10


def test_speculators_loads_export_with_same_logits(make_run, tiny_target, tmp_path):
    # reduced vocab (d2t/t2d written), full vocab (no mapping), and EAGLE 3.1's fc_norm and norm_output on
    cases = {}
    for name, draft_vocab, layout in (("200", 200, {}), ("320", 320, {}),
                                      ("3.1", 200, {"fc_norm": True, "norm_output": True})):
        run, draft = make_run(draft_vocab=draft_vocab, name=f"run-{name}", layout=layout)
        out = export(run, tmp_path / f"spec-{name}", ["speculators"], dtype="fp32")["speculators"]
        aux, ids, pos = sample_inputs(draft, t=T)
        io = (tmp_path / f"in-{name}.safetensors", tmp_path / f"out-{name}.safetensors")
        save_file({"aux_hidden": aux, "input_ids": ids, "position_ids": pos,
                   "ttt_steps": torch.tensor([TTT_STEPS])}, str(io[0]))
        cases[name] = (draft, out, (aux, ids, pos), io)

    # the exports carry no embedding: speculators reads it from the verifier dir (the tiny target), as eyas
    # takes the target's; one subprocess for both, since importing speculators is most of the cost
    args = [str(a) for _, out, _, io in cases.values() for a in (out, *io)]
    python, env = speculators_command()
    proc = subprocess.run([python, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    for name, (draft, out, inputs, io) in cases.items():
        draft_vocab = draft.cfg.draft_vocab_size
        theirs = load_file(io[1])
        assert theirs["aux_layer_ids"].tolist() == [1, 2, 3]
        assert theirs["layout"].tolist() == [draft.cfg.fc_norm, draft.cfg.norm_output, draft.cfg.fc_norm], name
        ours, _ = load_draft(out, embed_tokens=tiny_target.embed_tokens.weight)
        with torch.no_grad():
            mine = ttt_logits(ours, *inputs, TTT_STEPS)
            torch.testing.assert_close(mine, ttt_logits(draft, *inputs, TTT_STEPS), rtol=0, atol=0)
        assert theirs["logits"].shape == mine.shape == (TTT_STEPS, 1, T, draft_vocab)
        # fp32, default tolerances (rtol 1.3e-6, atol 1e-5): same math, different kernels
        torch.testing.assert_close(theirs["logits"], mine)
        assert mine.std() > 0.1  # the comparison is not between two constant tensors
        if draft_vocab < draft.cfg.vocab_size:
            assert torch.equal(theirs["d2t"], draft.d2t) and torch.equal(theirs["t2d"], draft.t2d)
        else:
            assert "d2t" not in theirs
