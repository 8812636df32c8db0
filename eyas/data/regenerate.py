"""Regeneration: the target writes the assistant responses it will later be asked to speculate on.

Local mode generates in this process with continuous batching (generate_stream): a fixed number
of slots decode one token per step, and a slot whose row hit an end-of-turn token or the token limit
is given the next prompt (prompts sorted by length, so a prefill pass pads little). On CUDA a
decoding step is replayed as a CUDA graph. Greedy by default; temperature > 0 samples with a seeded
generator.

Results are appended, one JSON line per prompt, to a JSONL file and flushed as rows finish, so a
crash loses at most the rows in flight; a rerun reads the file, skips finished ids and continues. Each line
carries the hash of the messages it answers, so an id whose prompt changed is generated again (the
newest line of an id wins). A torn last line (the process died mid-write) is cut off before appending.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from eyas.common import EyasError, format_bytes, progress, warn


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

def _kv_geometry(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder config: the geometry of eyas.speculative.target.cache_geometry,
    which this layer may not import."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def _vocab(model) -> int:
    """Rows of the model's output head (its logits' width)."""
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.vocab_size


class _SlotCache:
    """Keys and values of `rows` sequences decoded side by side: [rows, kv_heads, capacity, head_dim] per
    layer, one row per slot of the decoder, each row its own sequence from column 0.

    What a decoder layer's `update` does depends on the pass (set by the decoder before it):
    - prefill (`fill_rows` set): the new entries of those rows are written at columns 0..T-1 and the
      attention needs only them;
    - decoding (`fill_rows` None): each row writes its one new entry at its own column `write_at[row]`,
      and the attention reads the first `width` columns of every row (the mask hides the rest).
    Fixed shapes and device-side indices throughout, so a decoding step can be replayed as a CUDA graph.
    """

    is_compileable = False

    def __init__(self, config, rows: int, capacity: int, dtype, device):
        layers, kv_heads, head_dim = _kv_geometry(config)
        shape = (rows, kv_heads, capacity, head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(layers)]
        self.rows = torch.arange(rows, device=device)
        self.fill_rows: torch.Tensor | None = None  # prefill: the rows being filled
        self.write_at: torch.Tensor | None = None  # decoding: [rows] column each row writes
        self.width = 0  # decoding: columns the attention reads

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        keys, values = self.kv[layer_idx]
        if self.fill_rows is not None:
            t = key_states.shape[2]
            keys[self.fill_rows, :, :t] = key_states
            values[self.fill_rows, :, :t] = value_states
            return key_states, value_states
        keys[self.rows, :, self.write_at] = key_states[:, :, 0]
        values[self.rows, :, self.write_at] = value_states[:, :, 0]
        return keys[:, :, :self.width], values[:, :, :self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.fill_rows is not None else self.width - 1


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


GRAPH_WIDTH_STEP = 128  # with CUDA graphs, decoding attends over a multiple of this many columns (one graph each)
PREFILL_TOKENS = 1 << 16  # padded prompt tokens per prefill pass when slots are refilled
# of the device memory free when decoding starts, the share the slots may hold (their caches, last logits and
# outputs); the rest is for the passes' activations (a prefill of PREFILL_TOKENS tokens) and the CUDA graphs
SLOT_MEMORY_SHARE = 0.6


def slot_bytes(config, capacity: int, dtype: torch.dtype, vocab: int, max_new_tokens: int) -> int:
    """Device bytes one decoding slot of `capacity` columns holds: its keys and values in every layer (as
    _SlotCache allocates them), its last logits (fp32) and its outputs."""
    layers, kv_heads, head_dim = _kv_geometry(config)
    kv = 2 * layers * kv_heads * capacity * head_dim * torch.empty((), dtype=dtype).element_size()
    return kv + 4 * vocab + 8 * max_new_tokens


def slots_that_fit(wanted: int, per_slot: int, free_bytes: int, capacity: int) -> int:
    """How many of `wanted` slots fit in SLOT_MEMORY_SHARE of `free_bytes`; a clear error if not even one."""
    fit = min(wanted, int(free_bytes * SLOT_MEMORY_SHARE) // per_slot)
    if fit < 1:
        raise EyasError(f"regeneration: one decoding slot of {capacity} tokens (the longest prompt + "
                        f"data.regen_max_new_tokens) needs {format_bytes(per_slot)} and {format_bytes(free_bytes)} "
                        f"of device memory is free; lower data.max_length or data.regen_max_new_tokens, or free "
                        f"the device (`eyas gpus` lists who holds it)")
    return fit


def generate_stream(model, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: list[int], pad_id: int,
                    slots: int, temperature: float = 0.0, generator: torch.Generator | None = None,
                    check_every: int = 16, cuda_graphs: bool = True,
                    free_bytes: int | None = None) -> Iterator[list[tuple[int, dict]]]:
    """Continuous batching: generate for every prompt, `slots` rows at a time; yields lists of
    (prompt index, {tokens, finish: "stop"|"length"}) as rows finish (not in input order).

    Each slot holds one prompt's sequence; a slot whose row stopped (end-of-turn token, not part of
    `tokens`) or reached `max_new_tokens` is given the next prompt, so the batch stays full until the
    prompts run out. The host looks at the device every `check_every` steps (which rows finished) and
    then prefills the next prompts into the free slots; the tokens stay on the device until a row is
    read. On CUDA (`cuda_graphs`), a decoding step is replayed as a CUDA graph: eagerly a small target
    is bound by the host's kernel launches, not by the GPU.

    The slots are allocated up front; on CUDA (or wherever `free_bytes` is given) they are fewer than asked
    when that many would not fit in SLOT_MEMORY_SHARE of the free memory (a warning says so), and an error
    names the fix when not even one fits: a batch size counted in rows must not end in an out-of-memory crash.
    """
    if not prompts:
        return
    slots, capacity = min(slots, len(prompts)), max(len(p) for p in prompts) + max_new_tokens
    param = next(model.parameters())
    if free_bytes is None and param.device.type == "cuda":
        # what the device has free plus what torch's allocator holds unused (an earlier segment's slots)
        free_bytes = torch.cuda.mem_get_info(param.device)[0] + torch.cuda.memory_reserved(param.device) \
            - torch.cuda.memory_allocated(param.device)
    if free_bytes is not None:
        per_slot = slot_bytes(model.config, capacity, param.dtype, _vocab(model), max_new_tokens)
        fit = slots_that_fit(slots, per_slot, free_bytes, capacity)
        if fit < slots:
            warn(f"regeneration: {fit} of the {slots} slots asked for (data.regen_batch_size) fit in "
                 f"{SLOT_MEMORY_SHARE:.0%} of the {format_bytes(free_bytes)} free ({format_bytes(per_slot)} each at "
                 f"{capacity} tokens); decoding {fit} rows at a time")
            slots = fit
    decoder = _SlotDecoder(model, slots=slots, capacity=capacity,
                           max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id, temperature=temperature,
                           generator=generator, cuda_graphs=cuda_graphs)
    yield from decoder.run(prompts, check_every)


def generate_batch(model, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: list[int], pad_id: int,
                   temperature: float = 0.0, generator: torch.Generator | None = None, check_every: int = 16,
                   cuda_graphs: bool = True, free_bytes: int | None = None) -> list[dict]:
    """All prompts in one batch (one slot each, unless that many do not fit in memory: see generate_stream;
    eagerly, finished rows are dropped from the batch once they are half of it); returns [{tokens, finish}]
    in input order."""
    out: list[dict | None] = [None] * len(prompts)
    for finished in generate_stream(model, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
                                    slots=len(prompts), temperature=temperature, generator=generator,
                                    check_every=check_every, cuda_graphs=cuda_graphs, free_bytes=free_bytes):
        for i, res in finished:
            out[i] = res
    return out


class _SlotDecoder:
    """The device state of generate_stream: per slot the token it feeds next, the column it writes, the
    column its prompt starts at (prompts are left-padded within a prefill), its tokens so far and
    whether it is done. Decoding steps change only device tensors, so the host never waits on them."""

    def __init__(self, model, *, slots: int, capacity: int, max_new_tokens: int, stop_ids: list[int], pad_id: int,
                 temperature: float, generator: torch.Generator | None, cuda_graphs: bool):
        param = next(model.parameters())
        dev = self.device = param.device
        self.model, self.slots, self.capacity, self.max_new = model, slots, capacity, max_new_tokens
        self.pad_id, self.temperature, self.generator = pad_id, temperature, generator
        self.graphs = cuda_graphs and dev.type == "cuda"
        self.eager_masks = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
        self.dtype = param.dtype
        self.cache = _SlotCache(model.config, slots, capacity, param.dtype, dev)
        self.cols = torch.arange(capacity, device=dev)
        self.stop = torch.tensor(stop_ids, dtype=torch.long, device=dev)
        long = dict(dtype=torch.long, device=dev)
        self.tok = torch.zeros(slots, **long)  # the token each row feeds next
        self.col = torch.zeros(slots, **long)  # the column it is written at
        self.start = torch.zeros(slots, **long)  # the column its prompt starts at
        self.out = torch.zeros(slots, max_new_tokens, **long)  # outputs of the row's current prompt
        self.produced = torch.zeros(slots, **long)  # outputs so far, the stop token included
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.done = torch.ones(slots, dtype=torch.bool, device=dev)  # finished, or never filled
        self.logits = torch.zeros(slots, _vocab(model), dtype=torch.float32, device=dev)  # the last step's, per row
        self.steps: dict[int, object] = {}  # width -> captured graph
        self.pool = None

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:  # bool [B, 1, q, k] -> what the attention takes
        if not self.eager_masks:
            return allowed
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill(
            ~allowed, torch.finfo(self.dtype).min)

    # -- passes
    def _forward(self, width: int) -> None:
        """One decoding step of every row over the first `width` columns, logits into self.logits."""
        self.cache.fill_rows, self.cache.write_at, self.cache.width = None, self.col, width
        cols = self.cols[:width]
        allowed = (cols[None, :] >= self.start[:, None]) & (cols[None, :] <= self.col[:, None])  # [B, W]
        logits = self.model(input_ids=self.tok[:, None], position_ids=(self.col - self.start)[:, None],
                            attention_mask=self._mask(allowed[:, None, None]), past_key_values=self.cache,
                            use_cache=True).logits[:, -1]
        self.logits.copy_(logits)

    def _take(self, rows: torch.Tensor) -> None:
        """Record the next output of `rows` (bool [B]) from self.logits; a row ends at a stop token or at
        max_new_tokens outputs; the others feed it next."""
        if self.temperature > 0:
            probs = torch.softmax(self.logits.float() / self.temperature, dim=-1)
            # sampled where the generator lives: a CPU generator on a GPU model costs a [B, V] copy per step
            where = self.generator.device if self.generator is not None else self.device
            nxt = torch.multinomial(probs.to(where), 1, generator=self.generator).squeeze(1).to(self.device)
        else:
            nxt = self.logits.argmax(-1)  # [B]
        is_stop = torch.isin(nxt, self.stop) & rows
        at = self.produced.clamp(max=self.max_new - 1)
        self.out[self.cache.rows, at] = torch.where(rows & ~is_stop, nxt, self.out[self.cache.rows, at])
        self.produced += rows
        self.stopped |= is_stop
        self.done |= rows & (is_stop | (self.produced >= self.max_new))
        self.tok.copy_(torch.where(rows, nxt, self.tok))

    def _step(self, width: int) -> None:
        if not self.graphs:
            self._forward(width)
        else:
            if width not in self.steps:
                from eyas.common import capture_cuda_graph

                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                self.steps[width] = capture_cuda_graph(
                    lambda: self._forward(width), self.device, f"a regeneration step ({width} columns)",
                    "Regenerate eagerly instead with --set data.regen_cuda_graphs=false", pool=self.pool)
            self.steps[width].replay()
        live = ~self.done
        self._take(live)
        self.col += live & ~self.done  # rows still running write their next entry one column on

    def _prefill(self, slot_ids: list[int], prompts: list[list[int]]) -> None:
        """Left-pad `prompts` to one width, write them into the caches of `slot_ids`, take their first outputs."""
        width, dev = max(len(p) for p in prompts), self.device
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        starts = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        rows, ids, starts = torch.tensor(slot_ids, device=dev), ids.to(dev), starts.to(dev)
        cols = self.cols[:width]
        # causal over the prompt's own columns; a padding query attends to itself only (no keys gives NaN)
        allowed = ((cols[None, None, :] <= cols[None, :, None]) & (cols[None, None, :] >= starts[:, None, None])) \
            | torch.eye(width, dtype=torch.bool, device=dev)[None]  # [r, W, W]
        self.cache.fill_rows = rows
        logits = self.model(input_ids=ids, position_ids=(cols[None, :] - starts[:, None]).clamp(min=0),
                            attention_mask=self._mask(allowed[:, None]), past_key_values=self.cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1]
        self.cache.fill_rows = None
        self.logits[rows] = logits.float()
        self.start[rows], self.col[rows] = starts, width
        self.produced[rows], self.stopped[rows], self.done[rows] = 0, False, False
        fresh = torch.zeros(self.slots, dtype=torch.bool, device=dev)
        fresh[rows] = True
        self._take(fresh)

    # -- the host's loop
    def run(self, prompts: list[list[int]], check_every: int) -> Iterator[list[tuple[int, dict]]]:
        queue = iter(range(len(prompts)))
        unassigned = len(prompts)
        held: list[int | None] = [None] * self.slots  # prompt index per slot
        last_col = [0] * self.slots  # per slot: a bound on the last column it writes (kept on the host, no reads)
        left = [0] * self.slots  # per slot: decoding steps it may still need
        free = list(range(self.slots))
        while True:
            with _GroupedDecode(self.model), torch.no_grad():
                # eagerly a free slot costs a row of work per step, so fill it at once; with graphs every step
                # costs the whole batch anyway and a prefill pass is the expensive part, so wait for a few
                # (a sixteenth of the slots, or as many as prompts are left)
                wanted = 1 if not self.graphs else min(unassigned, max(1, self.slots // 16))
                if free and unassigned and len(free) >= wanted:
                    picked = [(s, next(queue)) for s in free[:unassigned]]
                    free, unassigned = free[len(picked):], unassigned - len(picked)
                    self._refill(sorted(picked, key=lambda e: len(prompts[e[1]])), prompts, held, last_col)
                    for s, _ in picked:
                        left[s] = self.max_new - 1  # the prefill gave the first output
                if all(h is None for h in held):
                    return
                if not self.graphs and not unassigned and free and len(free) >= self.slots // 2:
                    # eagerly a finished row still costs work every step: with no prompt left for it, drop it
                    keep = [s for s, h in enumerate(held) if h is not None]
                    self._compact(keep)
                    held, last_col, left = [held[s] for s in keep], [last_col[s] for s in keep], [left[s] for s in keep]
                    free = []
                for _ in range(check_every):
                    if all(n <= 0 for n, h in zip(left, held) if h is not None):
                        break  # every row has reached max_new_tokens
                    need = max(c for c, h in zip(last_col, held) if h is not None) + 1
                    if self.graphs:
                        need = -(-need // GRAPH_WIDTH_STEP) * GRAPH_WIDTH_STEP
                    self._step(min(need, self.capacity))
                    for s, h in enumerate(held):
                        if h is not None:
                            last_col[s] += 1
                            left[s] -= 1
                finished = [s for s, d in enumerate(self.done.tolist()) if d and held[s] is not None]
                if finished:
                    idx = torch.tensor(finished, device=self.device)
                    counts = (self.produced[idx] - self.stopped[idx].long()).tolist()
                    stops, rows = self.stopped[idx].tolist(), self.out[idx].tolist()
            if finished:
                yield [(held[s], {"tokens": row[:n], "finish": "stop" if st else "length"})
                       for s, row, n, st in zip(finished, rows, counts, stops)]
                for s in finished:
                    held[s] = None
                free += finished

    def _compact(self, keep: list[int]) -> None:
        """Keep only the slots `keep` (eager decoding only: a CUDA graph fixes the number of rows)."""
        idx = torch.tensor(keep, device=self.device)
        self.cache.kv = [(k[idx], v[idx]) for k, v in self.cache.kv]
        self.cache.rows = torch.arange(len(keep), device=self.device)
        for name in ("tok", "col", "start", "out", "produced", "stopped", "done", "logits"):
            setattr(self, name, getattr(self, name)[idx])
        self.slots = len(keep)

    def _refill(self, picked: list[tuple[int, int]], prompts: list[list[int]], held: list, last_col: list) -> None:
        """Prefill the (slot, prompt index) pairs, in passes of at most PREFILL_TOKENS padded tokens."""
        chunk: list[tuple[int, int]] = []
        width = 0
        for s, i in picked + [(-1, -1)]:
            if chunk and (s < 0 or max(width, len(prompts[i])) * (len(chunk) + 1) > PREFILL_TOKENS):
                self._prefill([s2 for s2, _ in chunk], [prompts[j] for _, j in chunk])
                for s2, j in chunk:
                    held[s2], last_col[s2] = j, width  # its first decoding step writes column `width`
                chunk, width = [], 0
            if s >= 0:
                chunk.append((s, i))
                width = max(width, len(prompts[i]))


def length_segments(lengths: list[int], max_new_tokens: int, slots: int) -> list[slice]:
    """Split prompts sorted by length into runs decoded one after the other: every slot's cache holds
    the longest prompt of its run plus max_new_tokens, so one long prompt must not size the caches of
    all the short ones. A run ends where a prompt would more than double the cache of the run's first
    prompt, once the run fills the slots at least once."""
    segments, first = [], 0
    for i, n in enumerate(lengths):
        if i - first >= slots and n + max_new_tokens > 2 * (lengths[first] + max_new_tokens):
            segments.append(slice(first, i))
            first = i
    if lengths:
        segments.append(slice(first, len(lengths)))
    return segments


def _record(prompt: dict, ids: list[int], res: dict, tokenizer) -> dict:
    """The results file's line for one finished prompt ({tokens, finish} from the decoder or the engine)."""
    return {"id": prompt["id"], "prompt_sha": prompt_sha(prompt["messages"]),
            "response": tokenizer.decode(res["tokens"], skip_special_tokens=True),
            "num_prompt_tokens": len(ids), "num_tokens": len(res["tokens"]), "finish": res["finish"]}


