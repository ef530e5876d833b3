"""Property-based requests against every route of `serve` and of the runner: bad input gets a 4xx with a reason.

Each example is a route's valid body with fields replaced by values of other types, removed, or added, numbers
huge or negative, strings with lone surrogates; or a body that is not JSON at all (invalid UTF-8, NaN, deep
nesting, truncated). The server must answer below 500 with a reason (`{"error": ...}` on /api/ and /v1/, Go's
plain-text errors on the runner), never a traceback, and keep serving: a valid request works afterwards.

Both servers are real subprocesses on a tiny synthetic llama. FUZZ_API_EXAMPLES raises the number of examples
(CI: 40 each):

    FUZZ_API_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_fuzz_api.py
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_process import free_port, serve_process
from synthetic.models import write_synthetic

EXAMPLES = int(os.environ.get("FUZZ_API_EXAMPLES", "0"))
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FEW = {"num_predict": 2, "temperature": 0}

# ------------------------------------------------------------------------------------------ values

HUGE_INTS = st.sampled_from([-1, -(2**31), 2**31, 2**53 + 1, 2**63, -(2**63) - 1, 2**64, 10**30])
LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), HUGE_INTS,
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u2028", "💥" * 3, "-1", "5m", "sha256:" + "0" * 64]),
)
JSON = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=4), max_leaves=10)
# Sampling options only: a runner option (num_ctx, num_batch, num_thread, ...) reloads the runner (see the test below).
OPTION_KEYS = ["num_predict", "temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_last_n",
               "repeat_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "num_keep", "mirostat"]
RAW_BODIES = [b"", b" ", b"{", b"[]", b"null", b"42", b'"text"', b"\xff\xfe\x00", b'{"model": "\xc3\x28"}',
              b'{"model": NaN}', b'{"options": {"temperature": Infinity}}', b'{"options": {"top_p": 1e400}}',
              b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
              b'{"model": "tiny", "prompt": "\\ud800"}', b'{"model": "tiny"} trailing']


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    """A body: the route's valid one with 0 to 3 changes, or one that is not a JSON object at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(RAW_BODIES) | st.binary(max_size=40))
    body = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["set", "set", "delete", "extra", "option", "option"]))
        keys = sorted(body)
        if action == "set" and keys:
            body[draw(st.sampled_from(keys))] = draw(JSON)
        elif action == "delete" and keys:
            body.pop(draw(st.sampled_from(keys)))
        elif action == "extra":
            body[draw(st.text(max_size=10))] = draw(JSON)
        elif action == "option":
            options = body.get("options") if isinstance(body.get("options"), dict) else {}
            options[draw(st.sampled_from(OPTION_KEYS))] = draw(JSON | HUGE_INTS)
            body["options"] = options
    return json.dumps(body).encode()


# ------------------------------------------------------------------------------------------ checks


def check_answer(response: httpx.Response, json_errors: bool = True) -> None:
    """Below 500, a reason with every error (HEAD has no body), no traceback."""
    text = response.text
    upstream = response.request.url.path == "/api/pull" and response.status_code == 500  # the registry's fault
    assert response.status_code < 500 or upstream, f"{response.status_code}: {text[:500]}"
    assert "Traceback (most recent call last)" not in text, text[:2000]
    if response.request.method == "HEAD":
        return
    if response.status_code >= 400 and json_errors and text not in ("404 page not found", "405 method not allowed"):
        error = response.json()["error"]
        message = error["message"] if isinstance(error, dict) else error
        assert isinstance(message, str) and message, text
    elif response.status_code >= 400:
        assert text.strip(), "an error without a reason"


# ------------------------------------------------------------------------------------------ serve


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Path]]:
    """serve on a store with `tiny` (a synthetic llama); yields a client and the store."""
    root = tmp_path_factory.mktemp("fuzz-api")
    store = root / "models"
    gguf = write_synthetic(root / "tiny.gguf", "tiny-llama", seed=1)
    with serve_process(store) as url, httpx.Client(base_url=url, timeout=120) as client:
        digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
        assert client.post(f"/api/blobs/{digest}", content=gguf.read_bytes()).status_code == 201
        assert client.post("/api/create", json={"model": "tiny", "files": {"tiny.gguf": digest},
                                                "stream": False}).status_code == 200
        yield client, store


