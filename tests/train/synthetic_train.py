"""A small synthetic TrainSource (fixed seed) and a script entry that trains on it.

The features come from a fixed random "target" whose final state is a function of the tokens, so a
draft can learn something. Used in-process and by subprocess tests (resume after kill -9, torchrun DDP):

    python tests/train/synthetic_train.py OUT_DIR [--steps N] [--resume] [--set train.key=value ...]
"""

import argparse
import os
import sys
import time

import torch

from eyas.train.source import TrainSource

H, V, A, VD = 32, 96, 3, 64
TARGET_CONFIG = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                     vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=512, num_hidden_layers=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def synthetic_source(num_samples: int = 24, seed: int = 0) -> TrainSource:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=g)
    lm_head = torch.randn(V, H, generator=g)
    mix = torch.randn(A * H, H, generator=g) / (A * H) ** 0.5
    samples = []
    for _ in range(num_samples):
        n = int(torch.randint(12, 40, (1,), generator=g))
        ids = torch.randint(0, V, (n,), generator=g)
        aux = torch.cat([embed[ids], torch.roll(embed[ids], 1, 0), torch.randn(n, H, generator=g) * 0.1], -1)  # [n, A*H]
        final = torch.tanh(aux @ mix) * 3  # [n, H]
        loss_mask = torch.zeros(n, dtype=torch.long)
        loss_mask[n // 3:] = 1
        samples.append({"sample_id": str(len(samples)), "input_ids": ids, "loss_mask": loss_mask,
                        "aux_hidden": aux, "final_hidden": final})
    d2t = torch.zeros(VD, dtype=torch.long)
    d2t[VD // 2:] = V - VD
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.arange(VD) + d2t] = True
    return TrainSource(samples=samples, lengths=[len(s["input_ids"]) for s in samples], embed_weight=embed,
                       lm_head_weight=lm_head, target_config=TARGET_CONFIG,
                       target={"name": "synthetic", "config_hash": "0", "tokenizer_hash": "0"},
                       aux_layers=[1, 2, 3], d2t=d2t, t2d=t2d, target_model="synthetic")


class SlowSamples(list):
    """Samples that take a while to read, so that a test can kill training between checkpoints."""

    def __getitem__(self, i):
        time.sleep(float(os.environ.get("EYAS_TEST_SAMPLE_SLEEP", "0")))
        return super().__getitem__(i)


def small_config(overrides=()):
    from eyas.config import load_config

    base = ["train.steps=12", "train.ttt=3", "train.lr=3e-3", "train.warmup_steps=2", "train.batch_tokens=128",
            "train.log_every=2", "train.save_every=4", "train.keep_last=2", "data.draft_vocab=64"]
    return load_config("tiny", base + list(overrides))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from eyas.train import train

    source = synthetic_source()
    source.samples = SlowSamples(source.samples)
    train(small_config(args.set), args.out, source, resume=args.resume, device=os.environ.get("EYAS_TEST_DEVICE", "cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