def _commit(records: list[dict], sink: ResultsFile, done: dict, bar, tokens_before: int, t0: float,
            on_batch: Callable[[int], None] | None) -> int:
    """Append finished results (flushed to disk), count them in `done` and the progress bar; -> their new tokens."""
    new = sum(r["num_tokens"] for r in records)
    sink.append(records)
    done.update({r["id"]: r for r in records})
    bar.update(len(records))
    bar.set_postfix_str(f"{(tokens_before + new) / (time.perf_counter() - t0):.1f} tok/s")
    if on_batch is not None:
        on_batch(len(done))
    return new


def regenerate_local(target, prompts: list[dict], out_path: str | Path, *, template, max_new_tokens: int,
                     temperature: float = 0.0, batch_size: int = 16, seed: int = 0, threads: int = 0,
                     cuda_graphs: bool = True, on_batch: Callable[[int], None] | None = None) -> dict[str, dict]:
    """Generate a response for each {id, messages} prompt not yet in `out_path`; returns all results.

    `template` is a ChatTemplate (its prompt_ids() is the exact inference prompt). `batch_size` rows
    decode at once (generate_stream's slots); results are appended as rows finish.
    """
    done = read_results(out_path)
    todo = pending(prompts, done)
    if not todo:
        return done
    tok = target.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else template.stop_ids[0]
    encoded = [(p, template.prompt_ids(p["messages"])) for p in todo]
    encoded.sort(key=lambda e: len(e[1]))  # similar lengths share a prefill pass: little padding
    generator = torch.Generator(device=next(target.model.parameters()).device).manual_seed(seed)
    saved_threads = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    sink = ResultsFile(out_path)
    num_tokens, t0 = 0, time.perf_counter()
    bar = progress(total=len(prompts), initial=len(prompts) - len(todo), desc="regenerate", unit="sample")
    try:
        for segment in length_segments([len(ids) for _, ids in encoded], max_new_tokens, batch_size):
            part = encoded[segment]
            for finished in generate_stream(target.model, [ids for _, ids in part], max_new_tokens=max_new_tokens,
                                            stop_ids=template.stop_ids, pad_id=pad_id, slots=batch_size,
                                            temperature=temperature, generator=generator, cuda_graphs=cuda_graphs):
                records = [_record(*part[i], res, tok) for i, res in finished]
                num_tokens += _commit(records, sink, done, bar, num_tokens, t0, on_batch)
    finally:
        bar.close()
        sink.close()
        torch.set_num_threads(saved_threads)
    return done


