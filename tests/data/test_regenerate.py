"""Regeneration: batched greedy parity, crash/resume (SIGKILL), and an OpenAI-compatible endpoint."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from torch.testing import assert_close

from eyas.common import EyasError
from eyas.data.endpoint import regenerate_endpoint
from eyas.data.regenerate import (SLOT_MEMORY_SHARE, generate_batch, generate_stream, grouped_decode_sdpa,
                                  length_segments, read_results, regenerate_local, slot_bytes)
from eyas.data.template import ChatTemplate, stop_token_ids

PROMPTS = [{"id": f"p{i:02d}", "messages": [{"role": "user", "content": "word " * (i % 7) + f"number {i}"}]}
           for i in range(40)]


def test_batched_left_padded_greedy_equals_plain_generate(tiny_target):
    model, tok = tiny_target.model, tiny_target.tokenizer
    ct = ChatTemplate(tok)
    prompts = [ct.prompt_ids(p["messages"]) for p in PROMPTS[:5]]
    assert len({len(p) for p in prompts}) > 1  # the batch really is padded
    batched = generate_batch(model, prompts, max_new_tokens=12, stop_ids=ct.stop_ids, pad_id=tok.pad_token_id)
    for p, res in zip(prompts, batched):
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=ct.stop_ids,
                             pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        ref = ref[: ref.index(ct.stop_ids[0])] if ct.stop_ids[0] in ref else ref
        assert res["tokens"] == ref


def test_grouped_decode_attention_equals_transformers_sdpa():
    """One-token queries of a GQA model attend without copying kv heads, and give what repeat_kv + SDPA gives."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    g = torch.Generator().manual_seed(0)
    b, kv, d, length = 4, 2, 8, 11
    key, value = torch.randn(b, kv, length, d, generator=g), torch.randn(b, kv, length, d, generator=g)
    mask = torch.rand(b, 1, 1, length, generator=g) > 0.3
    mask[..., -1] = True  # every row sees at least its own key
    for q_len in (1, 5):  # decode (grouped) and prefill (transformers' own path)
        query = torch.randn(b, kv * 3, q_len, d, generator=g)
        m = mask.expand(b, 1, q_len, length)
        ours, _ = grouped_decode_sdpa(module, query, key, value, m, scaling=0.3)
        ref, _ = sdpa_attention_forward(module, query, key, value, m, scaling=0.3)
        assert ours.shape == ref.shape == (b, q_len, kv * 3, d)
        assert_close(ours, ref)


def test_generation_decodes_through_the_grouped_attention_and_restores_sdpa(tiny_target, monkeypatch):
    import eyas.data.regenerate as regen

    calls = []

    def counted(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return grouped_decode_sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(regen, "grouped_decode_sdpa", counted)
    model, tok = tiny_target.model, tiny_target.tokenizer
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads < model.config.num_attention_heads
    ct = ChatTemplate(tok)
    prompts = [ct.prompt_ids(p["messages"]) for p in PROMPTS[:3]]
    generate_batch(model, prompts, max_new_tokens=5, stop_ids=[999999], pad_id=tok.pad_token_id)
    layers = model.config.num_hidden_layers
    assert calls.count(1) == 4 * layers and len(calls) == 5 * layers  # 4 decode steps after the prefill
    assert model.config._attn_implementation == "sdpa"


def test_stop_token_ends_a_row_early(tiny_target):
    """With the stop set to whatever the model says first, every row stops at step one."""
    model, tok = tiny_target.model, tiny_target.tokenizer
    ct = ChatTemplate(tok)
    prompts = [ct.prompt_ids(p["messages"]) for p in PROMPTS[:3]]
    first = generate_batch(model, prompts, max_new_tokens=1, stop_ids=[999999], pad_id=tok.pad_token_id)
    stops = sorted({r["tokens"][0] for r in first})
    out = generate_batch(model, prompts, max_new_tokens=8, stop_ids=stops, pad_id=tok.pad_token_id)
    assert all(r == {"tokens": [], "finish": "stop"} for r in out)


def test_rows_stopping_at_different_steps_match_plain_generate_through_compaction(tiny_target):
    """Four rows stop by their fourth token and two never do: the batch drops the stopped rows at a check
    (check_every=2) and decodes on with two; every row must be plain greedy decoding cut at its first stop."""
    model, tok = tiny_target.model, tiny_target.tokenizer
    ct = ChatTemplate(tok)
    pool = [ct.prompt_ids(p["messages"]) for p in PROMPTS]
    free = [r["tokens"] for r in generate_batch(model, pool, max_new_tokens=16, stop_ids=[999999], pad_id=tok.pad_token_id)]
    # a stop token that four prompts say early (not first) and two, with different answers, never say
    picks = None
    for x in sorted({t for f in free for t in f}):
        early = [i for i, f in enumerate(free) if x in f[1:4] and x != f[0]]
        never = list({tuple(f): i for i, f in enumerate(free) if x not in f}.values())  # distinct outputs
        if len(early) >= 4 and len(never) >= 2:
            picks = (x, early[:4] + never[:2])
            break
    assert picks is not None, "the tiny model's outputs offer no usable stop token"
    stop, chosen = picks
    prompts = [pool[i] for i in chosen]
    widths = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: widths.append(args[0].shape[0]))
    try:
        out = generate_batch(model, prompts, max_new_tokens=16, stop_ids=[stop], pad_id=tok.pad_token_id, check_every=2)
    finally:
        hook.remove()
    assert widths[0] == 6 and min(widths) == 2  # the four stopped rows were dropped, the two went on
    for p, res in zip(prompts, out):
        ref = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=[stop],
                             pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        cut = ref.index(stop) if stop in ref else None
        assert res == {"tokens": ref if cut is None else ref[:cut], "finish": "length" if cut is None else "stop"}
    assert [r["finish"] for r in out] == ["stop"] * 4 + ["length"] * 2