SERVE_ROUTES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/api/generate", {"model": "tiny", "prompt": "Once", "options": FEW, "stream": False}),
    ("POST", "/api/generate", {"model": "tiny", "prompt": "Once", "options": FEW}),
    ("POST", "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "options": FEW,
                           "stream": False}),
    ("POST", "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "options": FEW,
                           "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("POST", "/api/embed", {"model": "tiny", "input": ["a", "b"]}),
    ("POST", "/api/embeddings", {"model": "tiny", "prompt": "a"}),
    ("POST", "/api/show", {"model": "tiny", "verbose": True}),
    ("POST", "/api/create", {"model": "fuzz-made", "from": "tiny", "system": "s", "parameters": {"top_k": 3},
                             "stream": False}),
    ("POST", "/api/copy", {"source": "tiny", "destination": "fuzz-copy"}),
    ("DELETE", "/api/delete", {"model": "fuzz-copy"}),
    ("POST", "/api/pull", {"model": "127.0.0.1:9/library/none:latest", "insecure": True, "stream": False}),
    ("POST", "/api/stop", {"model": "fuzz-made"}),
    ("POST", "/api/blobs/sha256:" + "1" * 64, {"not": "the blob"}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 2, "temperature": 0}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 2}),
    ("POST", "/v1/embeddings", {"model": "tiny", "input": "a"}),
    ("GET", "/api/tags", {}), ("GET", "/api/ps", {}), ("GET", "/api/version", {}), ("GET", "/", {}),
    ("HEAD", "/api/blobs/sha256:" + "2" * 64, {}), ("GET", "/v1/models", {}), ("GET", "/v1/models/tiny", {}),
]


def _request(client: httpx.Client, method: str, path: str, body: bytes) -> httpx.Response:
    return client.request(method, path, content=body if method in ("POST", "DELETE") else None,
                          headers={"Content-Type": "application/json"})


def assert_serving(client: httpx.Client) -> None:
    response = client.post("/api/generate", json={"model": "tiny", "prompt": "Once", "options": FEW, "stream": False})
    assert response.status_code == 200, response.text
    assert response.json()["done"] is True


@given(data=st.data())
@settings(max_examples=EXAMPLES or 40, **SETTINGS)
def test_serve_routes_answer_bad_input_with_a_reason(serve: tuple[httpx.Client, Path], data: st.DataObject) -> None:
    client, _ = serve
    method, path, base = data.draw(st.sampled_from(SERVE_ROUTES))
    body = data.draw(mutated(base)) if method in ("POST", "DELETE") else b""
    check_answer(_request(client, method, path, body))


def test_serve_still_serves_after_the_fuzzing(serve: tuple[httpx.Client, Path]) -> None:
    client, _ = serve
    assert_serving(client)
    assert client.get("/api/tags").json()["models"][0]["name"]


@pytest.mark.parametrize("option, value", [
    ("num_ctx", 2**62), ("num_ctx", 2**64), ("num_batch", 0), ("num_batch", 2**40), ("num_thread", -1),
    ("num_thread", 10**6), ("num_gpu", 999),
])
def test_absurd_runner_options_are_refused_or_clamped(serve: tuple[httpx.Client, Path], option: str,
                                                      value: int) -> None:
    """Load-time options reach the runner's /load: each gets an answer (4xx, or a load it can make), then
    the server still serves."""
    client, _ = serve
    response = client.post("/api/generate", json={"model": "tiny", "prompt": "Once", "stream": False,
                                                  "options": {**FEW, option: value}})
    check_answer(response)
    assert_serving(client)


def test_deep_and_huge_bodies(serve: tuple[httpx.Client, Path]) -> None:
    client, _ = serve
    deep = b'{"model": "tiny", "messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    check_answer(client.post("/api/chat", content=deep))
    # 1 MiB of prompt (200k words for a context of 512): truncated to the context as Ollama does, or refused
    huge = json.dumps({"model": "tiny", "prompt": "word " * 200_000, "options": FEW, "stream": False})
    check_answer(client.post("/api/generate", content=huge.encode()))
    assert_serving(client)


