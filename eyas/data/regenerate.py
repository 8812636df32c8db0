"""Regeneration: the target writes the assistant responses it will later be asked to speculate on.

Local mode runs batched generation in this process: prompts sorted by length (little padding),
left-padded batches, one prefill and then one token per step for the rows still running. Rows that
hit an end-of-turn token or the token limit leave the batch and its KV cache, so the cost per step
falls as rows finish. Greedy by default; temperature > 0 samples with a seeded generator.

Results are appended, one JSON line per prompt, to a JSONL file and flushed after every batch, so a
crash loses at most one batch; a rerun reads the file, skips finished ids and continues. Each line
carries the hash of the messages it answers, so an id whose prompt changed is generated again (the
newest line of an id wins). A torn last line (the process died mid-write) is cut off before appending.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from eyas.common import progress


# ---------------------------------------------------------------- the results file

def prompt_sha(messages: list[dict]) -> str:
    """A result answers these exact messages: a rerun whose input changed under the same id regenerates it."""
    from eyas.common import sha256_json

    return sha256_json(messages)[:16]


def answers(result: dict | None, messages: list[dict]) -> bool:
    """True when `result` answers these messages. Lines written before results carried the hash
    (no `prompt_sha`) are taken as they are, so that an older run still resumes."""
    return result is not None and result.get("prompt_sha", prompt_sha(messages)) == prompt_sha(messages)


def pending(prompts: list[dict], done: dict[str, dict]) -> list[dict]:
    """The prompts without a result for their current messages (resume skips the rest)."""
    return [p for p in prompts if not answers(done.get(p["id"]), p["messages"])]


def repeated_tail(text: str, min_period: int = 8, max_period: int = 400) -> int:
    """Characters at the end of `text` that only repeat the ones a period before them (0 if none).

    A greedy small target often ends an answer by repeating a sentence until the token limit: the end is
    then periodic, text[i] == text[i - p] for the last r characters, with r >= p (at least two copies,
    the last one possibly cut off). The longest such r over periods of min_period..max_period characters
    is returned. Each period costs one comparison, plus a binary search when it matches.
    """
    n, best = len(text), 0
    for p in range(min_period, min(max_period, n // 2) + 1):
        if text[n - p:] != text[n - 2 * p:n - p]:
            continue  # not even two periods at the end
        lo, hi = p, n - p  # the longest r with text[n - r:] == text[n - r - p:n - p]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if text[n - mid:] == text[n - mid - p:n - p]:
                lo = mid
            else:
                hi = mid - 1
        best = max(best, lo)
    return best


def repetition(records: Iterable[dict]) -> dict:
    """How many responses end in a repetition loop and about what share of their tokens the repeats are
    (each response's repeated characters / its characters, times its tokens)."""
    looping, repeated, tokens = 0, 0.0, 0
    for rec in records:
        text, num = str(rec.get("response", "")), int(rec.get("num_tokens") or 0)
        tokens += num
        tail = repeated_tail(text)
        if tail:
            looping += 1
            repeated += num * tail / len(text)
    return {"responses": looping, "token_share": round(repeated / tokens, 4) if tokens else 0.0}


def read_results(path: str | Path) -> dict[str, dict]:
    """id -> result of every complete line (a torn last line or a bad line is ignored)."""
    out: dict[str, dict] = {}
    path = Path(path)
    if not path.is_file():
        return out
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # torn by a crash mid-write
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict) and "id" in rec:
                out[str(rec["id"])] = rec
    return out


class ResultsFile:
    """Append-only JSONL of results; safe to reopen after a crash."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():
            data = self.path.read_bytes()
            cut = data.rfind(b"\n") + 1
            if cut != len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(cut)
        self.f = open(self.path, "ab")

    def append(self, records: Iterable[dict]) -> None:
        data = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)
        self.f.write(data)
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


# ---------------------------------------------------------------- batched generation

class _BatchCache:
    """Keys and values of a batch being decoded, written in place into buffers sized once for the whole
    generation (transformers' DynamicCache concatenates every layer's cache on every step)."""

    is_compileable = False

    def __init__(self, config, batch: int, capacity: int, dtype, device):
        # the geometry of eyas.spec.target.cache_geometry, which this layer may not import
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (batch, kv_heads, capacity, head_dim)  # per layer
        self.kv = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                   for _ in range(config.num_hidden_layers)]
        self.length = 0

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """What a decoder layer calls: store the new entries after `length`, return all of them."""
        keys, values = self.kv[layer_idx]
        end = self.length + key_states.shape[2]
        keys[:, :, self.length:end] = key_states
        values[:, :, self.length:end] = value_states
        return keys[:, :, :end], values[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (a copy of the buffers)."""
        self.kv = [(k[rows], v[rows]) for k, v in self.kv]


