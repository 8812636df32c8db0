"""Regeneration through an OpenAI-compatible server (vLLM, SGLang, ...): POST /v1/chat/completions.

Requests run on a bounded thread pool (data.regen_concurrency), each with a timeout and retries
with exponential backoff on connection errors, timeouts, 429 and 5xx; other 4xx answers are final.
Results go to the same resumable JSONL as local regeneration (written by the calling thread only).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from eyas.common import EyasError, progress
from eyas.data.regenerate import ResultsFile, pending, prompt_sha, read_results


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _request(url: str, body: dict | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def _with_retries(fn, retries: int, backoff_s: float):
    """Call fn(); retry transient failures. Returns (result, None) or (None, error text)."""
    last = ""
    for attempt in range(retries + 1):
        try:
            return fn(), None
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
            if e.code != 429 and e.code < 500:
                return None, last  # the request itself is wrong: retrying cannot help
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        except (ValueError, KeyError) as e:  # a non-JSON or malformed answer
            last = f"bad response ({type(e).__name__})"
        if attempt < retries:
            time.sleep(backoff_s * 2 ** attempt)
    return None, last


def served_model(url: str, timeout: float = 10.0) -> str:
    """The first model id the server lists (vLLM and SGLang want it in every request)."""
    answer, err = _with_retries(lambda: _request(f"{_base(url)}/v1/models", None, timeout), 2, 0.5)
    if err:
        raise EyasError(f"cannot reach the OpenAI-compatible server at {url} ({err}); start it or fix --regenerate")
    try:
        return str(answer["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise EyasError(f"{url}/v1/models lists no model; is it an OpenAI-compatible server?") from None


def regenerate_endpoint(url: str, prompts: list[dict], out_path: str | Path, *, max_new_tokens: int,
                        temperature: float = 0.0, concurrency: int = 8, timeout_s: float = 120.0,
                        retries: int = 3, backoff_s: float = 1.0, model: str | None = None,
                        stop_token_ids: list[int] | None = None,
                        chat_template_kwargs: dict | None = None) -> dict[str, dict]:
    """Ask the server for a response to each {id, messages} not yet in `out_path`; returns all results.

    A prompt that still fails after the retries gets no line (a rerun tries it again) and is
    reported by the caller as `regeneration_failed`.
    """
    done = read_results(out_path)
    todo = pending(prompts, done)
    if not todo:
        return done
    model = model or served_model(url)
    endpoint = f"{_base(url)}/v1/chat/completions"

    def one(p: dict) -> tuple[dict, dict | None, str | None]:
        body = {"model": model, "messages": p["messages"], "max_tokens": max_new_tokens, "temperature": temperature}
        if stop_token_ids:  # vLLM and SGLang extension: extra ids that end the response
            body["stop_token_ids"] = list(stop_token_ids)
        if chat_template_kwargs:  # vLLM and SGLang extension: variables for the server's chat template
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        answer, err = _with_retries(lambda: _request(endpoint, body, timeout_s), retries, backoff_s)
        if err:
            return p, None, err
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"]
            if not isinstance(text, str):
                raise TypeError
        except (KeyError, IndexError, TypeError):
            return p, None, "bad response (no choices[0].message.content)"
        message = choice["message"]
        if any(isinstance(message.get(k), str) and message[k] for k in ("reasoning_content", "reasoning")):
            # the draft must learn the whole text the target writes, its reasoning included
            return p, None, ("the server returned the model's reasoning apart from its answer (a reasoning parser "
                             "is on); serve the target without --reasoning-parser so that the answer holds all "
                             "it wrote")
        usage = answer.get("usage") or {}
        return p, {"id": p["id"], "prompt_sha": prompt_sha(p["messages"]), "response": text,
                   "num_prompt_tokens": usage.get("prompt_tokens"),
                   "num_tokens": usage.get("completion_tokens"), "finish": choice.get("finish_reason")}, None

    sink = ResultsFile(out_path)
    failures: dict[str, str] = {}
    bar = progress(total=len(prompts), initial=len(prompts) - len(todo), desc="regenerate", unit="sample")
    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            in_flight = set()
            queue = iter(todo)
            # keep at most `concurrency` requests in flight so a huge prompt list is not all queued at once
            for p in queue:
                in_flight.add(pool.submit(one, p))
                if len(in_flight) >= concurrency:
                    break
            while in_flight:
                finished, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                for fut in finished:
                    p, rec, err = fut.result()
                    if rec is not None:
                        sink.append([rec])
                        done[rec["id"]] = rec
                    else:
                        failures[p["id"]] = err or "unknown error"
                    bar.update(1)
                    nxt = next(queue, None)
                    if nxt is not None:
                        in_flight.add(pool.submit(one, nxt))
    finally:
        bar.close()
        sink.close()
    if failures and len(failures) == len(todo):
        first = next(iter(failures.values()))
        raise EyasError(f"every request to {endpoint} failed (first error: {first}); check the server and retry")
    return done