def _stop_token_ending_some_rows_early(model, pool, pad_id):
    """A token that some prompts' greedy answers say early (not first) and others never say."""
    free = [r["tokens"] for r in generate_batch(model, pool, max_new_tokens=16, stop_ids=[999999], pad_id=pad_id)]
    for x in sorted({t for f in free for t in f}):
        early = [i for i, f in enumerate(free) if x in f[1:6] and x != f[0]]
        never = [i for i, f in enumerate(free) if x not in f]
        if len(early) >= 4 and len(never) >= 3:
            return x
    raise AssertionError("the tiny model's outputs offer no usable stop token")


def test_continuous_batching_refills_finished_slots_and_matches_plain_generate(tiny_target):
    """More prompts than slots, of different lengths, rows ending at different steps: a finished slot is
    given the next prompt (prefilled beside rows still decoding), and every answer is still plain greedy
    decoding of its own prompt, cut at its first stop token."""
    model, tok = tiny_target.model, tiny_target.tokenizer
    ct = ChatTemplate(tok)
    pool = [ct.prompt_ids(p["messages"]) for p in PROMPTS[:14]]
    assert len({len(p) for p in pool}) > 3
    stop = _stop_token_ending_some_rows_early(model, pool, tok.pad_token_id)
    calls = []  # (rows, tokens per row) of every forward
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: calls.append(tuple(args[0].shape)))
    got = {}
    try:
        for finished in generate_stream(model, pool, max_new_tokens=16, stop_ids=[stop], pad_id=tok.pad_token_id,
                                        slots=3, check_every=2):
            for i, res in finished:
                assert i not in got
                got[i] = res
    finally:
        hook.remove()
    assert sorted(got) == list(range(len(pool)))
    assert max(rows for rows, _ in calls) <= 3
    prefills = [c for c in calls if c[1] > 1]
    decoding = [c for c in calls if c[1] == 1]
    assert len(prefills) >= 5 and any(rows < 3 for rows, _ in prefills)  # slots were refilled a few at a time
    assert sum(rows for rows, _ in prefills) == len(pool)  # each prompt prefilled once
    steps = [len(r["tokens"]) + (r["finish"] == "stop") - 1 for _, r in sorted(got.items())]  # after the prefill
    in_batches = sum(max(steps[b:b + 3]) for b in range(0, len(pool), 3))  # batches of 3, each to its longest row
    assert len(decoding) < in_batches
    for i, p in enumerate(pool):
        ref = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=[stop],
                             pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        cut = ref.index(stop) if stop in ref else None
        assert got[i] == {"tokens": ref if cut is None else ref[:cut], "finish": "length" if cut is None else "stop"}, i
    assert {r["finish"] for r in got.values()} == {"stop", "length"}
    assert list(generate_stream(model, [], max_new_tokens=4, stop_ids=[stop], pad_id=0, slots=3)) == []