def test_slow_clients_do_not_stall_others(serve: tuple[httpx.Client, Path]) -> None:
    """A client that sends its headers a byte at a time, and one that never reads its stream, while others are
    served; then both are dropped."""
    client, _ = serve
    host, port = client.base_url.host, client.base_url.port
    dribbler = socket.create_connection((host, port))
    dribbler.sendall(b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    reader = socket.create_connection((host, port))
    request = json.dumps({"model": "tiny", "prompt": "Once", "options": {"num_predict": 200, "temperature": 0}})
    reader.sendall(f"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(request)}\r\n"
                   f"Content-Type: application/json\r\n\r\n{request}".encode())
    try:
        for _ in range(3):
            dribbler.sendall(b"X")
            started = time.monotonic()
            assert_serving(client)
            assert time.monotonic() - started < 30
    finally:
        dribbler.close()
        reader.close()
    assert_serving(client)


# ------------------------------------------------------------------------------------------ the runner


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """`ollama-engine runner` on the tiny llama, loaded (fit, alloc, commit) and ready."""
    root = tmp_path_factory.mktemp("fuzz-runner")
    gguf = write_synthetic(root / "tiny.gguf", "tiny-llama", seed=1)
    port = free_port()
    log = open(root / "runner.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "ollama_engine", "runner", "--model", str(gguf), "--port",
                                str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.get("/health")
                    break
                except httpx.TransportError:
                    assert process.poll() is None and time.monotonic() < deadline, (root / "runner.log").read_text()
                    time.sleep(0.2)
            load = {"Operation": 2, "Parallel": 2, "BatchSize": 64, "KvSize": 1024, "NumThreads": 1}
            assert client.post("/load", json=load).json()["Success"] is True
            while client.get("/health").json()["status"] != 0:
                time.sleep(0.1)
            yield client
            assert process.poll() is None, f"the runner died: {(root / 'runner.log').read_text()[-3000:]}"
    finally:
        process.kill()
        process.wait()
        log.close()


RUNNER_ROUTES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "/completion", {"prompt": "Once", "options": {"num_predict": 2, "temperature": 0}}),
    ("POST", "/completion", {"prompt": "Once", "options": {"num_predict": 2}, "logprobs": True, "top_logprobs": 3,
                             "shift": True, "truncate": True}),
    ("POST", "/embedding", {"content": "Once"}),
    ("POST", "/load", {"Operation": 0}),
    ("GET", "/health", {}), ("GET", "/info", {}),
]


def bounded(body: bytes) -> bytes:
    """The runner generates without end when asked to (num_predict -1 with shift, as Ollama's runner; the
    parent caps it at 10 x num_ctx): keep a fuzzed completion to a few tokens."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return body
    options = data.get("options") if isinstance(data, dict) else None
    if isinstance(options, dict):
        options["num_predict"] = 8
        return json.dumps(data).encode()
    return body


def runner_completion_works(client: httpx.Client) -> None:
    response = client.post("/completion", json={"prompt": "Once", "options": {"num_predict": 2, "temperature": 0}})
    assert response.status_code == 200, response.text
    assert json.loads(response.text.splitlines()[-1])["done"] is True


@given(data=st.data())
@settings(max_examples=EXAMPLES or 40, **SETTINGS)
def test_runner_routes_answer_bad_input_with_a_reason(runner: httpx.Client, data: st.DataObject) -> None:
    method, path, base = data.draw(st.sampled_from(RUNNER_ROUTES))
    body = bounded(data.draw(mutated(base))) if method == "POST" else b""
    response = _request(runner, method, path, body)
    if path == "/load" and response.text == "model already loaded\n":
        return  # Ollama's runner answers a second /load with this 500
    if path == "/embedding" and response.status_code == 501:
        return  # the tiny llama makes no embeddings: Ollama's 501
    check_answer(response, json_errors=False)


def test_runner_still_serves_after_the_fuzzing(runner: httpx.Client) -> None:
    runner_completion_works(runner)
