"""SpecForge's offline EAGLE-3 trainer on an eyas store, beside eyas's own: same data, same draft vocabulary,
same knobs where SpecForge has them, both drafts scored by the same `eyas eval`.

    python bench/peer_specforge.py --store STORE --out DIR [--config full] [--set train.steps=200 ...]
        [--eyas-run RUN | --train-eyas] [--bench mt-bench ...] [--limit N] [--stage convert|train|export|eval|all]

SpecForge (PyPI `specforge==0.2.0`, torch 2.11) must be importable, e.g. from a folder of its wheel and its
missing dependencies installed with `pip install --no-deps --target SITE` and `--specforge-path SITE`.

Stages (each writes under DIR and may be run alone):

  convert  DIR/features/NNNNNNNN.ckpt   one file per store sample, SpecForge's offline format: a dict
                                         {input_ids [T] int64, loss_mask [T] int64, hidden_state [1, T, H],
                                         aux_hidden_state [1, T, A*H]} written with torch.save (the format
                                         SpecForge's OfflineManifestReader reads); hidden_state is the
                                         store's post-norm final state, which SpecForge feeds to the target's
                                         lm_head alone, as eyas does
           DIR/target/                   the target as SpecForge reads it offline: the store's HF config and
                                         a model.safetensors (+ index) holding only the embedding and lm_head
           DIR/vocab_mapping.pt          the prepared dir's draft vocabulary (d2t offsets [Vd], t2d bool [V]);
                                         both trainers use the same one
           DIR/draft_config.json         SpecForge's LlamaForCausalLMEagle3 config for the same target
           DIR/specforge.yaml            its run config, from the eyas config (the knob table is printed)
  train    SpecForge's `specforge train -c DIR/specforge.yaml`, log in DIR/specforge-train.log
  export   SpecForge's own `specforge export --to hf` (it reads its pickled checkpoint itself), then
           DIR/draft/: the vLLM layout eyas loads (layers.0.*, fc, norm, lm_head, d2t, t2d; aux ids top-level);
           a parity line compares one draft step of SpecForge's own model with eyas's reading of DIR/draft
  eval     `eyas eval` of DIR/draft and of the eyas draft (--eyas-run, or DIR/eyas-run with --train-eyas,
           which `eyas train`s the same store with the same config first), then the table

SpecForge fixes some of what eyas makes a setting: its cosine decays to 0, and its loss is EAGLE's reference
(the knob table marks each as NOT matched where the eyas config differs). For the same objective on the eyas
side pass `--set train.min_lr_ratio=0 --set train.loss_mask_token=position --set train.loss_norm=all
--set train.mask_oov_target=true`. SpecForge counts a step in samples: a micro-batch holds at most
batch_tokens // longest samples (padded to its longest, the memory bound eyas keeps) and accumulates the rest
of eyas's mean samples per step. It trains in bf16 with fp32 AdamW masters (its target head is bf16 always).

On a machine without CUDA the trainer runs on the CPU with three stand-ins, all in its process only:
SpecForge's Triton soft cross-entropy is replaced by the same sum in plain torch, torch.compile is off
(TORCHDYNAMO_DISABLE=1), and FSDP (which wants an accelerator) is its NO_SHARD path, DDP over gloo; attention
is SDPA there, flex_attention on CUDA.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


# knobs SpecForge fixes in code, against the eyas setting that computes the same thing
SPECFORGE_FIXED = {
    "loss_decay": 0.8,  # Eagle3TrainStrategy's ploss_decay
    "weight_decay": 0.0,  # BF16Optimizer's AdamW
    "min_lr_ratio": 0.0,  # CosineAnnealingWarmupLR decays to 0
    "loss_mask_token": "position",  # the loss mask shifts with the TTT step, as EAGLE's reference
    "loss_norm": "all",  # each step's loss is a mean over all B*T positions
    "mask_oov_target": True,  # positions whose target top-1 is outside the draft vocabulary are dropped
    "loss": "kl",
}


# ---------------------------------------------------------------- convert

def write_features(store, out: Path, max_len: int, indices: list[int]) -> dict:
    """One SpecForge offline file per store sample of `indices` (eyas's training samples: its held-out ones stay
    out of both trainers); returns {num_samples, num_tokens, longest, lengths}."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.ckpt"):  # SpecForge reads every file in the folder
        stale.unlink()
    lengths = []
    for i in indices:
        s = store[i]
        t = min(len(s["input_ids"]), max_len)
        record = {
            "input_ids": s["input_ids"][:t].clone(),  # [T]
            "loss_mask": s["loss_mask"][:t].clone(),  # [T]
            # clone: a slice is a view of the whole shard, and torch.save writes a view's entire storage
            "hidden_state": s["final_hidden"][:t].unsqueeze(0).clone(),  # [1, T, H]
            "aux_hidden_state": s["aux_hidden"][:t].unsqueeze(0).clone(),  # [1, T, A*H]
        }
        torch.save(record, out / f"{i:08d}.ckpt")
        lengths.append(t)
    return {"num_samples": len(lengths), "num_tokens": sum(lengths), "longest": max(lengths), "lengths": lengths}