def test_slots_are_cut_to_what_free_memory_holds_and_none_fitting_is_a_clear_error(tiny_target, capsys):
    """A batch size counted in rows must not end in an out-of-memory crash: with `free_bytes` (on CUDA, the
    device's free memory) the slots are fewer than asked when that many would not fit, with a warning, and
    the answers are the same; when not even one fits, the error names the settings to lower."""
    model, tok = tiny_target.model, tiny_target.tokenizer
    ct = ChatTemplate(tok)
    pool = [ct.prompt_ids(p["messages"]) for p in PROMPTS[:8]]
    cfg, new = model.config, 6
    capacity = max(len(p) for p in pool) + new
    per_slot = slot_bytes(cfg, capacity, torch.float32, model.get_output_embeddings().weight.shape[0], new)
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    assert per_slot == 2 * cfg.num_hidden_layers * kv_heads * capacity * head_dim * 4 + 4 * cfg.vocab_size + 8 * new

    def run(**kw):
        rows = []
        hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
        try:
            got = generate_batch(model, pool, max_new_tokens=new, stop_ids=[999999], pad_id=tok.pad_token_id, **kw)
        finally:
            hook.remove()
        return got, max(rows)

    whole, rows = run()
    assert rows == len(pool)
    capsys.readouterr()
    cut, rows = run(free_bytes=int(3.5 * per_slot / SLOT_MEMORY_SHARE))
    assert rows == 3 and cut == whole
    assert "3 of the 8 slots asked for (data.regen_batch_size) fit" in capsys.readouterr().err
    with pytest.raises(EyasError, match="one decoding slot of .* needs .*lower data.max_length or "
                                        "data.regen_max_new_tokens"):
        run(free_bytes=per_slot)


def test_long_prompts_get_their_own_run_so_short_ones_keep_small_caches():
    lengths = [10] * 5 + [40] * 3 + [2000] * 2
    # a run ends only once it has filled the slots (4) and the next prompt would more than double its caches
    assert length_segments(lengths, 100, 4) == [slice(0, 8), slice(8, 10)]
    assert length_segments(lengths, 100, 16) == [slice(0, 10)]  # too few prompts to split
    assert length_segments([5, 6, 7], 512, 1) == [slice(0, 3)]
    assert length_segments([], 16, 4) == []


CHILD = """
import sys, time
from eyas.target import load_target
from eyas.data.regenerate import regenerate_local
from eyas.data.template import ChatTemplate
sys.path.insert(0, {here!r})
from test_regenerate import PROMPTS
t = load_target("tiny", device="cpu", dtype="fp32")
regenerate_local(t, PROMPTS, {path!r}, template=ChatTemplate(t.tokenizer), max_new_tokens=16, batch_size=2,
                 on_batch=lambda n: time.sleep(0.3))
"""


