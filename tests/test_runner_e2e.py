"""The runner subprocess on a synthetic model, driven over HTTP the way Ollama's scheduler drives it."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from synthetic.models import write_synthetic

from ollama_engine.fs import GGUFFile

PARALLEL = 4
NUM_CTX = 128
BATCH = 16  # smaller than some prompts, so they continue over several batches
LOAD = {
    "Operation": 0, "LoraPath": None, "Parallel": PARALLEL, "BatchSize": BATCH, "FlashAttention": 0,
    "KvSize": NUM_CTX * PARALLEL, "KvCacheType": "", "NumThreads": 2, "GPULayers": None,
    "MultiUserCache": False, "ProjectorPath": "", "MainGPU": 0, "UseMmap": False,
}
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. " * 6,  # longer than one batch
    "Hello",
    "In a hole in the ground there lived a hobbit.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Call me Ishmael.",
    "It was the best of times, it was the worst of times.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",  # shares a prefix with prompt 1
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    def __init__(self, port: int):
        self.port = port

    def request(self, method: str, path: str, body: bytes | dict | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request(method, path, body=data)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        status, data = self.request(method, path, body)
        assert status == 200, data
        return json.loads(data)

    def load(self, operation: int, **changes) -> dict:
        return self.json("POST", "/load", {**LOAD, **changes, "Operation": operation})

    def complete(self, prompt: str, **fields) -> tuple[str, dict]:
        """The streamed text and the final line of a completion."""
        status, data = self.request("POST", "/completion", completion(prompt, **fields))
        assert status == 200, data
        lines = [json.loads(line) for line in data.splitlines()]
        assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"]
        return "".join(line["content"] for line in lines), lines[-1]


def completion(prompt: str, options: dict | None = None, **fields) -> dict:
    return {"Prompt": prompt, "Options": {"num_predict": 16, **(options or {})}, "Shift": True, "Truncate": True,
            **fields}


def start_runner(model: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ollama_engine", "runner", "--model", str(model), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            Client(port).request("GET", "/health")
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()) from None
            time.sleep(0.05)
    proc.kill()
    raise TimeoutError("the runner did not start")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    # large enough that loading the weights takes a moment, so /health shows the progress
    return write_synthetic(tmp_path_factory.mktemp("runner") / "llama.gguf", "llama", n_embd=256, n_ff=1024,
                           n_layer=4, n_head=4, n_head_kv=2)


@pytest.fixture(scope="module")
def runner(model):
    """A runner through fit, alloc and commit; yields its client and what the load steps returned."""
    port = free_port()
    proc = start_runner(model, port)
    client = Client(port)
    try:
        steps = {"launched": client.json("GET", "/health"), "fit": client.load(0), "alloc": client.load(1)}
        steps["commit"] = client.load(2)
        health = []
        while not health or health[-1]["status"] != 0:
            health.append(client.json("GET", "/health"))
        steps["health"] = health
        yield client, steps
    finally:
        proc.kill()
        proc.wait()


def test_fit_alloc_commit_and_health_progress(runner):
    client, steps = runner
    assert steps["launched"] == {"status": 2, "progress": 0}
    fit, alloc, commit = steps["fit"]["Memory"], steps["alloc"]["Memory"], steps["commit"]["Memory"]
    assert steps["fit"]["Success"] and steps["alloc"]["Success"] and steps["commit"]["Success"]
    cpu = fit["CPU"]
    assert len(cpu["Weights"]) == len(cpu["Cache"]) == 4 + 1  # block_count + the output layer
    assert all(cpu["Weights"]) and all(cpu["Cache"][:4]) and cpu["Cache"][4] == 0
    assert fit["InputWeights"] > 0 and cpu["Graph"] > 0
    # fit measures what alloc allocates; the commit reuses the allocation
    assert fit == alloc == commit
    health = steps["health"]
    assert health[0]["status"] == 3, "commit returns before the weights are loaded"
    assert {h["status"] for h in health} == {3, 0} and health[-1] == {"status": 0, "progress": 1}
    progress = [h["progress"] for h in health]
    assert progress == sorted(progress)


def test_load_after_commit_is_refused(runner):
    client, _ = runner
    for operation in (0, 1, 2, 3):
        assert client.request("POST", "/load", {**LOAD, "Operation": operation}) == (500, b"model already loaded\n")


def test_concurrent_completions_equal_solo_runs(runner):
    client, _ = runner
    solo = [client.complete(prompt) for prompt in PROMPTS]
    assert any(done["done_reason"] == 1 and done["eval_count"] == 16 for _, done in solo)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(client.complete, PROMPTS))
    for (text, done), (solo_text, solo_done) in zip(together, solo, strict=True):
        assert text == solo_text
        for key in ("done_reason", "prompt_eval_count", "eval_count"):
            assert done[key] == solo_done[key]


def test_num_predict_and_stop_sequences(runner):
    client, _ = runner
    text, done = client.complete(PROMPTS[3], options={"num_predict": 24})
    assert done["done_reason"] == 1 and done["eval_count"] == 24
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut, done = client.complete(PROMPTS[3], options={"num_predict": 24, "stop": ["never appears", stop]})
    assert cut == text[: text.index(stop)]
    assert done["done_reason"] == 0


def test_context_shift_or_length(runner):
    client, _ = runner
    prompt = PROMPTS[4]
    options = {"num_predict": NUM_CTX + 8, "temperature": 1.0, "seed": 3}
    _, shifted = client.complete(prompt, options=options)
    assert shifted["done_reason"] == 1 and shifted["eval_count"] == NUM_CTX + 8, "the context shifted"
    _, ended = client.complete(prompt, options=options, Shift=False)
    assert ended["done_reason"] == 1
    # the slot fills up: the batch that would hold one more token is never formed, and (as in Ollama's
    # pipeline) the token being sampled meanwhile is dropped with it
    assert ended["eval_count"] == NUM_CTX - ended["prompt_eval_count"]


@pytest.mark.parametrize("num_predict", [-1, 0])
def test_the_runner_bounds_every_generation(runner, model, num_predict):
    """Whatever a parent sends (serve caps num_predict as Ollama's does; another parent may not), "no limit"
    ends after 10 x num_ctx tokens, context shifts included: end-of-generation is biased away, so only the
    cap can stop it."""
    client, _ = runner
    eos = GGUFFile.open(model).metadata["tokenizer.ggml.eos_token_id"]
    options = {"num_predict": num_predict, "temperature": 0, "logit_bias": {str(eos): -1e9}}
    _, done = client.complete(PROMPTS[2], options=options)
    assert done["done_reason"] == 1 and done["eval_count"] == 10 * NUM_CTX


def test_prompt_longer_than_context(runner):
    client, _ = runner
    prompt = " ".join(str(i) for i in range(NUM_CTX))
    status, body = client.request("POST", "/completion", completion(prompt, Truncate=False))
    assert (status, body) == (400, b"the input length exceeds the context length\n")
    _, done = client.complete(prompt, options={"num_predict": 2, "num_keep": 4})
    assert done["prompt_eval_count"] == NUM_CTX


def test_malformed_requests(runner):
    client, _ = runner
    assert client.request("POST", "/completion", b"{not json") == (400, b"Bad request\n")
    assert client.request("POST", "/completion", {"Prompt": 3}) == (400, b"Bad request\n")
    status, _ = client.request("POST", "/embedding", {"content": "hi"})
    assert status == 501


def test_disconnected_client_frees_its_slot(runner):
    client, _ = runner
    sockets = []
    for prompt in PROMPTS[:PARALLEL]:  # take every slot, with generations that would run for a long time
        conn = http.client.HTTPConnection("127.0.0.1", client.port, timeout=60)
        conn.request("POST", "/completion", json.dumps(completion(prompt, options={"num_predict": 100_000})))
        response = conn.getresponse()
        first = json.loads(response.readline())
        assert not first["done"]
        sockets.append(conn)
    for conn in sockets:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    # only possible once the abandoned sequences have given their slots back
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(client.complete, PROMPTS[:PARALLEL]))
    assert all(done["done"] for _, done in results)


def test_port_in_use_is_a_fatal_error(model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "ollama_engine", "runner", "--model", str(model), "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )
    assert result.returncode != 0
    assert result.stderr.splitlines()[-1].startswith("error: ")