def write_target(store_dir: Path, manifest: dict, out: Path) -> None:
    """The target's config and its embedding and lm_head, in the layout SpecForge's loaders read."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    head = load_file(str(store_dir / "target_head.safetensors"))
    weights = {"model.embed_tokens.weight": head["embed_tokens.weight"].contiguous(),
               "lm_head.weight": head["lm_head.weight"].contiguous()}
    save_file(weights, str(out / "model.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}, indent=1))
    cfg = dict(manifest["target_config"])
    cfg["architectures"] = cfg.get("architectures") or ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def write_vocab(vocab: dict, out: Path) -> None:
    """SpecForge's vocab-mapping file: the same d2t offsets (target id = i + d2t[i]) and t2d mask as eyas's."""
    torch.save({"d2t": vocab["d2t"].long().contiguous(), "t2d": vocab["t2d"].bool().contiguous()}, out)


def draft_config(manifest: dict, draft_vocab_size: int) -> dict:
    """SpecForge's LlamaForCausalLMEagle3 config: one Llama layer of the target's shape, the draft vocabulary,
    and the aux ids in its (SGLang) convention, HF - 1. `norm_output` is left out: SpecForge's default (true)
    is plain EAGLE-3, logits from the normed state and the un-normed state fed back."""
    tc = manifest["target_config"]
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
            "rope_parameters", "attention_bias", "mlp_bias", "pretraining_tp")
    cfg = {k: tc[k] for k in keys if tc.get(k) is not None}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               vocab_size=int(manifest["vocab_size"]), draft_vocab_size=int(draft_vocab_size),
               target_hidden_size=int(manifest["hidden_size"]), tie_word_embeddings=False, use_cache=True,
               pad_token_id=tc.get("pad_token_id") or 0,
               eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in manifest["aux_layers"]],
                             "use_aux_hidden_state": True})
    return cfg


def plan_batches(lengths: list[int], batch_tokens: int, grad_accum: int, epochs: float, steps: int,
                 seed: int) -> dict:
    """eyas's own batch plan for these sample lengths: samples and tokens per optimizer step, and the step count."""
    import random

    from eyas.train.data import pack

    lengths = [min(t, batch_tokens) for t in lengths]
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    batches = pack(order, lengths, batch_tokens)
    total_steps = steps or max(1, math.ceil(epochs * len(batches) / grad_accum))
    return {"batches_per_epoch": len(batches), "samples_per_batch": len(lengths) / len(batches),
            "tokens_per_epoch": sum(lengths), "steps": total_steps}