def test_resume_after_sigkill_gives_each_id_once(tmp_path, tiny_target):
    path = tmp_path / "regen.jsonl"
    code = CHILD.format(here=os.path.dirname(__file__), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and (not path.exists() or path.read_text().count("\n") < 4):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    done_before = len(read_results(path))
    assert 4 <= done_before < len(PROMPTS), "the child was killed mid-way"
    with open(path, "ab") as f:
        f.write(b'{"id": "p00", "respo')  # a line torn by the crash
    threads = torch.get_num_threads()
    results = regenerate_local(tiny_target, PROMPTS, path, template=ChatTemplate(tiny_target.tokenizer),
                               max_new_tokens=16, batch_size=8, threads=1)
    assert torch.get_num_threads() == threads  # data.regen_threads applies to regeneration only
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert sorted(ids) == sorted(p["id"] for p in PROMPTS)  # each id exactly once
    assert set(results) == {p["id"] for p in PROMPTS}


class _Server:
    """An OpenAI-compatible server on 127.0.0.1 that answers with the real target (greedy)."""

    def __init__(self, target, fail_first: int = 1):
        self.target, self.template = target, ChatTemplate(target.tokenizer, stop_token_ids(
            target.tokenizer, target.model.generation_config))
        self.lock, self.posts, self.fail_left = threading.Lock(), 0, fail_first
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "smollm2", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.posts += 1
                    if server.fail_left > 0:  # a transient overload the client must retry through
                        server.fail_left -= 1
                        self._send(503, {"error": "busy"})
                        return
                    text, n, finish = server.complete(body["messages"], body["max_tokens"])
                self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": finish}],
                                 "usage": {"prompt_tokens": 0, "completion_tokens": n}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def complete(self, messages, max_tokens):
        ids = self.template.prompt_ids(messages)
        res = generate_batch(self.target.model, [ids], max_new_tokens=max_tokens, stop_ids=self.template.stop_ids,
                             pad_id=self.target.tokenizer.pad_token_id)[0]
        return self.target.tokenizer.decode(res["tokens"], skip_special_tokens=True), len(res["tokens"]), res["finish"]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_endpoint_regeneration_against_a_local_smollm2_server(tmp_path, smollm2):
    server = _Server(smollm2, fail_first=1)
    prompts = [{"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
               {"id": "b", "messages": [{"role": "user", "content": "Name three primary colours."}]},
               {"id": "c", "messages": [{"role": "system", "content": "Answer in one word."},
                                        {"role": "user", "content": "Is water wet?"}]}]
    try:
        path = tmp_path / "regen.jsonl"
        results = regenerate_endpoint(server.url + "/v1", prompts, path, max_new_tokens=8, concurrency=2,
                                      retries=2, backoff_s=0.05)
        assert server.posts == len(prompts) + 1  # one 503, retried
        for p in prompts:
            expected, n, _ = server.complete(p["messages"], 8)
            assert results[p["id"]]["response"] == expected and results[p["id"]]["num_tokens"] == n
        assert "Paris" in results["a"]["response"]
        # a rerun asks nothing: every id is already in the file
        before = server.posts
        regenerate_endpoint(server.url, prompts, path, max_new_tokens=8)
        assert server.posts == before and len(path.read_text().splitlines()) == len(prompts)
    finally:
        server.close()


def test_endpoint_unreachable_is_a_one_line_user_error(tmp_path):
    with pytest.raises(EyasError, match="cannot reach"):
        regenerate_endpoint("http://127.0.0.1:9", PROMPTS[:1], tmp_path / "r.jsonl", max_new_tokens=4)


def test_a_changed_prompt_under_the_same_id_is_generated_again(tmp_path, tiny_target):
    path = tmp_path / "regen.jsonl"
    ct = ChatTemplate(tiny_target.tokenizer)
    prompts = [dict(p) for p in PROMPTS[:4]]
    first = regenerate_local(tiny_target, prompts, path, template=ct, max_new_tokens=6, batch_size=4)
    prompts[2] = {"id": prompts[2]["id"], "messages": [{"role": "user", "content": "a different question"}]}
    second = regenerate_local(tiny_target, prompts, path, template=ct, max_new_tokens=6, batch_size=4)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in lines] == [p["id"] for p in PROMPTS[:4]] + [prompts[2]["id"]]  # only p02 again
    expected = generate_batch(tiny_target.model, [ct.prompt_ids(prompts[2]["messages"])], max_new_tokens=6,
                              stop_ids=ct.stop_ids, pad_id=tiny_target.tokenizer.pad_token_id)[0]["tokens"]
    assert second["p02"]["response"] == tiny_target.tokenizer.decode(expected, skip_special_tokens=True)
    assert second["p02"]["prompt_sha"] != first["p02"]["prompt_sha"]
    assert all(second[i] == first[i] for i in ("p00", "p01", "p03"))


class _SlowServer:
    """Canned answers; the first request sleeps past the client's timeout. Records requests in flight."""

    def __init__(self, sleep_first_s: float, work_s: float = 0.05, reasoning: str = ""):
        self.lock, self.in_flight, self.max_in_flight, self.bodies = threading.Lock(), 0, 0, []
        self.sleep_first = sleep_first_s
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send({"data": [{"id": "m"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.bodies.append(body)
                    delay, server.sleep_first = server.sleep_first, 0.0
                    live = delay == 0  # the slow one is abandoned by the client: not its request any more
                    server.in_flight += live
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                time.sleep(delay + work_s)
                with server.lock:
                    server.in_flight -= live
                try:
                    message = {"content": "answer to " + body["messages"][-1]["content"]}
                    if reasoning:  # a server with a reasoning parser returns the reasoning apart
                        message["reasoning_content"] = reasoning
                    self._send({"choices": [{"message": message, "finish_reason": "stop"}],
                                "usage": {"completion_tokens": 3}})
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this request (timeout)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_endpoint_timeout_is_retried_and_concurrency_is_bounded(tmp_path):
    server = _SlowServer(sleep_first_s=1.5)
    try:
        results = regenerate_endpoint(server.url, PROMPTS[:10], tmp_path / "r.jsonl", max_new_tokens=4,
                                      concurrency=3, timeout_s=0.5, retries=2, backoff_s=0.01,
                                      stop_token_ids=[7, 9])
    finally:
        server.close()
    assert set(results) == {p["id"] for p in PROMPTS[:10]}
    assert all(r["response"] == "answer to " + p["messages"][-1]["content"] for p, r in
               zip(PROMPTS[:10], (results[p["id"]] for p in PROMPTS[:10])))
    assert len(server.bodies) == 11  # one request timed out and was sent again
    assert 1 < server.max_in_flight <= 3
    assert all(b["stop_token_ids"] == [7, 9] for b in server.bodies)


def test_an_answer_without_its_reasoning_is_refused(tmp_path):
    """A server with a reasoning parser returns the reasoning apart: the answer alone is not what the target
    wrote, so no result is kept and the error says what to change."""
    server = _SlowServer(sleep_first_s=0.0, work_s=0.0, reasoning="Let me think.")
    try:
        with pytest.raises(EyasError, match="without --reasoning-parser"):
            regenerate_endpoint(server.url, PROMPTS[:2], tmp_path / "r.jsonl", max_new_tokens=4, retries=0)
    finally:
        server.close()
    assert not (tmp_path / "r.jsonl").exists() or not (tmp_path / "r.jsonl").read_text().strip()


def test_results_written_before_prompt_hashes_still_resume(tmp_path, tiny_target):
    path = tmp_path / "regen.jsonl"
    path.write_text(json.dumps({"id": "p00", "response": "old", "num_tokens": 1, "finish": "stop"}) + "\n")
    results = regenerate_local(tiny_target, PROMPTS[:2], path, template=ChatTemplate(tiny_target.tokenizer),
                               max_new_tokens=4, batch_size=2)
    assert results["p00"]["response"] == "old" and [json.loads(x)["id"] for x in path.read_text().splitlines()] == [
        "p00", "p01"]


def _repeated_tail_by_definition(text: str, lo: int = 8, hi: int = 400) -> int:
    best = 0
    for p in range(lo, min(hi, len(text) // 2) + 1):
        r = 0
        while r < len(text) - p and text[len(text) - 1 - r] == text[len(text) - 1 - r - p]:
            r += 1
        if r >= p:
            best = max(best, r)
    return best


def test_repeated_tail_finds_the_loop_a_greedy_answer_ends_in():
    from eyas.data.regenerate import repeated_tail, repetition

    loop = "Intro: cats are great pets.\n" + "I like cats because they are soft. " * 6 + "I like ca"
    cases = [loop, "no loop here, just one sentence that ends.", "ab" * 40, "x" * 7,
             "The answer is 42. The answer is 42.", "start " + "0123456789" * 3]
    random_text = "".join(chr(97 + (i * 7919 % 26)) for i in range(300))  # periodic with period 26
    for text in cases + [random_text]:
        assert repeated_tail(text) == _repeated_tail_by_definition(text), text
    period = len("I like cats because they are soft. ")
    assert repeated_tail(loop) == 5 * period + len("I like ca")  # all but the first copy, cut-off copy included
    assert repeated_tail("no loop here, just one sentence that ends.") == 0
    stats = repetition([{"response": loop, "num_tokens": 100}, {"response": "plain answer.", "num_tokens": 100}])
    assert stats["responses"] == 1
    assert abs(stats["token_share"] - 100 * repeated_tail(loop) / len(loop) / 200) < 1e-4


def test_an_answer_cut_by_the_token_cap_leaves_its_end_of_turn_out_of_the_loss(tmp_path, smollm2):
    """SmolLM2's template closes every assistant turn with <|im_end|>; the target writes it only where it ends
    its answer. An answer stopped by data.regen_max_new_tokens is trained on without it."""
    from eyas.config import apply_overrides, preset
    from eyas.data import load_prepared
    from eyas.data.prepare import prepare

    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"id": "short", "messages": [
        {"role": "user", "content": "What is the capital of France?"}]})
        + "\n" + json.dumps({"id": "long", "prompt": "Write a long story about a dragon."}) + "\n")
    cfg = apply_overrides(preset("demo"), {"data": {"data": [str(src)], "num_prompts": 0, "regen_max_new_tokens": 24}})
    summary = prepare(cfg, tmp_path / "out", smollm2)
    results = {json.loads(line)["id"]: json.loads(line) for line in
               (tmp_path / "out" / summary["regeneration"]["results"]).read_text().splitlines()}
    assert results["short"]["finish"] == "stop" and results["long"]["finish"] == "length", results
    assert summary["num_cut_turn_ends"] == 1
    end_of_turn = smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = {r["sample_id"]: r for r in load_prepared(tmp_path / "out")}
    for sid, ends_itself in (("short", True), ("long", False)):
        under_loss = [i for i, m in zip(rows[sid]["input_ids"], rows[sid]["loss_mask"]) if m]
        assert (under_loss[-1] == end_of_turn) is ends_itself, sid
        assert smollm2.tokenizer.decode(under_loss, skip_special_tokens=True) == results[sid]["response"]
        assert end_of_turn in rows[sid]["input_ids"]  # the turn is still closed in the sample's context
