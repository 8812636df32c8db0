"""One vLLM engine for a whole run: a long-lived process that regeneration and capture both use.

`eyas engine --config CONFIG --socket PATH` loads the target into vLLM once (hidden-state extraction on, see
eyas.target.vllm.engine) and answers requests on a Unix socket until it is terminated: `info`, `extract`
(prefill, states written to files the client reads and deletes) and `generate` (decoding, no states). `eyas
run` starts it in its own process group before the first stage that needs the target and ends it, with its
verified teardown, after the last; the stage commands get `--engine-socket PATH` and call `RemoteEngine`, which
offers the same calls as an in-process `ExtractionEngine`.

Messages are JSON (multiprocessing.connection's send_bytes/recv_bytes, never its pickling send/recv), and a
client proves it may talk with the key in PATH.key (mode 0600, written by the engine). The states stay on the
local file system: a request returns file names, not tensors. The engine serves one client at a time; a client
that disappears mid-request costs nothing but that request (its files are removed).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

from eyas.common import EyasError, atomic_write_json, print0

KEY_SUFFIX = ".key"
INFO_SUFFIX = ".json"  # the served engine's info (layer ids, max_model_len, vLLM's start time), for eyas run


def info_path(socket_path: str | Path) -> Path:
    return Path(f"{socket_path}{INFO_SUFFIX}")


class EngineGone(EyasError):
    """The engine process ended (or its socket went away) while a request was in flight."""


def _send(conn, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn) -> dict:
    return json.loads(conn.recv_bytes().decode())


# ---------------------------------------------------------------- the engine process

def serve(engine, socket_path: str | Path, *, log=print0) -> None:
    """Answer requests on `socket_path` with `engine` (an ExtractionEngine) until SIGTERM/SIGINT; the socket and
    its key are removed at the end. The socket exists only once the engine is ready: a client (the runner)
    waits for it."""
    socket_path = Path(socket_path)
    if len(str(socket_path)) > 100:  # AF_UNIX paths are limited to ~107 bytes
        raise EyasError(f"the engine socket path {socket_path} is too long for a Unix socket (over 100 "
                        f"characters); use a shorter --run-dir or --socket")
    key = secrets.token_bytes(32)
    key_file = Path(f"{socket_path}{KEY_SUFFIX}")
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()  # a socket left by an engine that was killed: it answers nobody
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    stop = {"now": False}

    def _terminate(signum, _frame):
        stop["now"] = True
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGINT)}
    info_file = info_path(socket_path)
    atomic_write_json(info_file, {**engine.info(), "pid": os.getpid()})  # for eyas run, which reads, not connects
    listener = Listener(str(socket_path), family="AF_UNIX", authkey=key)
    log(f"engine ready on {socket_path}")
    try:
        while not stop["now"]:
            try:
                conn = listener.accept()
            except (OSError, EOFError) as e:  # a client that failed the key or hung up during the handshake
                log(f"engine: a connection was refused ({type(e).__name__}: {e})")
                continue
            with conn:
                _serve_client(engine, conn, log)
    finally:
        listener.close()
        for path in (socket_path, key_file, info_file):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        for s, handler in old.items():
            signal.signal(s, handler)


def _serve_client(engine, conn, log) -> None:
    """Requests of one client until it hangs up. An engine failure ends the process (the client sees the
    connection close and names the engine's log); a bad request is answered with its error."""
    served = 0
    while True:
        try:
            request = _recv(conn)
        except (EOFError, OSError):
            log(f"engine: client left after {served} request(s)")
            return
        op = request.get("op")
        t0 = time.perf_counter()
        if op == "info":
            reply = {"ok": True, "result": engine.info()}
        elif op == "extract":
            paths, refused = engine.extract(request["prompts"])
            reply = {"ok": True, "result": {"paths": {str(i): p for i, p in paths.items()},
                                            "refused": {str(i): r for i, r in refused.items()}}}
        elif op == "generate":
            reply = {"ok": True, "result": engine.generate(request["prompts"], max_tokens=int(request["max_tokens"]),
                                                           temperature=float(request.get("temperature", 0.0)),
                                                           seeds=request.get("seeds"),
                                                           stop_ids=list(request.get("stop_ids", ())))}
        else:
            reply = {"ok": False, "error": f"unknown request {op!r}"}
        try:
            _send(conn, reply)
        except (OSError, EOFError):
            log(f"engine: client left during a {op} request; its results are dropped")
            if op == "extract":
                _drop_files(reply["result"]["paths"].values())
            return
        served += 1
        if op in ("extract", "generate"):
            log(f"engine: {op} of {len(request['prompts'])} prompt(s) in {time.perf_counter() - t0:.2f} s")


def _drop_files(paths) -> None:
    from eyas.target.vllm.capture import read_states

    for path in paths:
        with contextlib.suppress(OSError):
            read_states(path)  # waits for the writer, then removes the file and its lock


def _clear_states(states: Path) -> None:
    """Remove the connector's files (REQUEST.safetensors, .lock, .tmp) from an engine's own states directory."""
    if not states.is_dir():
        return
    for path in states.iterdir():
        if path.is_file() and path.name.endswith((".safetensors", ".safetensors.lock", ".safetensors.tmp")):
            path.unlink(missing_ok=True)


def main(cfg, socket_path: str) -> int:
    """`eyas engine`: start the engine of the config's target and serve it."""
    from eyas.target.vllm.capture import start_engine

    socket_path = Path(socket_path).expanduser().absolute()
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    states = socket_path.parent / f".{socket_path.name}.states"
    _clear_states(states)  # files an engine killed before it could remove them
    engine = start_engine(cfg, states_dir=states)
    try:
        serve(engine, socket_path)
    except SystemExit:
        pass
    finally:
        engine.close()
        import shutil

        shutil.rmtree(states, ignore_errors=True)  # made by this engine for its files only
    return 0


# ---------------------------------------------------------------- the client

class RemoteEngine:
    """An engine served by `eyas engine` on `socket_path`, with ExtractionEngine's calls (`extract`, `generate`,
    `info`, `layer_ids`, `aux_layers`, `max_model_len`). `close()` hangs up; the engine keeps running."""

    def __init__(self, socket_path: str | Path, *, wait_s: float = 0.0):
        self.socket_path = Path(socket_path)
        deadline = time.monotonic() + wait_s
        while not self.socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            key = Path(f"{self.socket_path}{KEY_SUFFIX}").read_bytes()
            self._conn = Client(str(self.socket_path), family="AF_UNIX", authkey=key)
        except (OSError, EOFError) as e:
            raise EyasError(f"no eyas engine answers on {self.socket_path} ({type(e).__name__}: {e}); start one with "
                            f"`eyas engine --config CONFIG --socket {self.socket_path}` or leave --engine-socket out "
                            f"to start the engine in this command") from None
        info = self._call({"op": "info"})
        self.layer_ids = list(info["layer_ids"])
        self.aux_layers = self.layer_ids[:-1]
        self.max_model_len = int(info["max_model_len"])
        self.start_s = float(info["start_s"])
        self.vllm_version = info.get("vllm_version")

    def _call(self, request: dict):
        try:
            _send(self._conn, request)
            reply = _recv(self._conn)
        except (OSError, EOFError) as e:
            raise EngineGone(f"the eyas engine on {self.socket_path} ended during a {request['op']} request "
                             f"({type(e).__name__}); see the engine's log (RUN/logs/engine.log under eyas run). "
                             f"What was committed is intact: rerun the command to resume") from None
        if not reply.get("ok"):
            raise EyasError(f"the eyas engine refused a {request['op']} request: {reply.get('error')}")
        return reply["result"]

    def info(self) -> dict:
        return self._call({"op": "info"})

    def extract(self, prompts: list[list[int]]) -> tuple[dict[int, str], dict[int, str]]:
        got = self._call({"op": "extract", "prompts": [[int(t) for t in p] for p in prompts]})
        return ({int(i): p for i, p in got["paths"].items()}, {int(i): r for i, r in got["refused"].items()})

    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0,
                 seeds: list[int] | None = None, stop_ids=()) -> list[dict]:
        return self._call({"op": "generate", "prompts": [[int(t) for t in p] for p in prompts],
                           "max_tokens": int(max_tokens), "temperature": float(temperature),
                           "seeds": None if seeds is None else [int(s) for s in seeds],
                           "stop_ids": [int(t) for t in stop_ids]})

    def close(self) -> None:
        conn, self._conn = getattr(self, "_conn", None), None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