def run_config(cfg, out: Path, plan: dict, stats: dict, device: str) -> tuple[dict, list[tuple]]:
    """SpecForge's run config from the eyas config, and the knob table (knob, eyas, SpecForge, note)."""
    tc = cfg.train
    # the same samples per optimizer step as eyas's plan; SpecForge pads a micro-batch to its longest sample, so
    # a micro-batch holds at most batch_tokens // longest samples (eyas's memory bound) and the rest accumulates
    # (as few micro-batches as fit, then the micro-batch size that comes closest to eyas's samples per step)
    wanted = max(1, round(plan["samples_per_batch"] * tc.grad_accum))
    cap = max(1, tc.batch_tokens // stats["longest"])
    accumulation = math.ceil(wanted / cap)
    batch_size = max(1, min(cap, round(wanted / accumulation)))
    samples_per_step = batch_size * accumulation
    epochs = max(1, math.ceil(plan["steps"] * samples_per_step / stats["num_samples"]) + 1)
    warmup_ratio = min(1.0, tc.warmup_steps / plan["steps"])
    while int(warmup_ratio * plan["steps"]) < min(tc.warmup_steps, plan["steps"]):  # SpecForge floors it
        warmup_ratio = math.nextafter(warmup_ratio, 2.0)
    attention = "flex_attention" if device == "cuda" else "sdpa"
    doc = {
        "run_id": "peer",
        "output_dir": str(out / "specforge-run"),
        "model": {"target_model_path": str(out / "target"), "draft_model_config": str(out / "draft_config.json"),
                  "vocab_mapping_path": str(out / "vocab_mapping.pt"),
                  "embedding_key": "model.embed_tokens.weight", "lm_head_key": "lm_head.weight",
                  "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(out / "features"), "max_length": int(stats["longest"]),
                 "dataloader_num_workers": 4 if device == "cuda" else 1, "cache_dir": str(out / "specforge-cache")},
        "training": {"strategy": "eagle3", "num_epochs": epochs, "max_steps": plan["steps"],
                     "total_steps": plan["steps"], "batch_size": batch_size, "accumulation_steps": accumulation,
                     "learning_rate": tc.lr, "lr_scheduler": "cosine", "warmup_ratio": warmup_ratio,
                     "max_grad_norm": tc.grad_clip, "ttt_length": tc.ttt, "attention_backend": attention,
                     "seed": tc.seed, "save_interval": plan["steps"], "log_interval": tc.log_every,
                     # FSDP wants an accelerator; on the CPU SpecForge's NO_SHARD path is plain DDP over gloo
                     "fsdp_sharding": "SHARD_GRAD_OP" if device == "cuda" else "NO_SHARD"},
    }
    mean_len = plan["tokens_per_epoch"] / stats["num_samples"]
    knobs = [
        ("steps", plan["steps"], plan["steps"], "max_steps = total_steps"),
        ("lr (peak)", tc.lr, tc.lr, ""),
        ("warmup steps", tc.warmup_steps, int(warmup_ratio * plan["steps"]), "warmup_ratio"),
        ("ttt", tc.ttt, tc.ttt, ""),
        ("grad clip", tc.grad_clip, tc.grad_clip, ""),
        ("tokens/step", f"~{plan['tokens_per_epoch'] / plan['batches_per_epoch'] * tc.grad_accum:.0f} "
         f"(~{plan['samples_per_batch'] * tc.grad_accum:.1f} samples)",
         f"~{samples_per_step * mean_len:.0f} ({batch_size} samples x {accumulation} accumulated)",
         "SpecForge counts samples, not tokens"),
        ("data order", "length-sorted windows" if tc.batching == "sorted" else "shuffled batches", "SpecForge's shuffle",
         "same samples, other order"),
        ("attention", tc.attention, attention, ""),
        ("dtype", tc.dtype, "bf16", "SpecForge: bf16 weights, features and target head, fp32 AdamW masters"),
    ]
    for name, fixed in SPECFORGE_FIXED.items():
        ours = getattr(tc, name)
        knobs.append((name, ours, fixed, "fixed in SpecForge" + ("" if ours == fixed else ": NOT matched")))
    return doc, knobs


def convert(args, cfg) -> list[tuple]:
    import yaml

    from eyas.data.vocab import load_vocab
    from eyas.store.reader import StoreReader
    from eyas.train.source import held_out_split

    out = Path(args.out)
    store = StoreReader(args.store, dtype=torch.bfloat16)  # SpecForge's target head is bf16 always
    manifest = store.manifest
    vocab = load_vocab(args.vocab or _prepared_vocab(Path(args.store)))
    if vocab["t2d"].numel() != manifest["vocab_size"]:
        raise SystemExit(f"the draft vocabulary maps {vocab['t2d'].numel()} target ids, the store's target has "
                         f"{manifest['vocab_size']}")
    # the records hold every token's aux and final states in bf16 again: as much disk as a bf16 store
    need = int(manifest["num_tokens"]) * (len(manifest["aux_layers"]) + 1) * int(manifest["hidden_size"]) * 2
    free = shutil.disk_usage(out if out.exists() else out.parent).free
    if need > 0.95 * free:
        raise SystemExit(f"SpecForge's copy of the store needs about {need / 2**30:.1f} GiB, {out} has "
                         f"{free / 2**30:.1f} GiB free")
    train_idx, held = held_out_split(len(store), cfg.train.val_samples, cfg.train.seed)
    stats = write_features(store, out / "features", cfg.train.batch_tokens, train_idx)
    plan = plan_batches(stats.pop("lengths"), cfg.train.batch_tokens, cfg.train.grad_accum, cfg.train.epochs,
                        cfg.train.steps, cfg.train.seed)
    write_target(Path(args.store), manifest, out / "target")
    write_vocab(vocab, out / "vocab_mapping.pt")
    (out / "draft_config.json").write_text(json.dumps(draft_config(manifest, vocab["d2t"].numel()), indent=1))
    doc, knobs = run_config(cfg, out, plan, stats, args.device)
    (out / "specforge.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (out / "peer.json").write_text(json.dumps({"store": str(Path(args.store).resolve()), "plan": plan,
                                               "features": stats, "held_out": held, "aux_layers": manifest["aux_layers"],
                                               "knobs": [list(map(str, k)) for k in knobs]}, indent=1))
    print(f"converted {stats['num_samples']} samples ({stats['num_tokens']:,} tokens) -> {out / 'features'}; "
          f"{len(held)} held out as eyas holds them out (train.val_samples)")
    return knobs