def regenerate_engine(engine, tokenizer, prompts: list[dict], out_path: str | Path, *, template, max_new_tokens: int,
                      temperature: float = 0.0, seed: int = 0, chunk: int = 256,
                      on_batch: Callable[[int], None] | None = None) -> dict[str, dict]:
    """`regenerate_local`'s work through a serving engine (a vLLM ExtractionEngine in this process or the run's
    engine, eyas.target.vllm.service.RemoteEngine): the same prompt ids (the chat template's inference prompt),
    stop tokens, sampling settings and results file. `chunk` prompts go to the engine at a time (it batches
    them by tokens itself), and their results are appended before the next chunk: a crash loses one chunk at
    most. Each prompt's sampling seed derives from `seed` and its id, so a resumed run samples as one that was
    never interrupted. A prompt the engine cannot take (longer than its max_model_len) gets no line and is
    reported by the caller as failed."""
    done = read_results(out_path)
    todo = pending(prompts, done)
    if not todo:
        return done
    encoded = [(p, template.prompt_ids(p["messages"])) for p in todo]
    encoded.sort(key=lambda e: len(e[1]))
    limit = getattr(engine, "max_model_len", None)
    if limit:
        too_long = [p["id"] for p, ids in encoded if len(ids) >= limit]
        if too_long:
            warn(f"regeneration: {len(too_long)} prompt(s) are as long as the engine's max_model_len {limit} or longer "
                 f"and get no response (e.g. {', '.join(map(str, too_long[:3]))}); raise target.engine.max_model_len")
            encoded = [(p, ids) for p, ids in encoded if len(ids) < limit]
    sink = ResultsFile(out_path)
    num_tokens, t0 = 0, time.perf_counter()
    bar = progress(total=len(prompts), initial=len(prompts) - len(todo), desc="regenerate", unit="sample")
    try:
        for start in range(0, len(encoded), chunk):
            part = encoded[start:start + chunk]
            outputs = engine.generate([ids for _, ids in part], max_tokens=max_new_tokens, temperature=temperature,
                                      seeds=[_request_seed(seed, p["id"]) for p, _ in part],
                                      stop_ids=list(template.stop_ids))
            records = [_record(p, ids, res, tokenizer) for (p, ids), res in zip(part, outputs)]
            num_tokens += _commit(records, sink, done, bar, num_tokens, t0, on_batch)
    finally:
        bar.close()
        sink.close()
    return done


def _request_seed(seed: int, sample_id) -> int:
    """A prompt's own sampling seed: the run's seed and the prompt's id, whatever batch it lands in."""
    from eyas.common import sha256_json

    return int(sha256_json([seed, str(sample_id)])[:8], 16)