GROUPED_DECODE = "eyas_grouped_decode_sdpa"


def grouped_decode_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """transformers' SDPA attention, except for one-token queries of a grouped-query model.

    With a mask on CUDA, transformers copies each kv head for its query heads before SDPA (repeat_kv):
    in a wide decoding batch that copy of the whole cache was half of the device time of a step
    (bench/regen_profile.py). A one-token query needs no copy: the g query heads of a kv head become
    g query rows of that head (query head h uses kv head h // g, as repeat_kv pairs them), and the
    [B, 1, 1, L] mask broadcasts over them.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, num_heads, q_len, head_dim = query.shape
    num_kv = key.shape[1]
    if q_len != 1 or num_heads == num_kv or dropout or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q = query.view(b, num_kv, num_heads // num_kv, head_dim)  # [B, KV, g, D]
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, num_heads, 1, head_dim).transpose(1, 2), None  # [B, 1, H, D]


class _GroupedDecode:
    """Within the block, a model that uses SDPA decodes through grouped_decode_sdpa; restored after."""

    def __init__(self, model):
        self.model, self.saved = model, None

    def __enter__(self):
        config = self.model.config
        if getattr(config, "_attn_implementation", None) == "sdpa":
            from transformers import AttentionInterface

            AttentionInterface.register(GROUPED_DECODE, grouped_decode_sdpa)
            self.saved = "sdpa"
            config._attn_implementation = GROUPED_DECODE
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self.model.config._attn_implementation = self.saved


def generate_batch(model, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: list[int], pad_id: int,
                   temperature: float = 0.0, generator: torch.Generator | None = None,
                   check_every: int = 16) -> list[dict]:
    """Generate for left-padded prompts; returns [{tokens, finish: "stop"|"length"}] in input order.

    The stop token is not part of `tokens`. The keys and values live in one preallocated cache (nothing is
    concatenated per step) and the new tokens stay on the device: the host looks at them every
    `check_every` steps (to end the batch when every row has stopped, and to drop the stopped rows once
    they are half of the batch) and reads them once at the end. A row that has stopped keeps decoding
    until then; what follows its stop token is discarded.
    """
    with _GroupedDecode(model):
        return _generate(model, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
                         temperature=temperature, generator=generator, check_every=check_every)


@torch.inference_mode()
def _generate(model, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: list[int], pad_id: int,
              temperature: float, generator: torch.Generator | None, check_every: int) -> list[dict]:
    """The loop of generate_batch (its docstring says what it does)."""
    param = next(model.parameters())
    device = param.device
    num_rows, width = len(prompts), max(len(p) for p in prompts)
    capacity = width + max_new_tokens
    input_ids = torch.full((num_rows, width), pad_id, dtype=torch.long)  # [B, W]
    valid = torch.zeros((num_rows, capacity), dtype=torch.bool)  # [B, W + N]: keys each row may attend to
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[r, width - len(p):width] = True
    input_ids, valid = input_ids.to(device), valid.to(device)
    positions = (valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)  # [B, W]; left padding shifts positions
    eager = getattr(model.config, "_attn_implementation", "sdpa") == "eager"

    def as_mask(allowed: torch.Tensor) -> torch.Tensor:  # bool [B, 1, q, k] -> what the attention takes
        if not eager:
            return allowed
        return torch.zeros(allowed.shape, dtype=param.dtype, device=device).masked_fill(~allowed, torch.finfo(param.dtype).min)

    # prefill: causal over real keys; a padding query attends to itself only (a row of no keys gives NaN)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    allowed = (causal[None] & valid[:, None, :width]) | torch.eye(width, dtype=torch.bool, device=device)[None]
    cache = _BatchCache(model.config, num_rows, capacity, param.dtype, device)
    logits = model(input_ids=input_ids, attention_mask=as_mask(allowed[:, None]), position_ids=positions,
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
    cache.advance(width)
    next_pos = positions[:, -1] + 1  # [b]
    rows = torch.arange(num_rows, device=device)  # original row of each live row
    new = torch.zeros((num_rows, max_new_tokens), dtype=torch.long, device=device)  # [B, N] by original row
    stopped_at = torch.full((num_rows,), max_new_tokens, dtype=torch.long, device=device)  # first stop step
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            # sampled where the generator lives: a CPU generator on a GPU model costs a [b, V] copy per step
            where = generator.device if generator is not None else device
            tok = torch.multinomial(probs.to(where), 1, generator=generator).squeeze(1).to(device)  # [b]
        else:
            tok = logits.argmax(-1)  # [b]
        new[rows, step] = tok
        first_stop = torch.isin(tok, stop) & (stopped_at[rows] == max_new_tokens)
        stopped_at[rows] = torch.where(first_stop, step, stopped_at[rows])
        if step == max_new_tokens - 1:
            break
        if (step + 1) % check_every == 0:  # the only host reads inside the loop
            live = stopped_at[rows] == max_new_tokens  # [b]
            num_live = int(live.sum())
            if num_live == 0:
                break
            if num_live <= len(rows) // 2:
                keep = live.nonzero().squeeze(1)  # [b']
                cache.select(keep)
                rows, tok, valid, next_pos = rows[keep], tok[keep], valid[keep], next_pos[keep]
        valid[:, width + step] = True
        logits = model(input_ids=tok[:, None], attention_mask=as_mask(valid[:, None, None, :width + step + 1]),
                       position_ids=next_pos[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
        cache.advance(1)
        next_pos = next_pos + 1
    tokens, stops = new.tolist(), stopped_at.tolist()
    return [{"tokens": row[:end], "finish": "stop" if end < max_new_tokens else "length"}
            for row, end in zip(tokens, stops)]


def regenerate_local(target, prompts: list[dict], out_path: str | Path, *, template, max_new_tokens: int,
                     temperature: float = 0.0, batch_size: int = 16, seed: int = 0, threads: int = 0,
                     on_batch: Callable[[int], None] | None = None) -> dict[str, dict]:
    """Generate a response for each {id, messages} prompt not yet in `out_path`; returns all results.

    `template` is a ChatTemplate (its prompt_ids() is the exact inference prompt).
    """
    done = read_results(out_path)
    todo = pending(prompts, done)
    if not todo:
        return done
    tok = target.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else template.stop_ids[0]
    encoded = [(p, template.prompt_ids(p["messages"])) for p in todo]
    encoded.sort(key=lambda e: len(e[1]))  # similar lengths share a batch: little padding
    generator = torch.Generator(device=next(target.model.parameters()).device).manual_seed(seed)
    saved_threads = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    sink = ResultsFile(out_path)
    num_tokens, t0 = 0, time.perf_counter()
    bar = progress(total=len(prompts), initial=len(prompts) - len(todo), desc="regenerate", unit="sample")
    try:
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start:start + batch_size]
            results = generate_batch(target.model, [ids for _, ids in chunk], max_new_tokens=max_new_tokens,
                                     stop_ids=template.stop_ids, pad_id=pad_id, temperature=temperature,
                                     generator=generator)
            records = []
            for (p, ids), res in zip(chunk, results):
                text = tok.decode(res["tokens"], skip_special_tokens=True)
                records.append({"id": p["id"], "prompt_sha": prompt_sha(p["messages"]), "response": text,
                                "num_prompt_tokens": len(ids),
                                "num_tokens": len(res["tokens"]), "finish": res["finish"]})
                num_tokens += len(res["tokens"])
            sink.append(records)
            done.update({r["id"]: r for r in records})
            elapsed = time.perf_counter() - t0
            bar.update(len(chunk))
            bar.set_postfix_str(f"{num_tokens / elapsed:.1f} tok/s")
            if on_batch is not None:
                on_batch(len(done))
    finally:
        bar.close()
        sink.close()
        torch.set_num_threads(saved_threads)
    return done
