"""A prompt-cache hit answers exactly as a cold run does, in serve's default configuration, on real weights.

On a hit the runner evaluates only what the cache lacks (at least the last prompt token), so the prompt
is cut into other batches than a cold run's. serve's default (flash attention auto: on for every
architecture on the CPU) computes every query row by itself, so the cut cannot change a result: the
logprobs of every generated token (and the top alternatives) must equal a cold run's bitwise, on any
CPU. Cold means a freshly loaded runner (unloaded with /api/stop before the request).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_process import serve_process

httpx = pytest.importorskip("httpx")

OPTIONS = {"num_predict": 8, "temperature": 0, "seed": 7}
PROMPT = "Tell me a short story about a lighthouse keeper and a storm."
EXTENSION = PROMPT + " Make it happy, and give the keeper a name."
OTHER_ENDING = "Tell me a short story about a lighthouse keeper who finds a lost cat."  # shares a prefix


@pytest.fixture(scope="module", params=[1, 4], ids=["1-slot", "4-slots"])
def server(request, tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp(f"hits-{request.param}")
    with serve_process(root / "models", OLLAMA_NUM_PARALLEL=str(request.param)) as url:
        yield url


@pytest.fixture(params=["smollm2", "gemma3"])
def model(request, smollm2_path: Path, gemma3_path: Path) -> str:
    return str({"smollm2": smollm2_path, "gemma3": gemma3_path}[request.param])


def post(server: str, route: str, body: dict) -> dict:
    response = httpx.post(server + route, json={**body, "stream": False}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def unload(server: str, model: str) -> None:
    post(server, "/api/stop", {"model": model})
    deadline = time.monotonic() + 60
    while any(model in (entry["name"], entry["model"]) for entry in httpx.get(server + "/api/ps").json()["models"]):
        assert time.monotonic() < deadline, "the model did not unload"
        time.sleep(0.05)


def generate(server: str, model: str, prompt: str, **fields) -> dict:
    return post(server, "/api/generate", {"model": model, "prompt": prompt, "options": OPTIONS, "logprobs": True,
                                          "top_logprobs": 3, **fields})


def chat(server: str, model: str, messages: list[dict]) -> dict:
    return post(server, "/api/chat", {"model": model, "messages": messages, "options": OPTIONS, "logprobs": True,
                                      "top_logprobs": 3})


def assert_same(hit: dict, cold: dict) -> None:
    assert hit["logprobs"] == cold["logprobs"]  # token, logprob and top alternatives, bitwise
    assert hit.get("response", hit.get("message")) == cold.get("response", cold.get("message"))


def test_the_same_prompt_twice(server: str, model: str):
    unload(server, model)
    cold = generate(server, model, PROMPT)
    hit = generate(server, model, PROMPT)
    assert_same(hit, cold)


@pytest.mark.parametrize("prompt", [EXTENSION, OTHER_ENDING], ids=["extending", "sharing-a-prefix"])
def test_a_prompt_after_a_cached_one(server: str, model: str, prompt: str):
    """A prompt extending the cached one, or sharing only a prefix with it."""
    unload(server, model)
    cold = generate(server, model, prompt)
    unload(server, model)
    generate(server, model, PROMPT)
    assert_same(generate(server, model, prompt), cold)


def test_a_conversation_through_context(server: str, model: str):
    unload(server, model)
    first = generate(server, model, PROMPT)
    hit = generate(server, model, "And then?", context=first["context"])
    unload(server, model)
    assert_same(hit, generate(server, model, "And then?", context=first["context"]))


def test_a_conversation_through_chat_history(server: str, model: str):
    unload(server, model)
    turn = [{"role": "user", "content": PROMPT}]
    answer = chat(server, model, turn)["message"]
    history = turn + [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": "And then?"}]
    hit = chat(server, model, history)
    unload(server, model)
    assert_same(hit, chat(server, model, history))


LONG = " ".join(f"Note {i}: the {('red', 'green', 'blue')[i % 3]} crate on shelf {i % 7} holds {i * 7 % 50} bolts."
                for i in range(90))  # ~1 500 Gemma tokens: past its sliding layers' ring of 512 + 512 cells


def test_a_prompt_past_the_sliding_window_ring(server: str, gemma3_path: Path):
    """Gemma 3's sliding layers keep a ring of 1 024 cells (window 512 + batch 512): a hit on a prompt that
    wrapped the ring goes on in the cells a cold run uses, and answers as a cold run does."""
    model, prompt = str(gemma3_path), LONG + " Which shelf holds the most bolts?"
    unload(server, model)
    cold = generate(server, model, prompt)
    assert cold["prompt_eval_count"] > 1100
    unload(server, model)
    first = generate(server, model, LONG + " Count the red crates.")
    hit = generate(server, model, prompt)
    # the shared part came from the cache (exact reuse resumes at 1 536, a multiple of the batch)
    assert hit["prompt_eval_duration"] < first["prompt_eval_duration"] / 3
    assert_same(hit, cold)