def _prepared_vocab(store: Path) -> Path:
    """The draft vocabulary of the prepared data the store was captured from."""
    prepared = (json.loads((store / "manifest.json").read_text()).get("prepared") or {}).get("path")
    if prepared and (Path(prepared) / "vocab.safetensors").is_file():
        return Path(prepared) / "vocab.safetensors"
    raise SystemExit(f"{store}: its manifest names no prepared dir with a vocab.safetensors; pass --vocab")


# ---------------------------------------------------------------- train (SpecForge in a child process)

def _env(args) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [p for p in (args.specforge_path, env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if args.device != "cuda":
        env.update(TORCHDYNAMO_DISABLE="1", SPECFORGE_DEVICE="cpu", CUDA_VISIBLE_DEVICES="")
    return env


def _run(cmd: list[str], log: Path, env: dict) -> float:
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            f.write(line)
            if re.match(r"step \d+:", line) or "Error" in line or "error" in line[:40]:
                print("  " + line.rstrip()[:240], flush=True)
        rc = proc.wait()
    if rc:
        raise SystemExit(f"{cmd[2] if len(cmd) > 2 else cmd[0]} failed (exit {rc}); see {log}")
    return time.perf_counter() - start


def train_specforge(args) -> float:
    out = Path(args.out)
    shutil.rmtree(out / "specforge-run", ignore_errors=True)  # SpecForge would resume from (or rewind) it
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_specforge", "train", "-c", str(out / "specforge.yaml")]
    return _run(cmd, out / "specforge-train.log", _env(args))


def _cpu_loss(logits, target_p, position_mask):
    """SpecForge's soft cross-entropy (its Triton kernel's sum): -sum_v p log q at each counted position, mean
    over all B*T positions."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, Vd]
    return -(position_mask * (target_p * logp).sum(-1, keepdim=True)).mean()


def specforge_logits(hf_dir: str, probe: str) -> int:
    """SpecForge's own draft (its exported HF dir, its classes) on the probe's first sample: one plain draft
    step, logits into the probe file beside its inputs. `parity` compares them with eyas's reading."""
    from safetensors.torch import load_file, save_file
    from specforge.modeling.auto import AutoDraftModel
    from transformers import AutoConfig

    # built as training builds it (from_pretrained under transformers 5 leaves the rotary buffers unset: NaN)
    model = AutoDraftModel.from_config(AutoConfig.from_pretrained(hf_dir), attention_backend="sdpa").float().eval()
    model.load_state_dict(load_file(str(Path(hf_dir) / "model.safetensors")), strict=True)
    t = load_file(probe)
    with torch.no_grad():
        normed = model(t["aux_hidden"], model.embed_input_ids(t["input_ids"]), ttt_length=1)  # [1, T, H]
        t["specforge_logits"] = model.lm_head(normed).float().contiguous()  # [1, T, Vd]
    save_file(t, probe)
    return 0


def specforge_main(argv: list[str]) -> int:
    """SpecForge's CLI in this process; without CUDA its Triton loss is swapped for `_cpu_loss` first."""
    if argv[0] == "logits":
        return specforge_logits(*argv[1:])
    if not torch.cuda.is_available():
        from specforge.core import loss

        loss.LogSoftmaxLoss.apply = staticmethod(_cpu_loss)
    from specforge.cli import main

    return main(argv)


# ---------------------------------------------------------------- export (SpecForge's HF dir -> eyas-loadable vLLM layout)

def export_specforge(args) -> Path:
    out = Path(args.out)
    hf = out / "specforge-hf"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_specforge", "export", "--to", "hf",
           "--checkpoint", str(out / "specforge-run"), "--draft-config", str(out / "draft_config.json"),
           "--output-dir", str(hf), "--vocab-mapping", str(out / "vocab_mapping.pt"),
           "--embedding-source", str(out / "target")]
    _run(cmd, out / "specforge-export.log", _env(args))
    peer = json.loads((out / "peer.json").read_text())
    draft = to_vllm_layout(hf, out / "draft", peer["aux_layers"])
    print(f"parity: eyas's reading of the export vs SpecForge's model, first sample: {parity(args, hf, draft)}")
    return draft


def parity(args, hf: Path, draft: Path) -> str:
    """One draft step on the store's first sample (up to 64 tokens), fp32, through SpecForge's classes on its
    own export and through eyas's `load_draft` on the converted one: the largest logit difference."""
    from safetensors.torch import load_file, save_file

    from eyas.formats import load_draft
    from eyas.store.reader import StoreReader

    s = StoreReader(args.store)[0]
    t = min(64, len(s["input_ids"]))
    probe = Path(args.out) / "parity.safetensors"
    save_file({"input_ids": s["input_ids"][None, :t].contiguous(), "aux_hidden": s["aux_hidden"][None, :t].contiguous()},
              str(probe))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_specforge", "logits", str(hf), str(probe)]
    _run(cmd, Path(args.out) / "parity.log", _env(args))
    got = load_file(str(probe))
    embed = load_file(str(hf / "model.safetensors"))["embed_tokens.weight"]  # the copy SpecForge's model holds
    model, _ = load_draft(draft, embed_tokens=embed.float())
    with torch.no_grad():
        hidden = model.fuse(got["aux_hidden"])  # [1, T, H]
        logits = model(hidden, got["input_ids"], torch.arange(t)[None]).logits  # [1, T, Vd]
    ref = got["specforge_logits"]
    diff = (logits - ref).abs().max().item()
    scale = ref.abs().max().item()
    same = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return f"max |logit diff| {diff:.2e} (max |logit| {scale:.2f}), argmax agrees at {same:.1%} of {t} tokens"


def to_vllm_layout(hf: Path, dest: Path, aux_layers: list[int]) -> Path:
    """SpecForge's HF draft (midlayer.*, its own config) -> the flat vLLM layout: layers.0.*, no embedding, a
    config whose top-level aux ids are HF ids and whose layout flags say plain EAGLE-3."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eyas.formats.keys import from_foreign

    files = sorted(hf.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{hf}: no safetensors weights from SpecForge's export")
    raw = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            raw.update({k: sf.get_tensor(k) for k in sf.keys()})
    raw.pop("embed_tokens.weight", None)
    raw.pop("model.embed_tokens.weight", None)
    state = from_foreign(raw, str(hf))  # every name mapped explicitly; an unknown one stops here
    src = json.loads((hf / "config.json").read_text())
    if src.get("fc_norm"):
        raise SystemExit(f"{hf}: fc_norm drafts are not converted")
    if src.get("norm_output") is False:
        raise SystemExit(f"{hf}: norm_output=false (logits from the un-normed state) is not plain EAGLE-3")
    cfg = {k: v for k, v in src.items() if k not in ("eagle_config", "norm_output", "fc_norm", "auto_map")}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               eagle_aux_hidden_state_layer_ids=list(aux_layers), num_aux_hidden_states=len(aux_layers),
               norm_before_residual=False, tie_word_embeddings=False,
               eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_layers],
                             "use_aux_hidden_state": True})
    dest.mkdir(parents=True, exist_ok=True)
    out_state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    save_file(out_state, str(dest / "model.safetensors"))
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    return dest


# ---------------------------------------------------------------- eyas side and eval

def _eyas(args, verb: str, extra: list[str], log: Path) -> float:
    cmd = [sys.executable, "-m", "eyas", verb, "--config", args.config] + \
          [x for s in args.set for x in ("--set", s)] + extra
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return _run(cmd, log, env)


def evaluate(args, name: str, draft: Path) -> dict:
    out = Path(args.out) / f"eval-{name}"
    extra = ["--draft", str(draft), "--out-dir", str(out)] + [x for b in args.bench for x in ("--bench", b)]
    if args.limit:
        extra += ["--limit", str(args.limit)]
    if args.target:
        extra += ["--target", args.target]
    _eyas(args, "eval", extra + ["--no-hf-baseline"], Path(args.out) / f"eval-{name}.log")
    return json.loads((out / "summary.json").read_text())


def _final_metrics(log: Path) -> dict:
    """The last `step N: {...}` line of SpecForge's log."""
    last = {}
    for line in log.read_text().splitlines():
        m = re.match(r"step (\d+): (\{.*\})", line)
        if m:
            values = ast.literal_eval(re.sub(r"\b(nan|inf)\b", "None", m.group(2)))
            last = {"step": int(m.group(1)), **values}
    return last


def table(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    width = {k: max(len(k), *(len(_fmt(r.get(k))) for r in rows)) for k in keys}
    print(" | ".join(k.ljust(width[k]) for k in keys))
    print("-+-".join("-" * width[k] for k in keys))
    for r in rows:
        print(" | ".join(_fmt(r.get(k)).ljust(width[k]) for k in keys))


def _fmt(v) -> str:
    return "" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _headline(summary: dict) -> dict:
    """tau and speedup per benchmark and setting of an eval dir's summary.json."""
    out = {}
    for stem, res in sorted((summary.get("results") or {}).items()):
        out[f"{stem} tau"] = res.get("tau_pooled")
        out[f"{stem} speedup"] = res.get("speedup_vs_plain")
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_specforge":
        raise SystemExit(specforge_main(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="store written by `eyas capture`")
    ap.add_argument("--vocab", default="", help="draft vocabulary (default: the prepared dir's, via the manifest)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="demo", help="eyas preset or YAML whose train section both trainers use")
    ap.add_argument("--set", action="append", default=[], help="eyas --set override (repeatable)")
    ap.add_argument("--target", default="", help="eyas eval --target (default: the config's)")
    ap.add_argument("--specforge-path", default="", help="folder holding specforge and its missing dependencies")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--stage", default="all", choices=("convert", "train", "export", "eval", "all"))
    ap.add_argument("--eyas-run", default="", help="an eyas draft trained on the same store, evaluated beside")
    ap.add_argument("--train-eyas", action="store_true", help="eyas train the same store into OUT/eyas-run first")
    ap.add_argument("--bench", action="append", default=[], help="eyas eval --bench (repeatable)")
    ap.add_argument("--limit", type=int, default=0, help="eyas eval --limit")
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    from eyas.config import load_config

    cfg = load_config(args.config, args.set)
    done = Path(args.eyas_run) / "summary.json"
    if args.eyas_run and not cfg.train.steps and done.is_file():  # the eyas run's own step count, not a re-plan
        cfg.train.steps = int(json.loads(done.read_text())["steps"])
        print(f"steps: {cfg.train.steps}, as {args.eyas_run} trained")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = ("convert", "train", "export", "eval") if args.stage == "all" else (args.stage,)
    rows = []
    if "convert" in stages:
        knobs = convert(args, cfg)
        print("\nknob | eyas | SpecForge | note")
        for k in knobs:
            print(" | ".join(map(str, k)))
        print()
    if "train" in stages:
        wall = train_specforge(args)
        (out / "specforge-train.json").write_text(json.dumps({"wall_s": wall}))
    if "export" in stages:
        print(f"SpecForge draft -> {export_specforge(args)}")
    if "eval" in stages:
        eyas_draft = Path(args.eyas_run) if args.eyas_run else None
        if args.train_eyas:
            eyas_draft = out / "eyas-run"
            plan = json.loads((out / "peer.json").read_text())["plan"]
            wall = _eyas(args, "train", ["--store", args.store, "--out", str(eyas_draft), "--steps", str(plan["steps"])]
                         + (["--vocab", args.vocab] if args.vocab else []), out / "eyas-train.log")
            (out / "eyas-train.json").write_text(json.dumps({"wall_s": wall}))
        sf = _final_metrics(out / "specforge-train.log")
        sf_wall = json.loads((out / "specforge-train.json").read_text())["wall_s"]
        rows.append({"trainer": "specforge", "steps": sf.get("step"), "train_s": sf_wall, "last acc0": sf.get("acc_0"),
                     **_headline(evaluate(args, "specforge", out / "draft"))})
        if eyas_draft is not None:
            wall_file, run_summary = out / "eyas-train.json", eyas_draft / "summary.json"
            ours = json.loads(run_summary.read_text()) if run_summary.is_file() else {}
            rows.append({"trainer": "eyas", "steps": ours.get("steps"), "last acc0": ours.get("acc_0"),
                         "train_s": json.loads(wall_file.read_text())["wall_s"] if wall_file.is_file() else None,
                         **_headline(evaluate(args, "eyas", eyas_draft))})
        print()
        table(rows)


if __name__ == "__main__":
    main()
