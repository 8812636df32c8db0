"""Training on CUDA: the vectorised TTT forward against the step-by-step reference, bf16 autocast training,
and the FSDP2 path under torchrun (one process per GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "train"))

pytestmark = pytest.mark.gpu


def test_ttt_on_cuda_equals_the_kv_cache_reference():
    from test_ttt import make_batch, make_draft, naive_logits

    from eyas.train.ttt import ttt_forward

    draft = make_draft().cuda()
    batch = {k: v.cuda() for k, v in make_batch([40, 33]).items()}
    lm = torch.randn(64, 32, device="cuda")
    res = ttt_forward(draft, batch, lm, ttt=4, return_logits=True)
    ref = naive_logits(draft, batch, 4)
    for k in range(4):
        n = 40 - 1 - k
        torch.testing.assert_close(res.logits_k[k][:, :n], ref[k][:, :n], rtol=2e-3, atol=2e-3)


def test_bf16_training_on_cuda_learns(tmp_path):
    from synthetic_train import small_config, synthetic_source

    from eyas.train import train

    cfg = small_config(["train.steps=40", "train.log_every=10", "train.save_every=20", "train.dtype=bf16"])
    summary = train(cfg, tmp_path, synthetic_source(), device="cuda")
    import json

    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    assert summary["peak_mem_GiB"] > 0


@pytest.mark.parametrize("fsdp", ["false", "true"])
def test_torchrun_ddp_and_fsdp2(tmp_path, fsdp):
    n = min(torch.cuda.device_count(), 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           str(ROOT / "tests" / "train" / "synthetic_train.py"), str(tmp_path), "--set", "train.steps=6",
           "--set", f"train.fsdp={fsdp}", "--set", "train.save_every=3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EYAS_TEST_DEVICE": "cuda"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "latest" / "model.safetensors").is_file()
    # resume under the same wrapping restores the optimizer state through the same path
    out = subprocess.run(cmd[:-2] + ["--set", "train.steps=8", "--resume"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert os.readlink(tmp_path / "latest") == "step-0000008"


@pytest.mark.parametrize("attention, compiled, compile_loss", [("dense", False, False), ("dense", True, False),
                                                                ("flex", False, False), ("flex", True, False),
                                                                ("flex", True, True)])
def test_fast_paths_on_cuda_match_the_reference(attention, compiled, compile_loss):
    """The optimised TTT paths (bench/train.py's configurations) against the reference, bf16 autocast; the last
    with the soft cross-entropy compiled too (train.compile_loss).
    FlexAttention's CUDA kernel needs a head_dim of at least 16 (the training loop uses dense below that)."""
    from test_ttt import H, V, make_batch, make_draft

    from eyas.train.loop import TTTModule

    batch = {k: v.cuda() for k, v in make_batch([40, 33]).items()}
    lm = torch.randn(V, H, device="cuda")
    out = {}
    for impl in ("reference", "fast"):
        draft = make_draft(head_dim=16).cuda()
        model = TTTModule(draft, 4, 0.8, "fused", impl=impl, attention=attention, compile=compiled and impl == "fast",
                          compile_loss=compile_loss)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            res = model(batch, lm)
        res.loss.backward()
        out[impl] = (res, {n: p.grad for n, p in draft.named_parameters() if p.grad is not None})
    (ref, ref_grads), (fast, fast_grads) = out["reference"], out["fast"]
    torch.testing.assert_close(fast.loss, ref.loss, rtol=2e-2, atol=2e-2)
    assert fast.count_k == ref.count_k
    for name, g in ref_grads.items():
        torch.testing.assert_close(fast_grads[name], g, rtol=0.1, atol=0.05 * g.abs().max().item(), msg=name)


def test_bench_train_runs_every_configuration():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "train.py"), "--small", "--steps", "2", "--max-seq", "1536"],
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed" not in out.stdout, out.stdout[-3000:]
    assert "flex+compile" in out.stdout and "longest sequence" in out.stdout
