"""A hybrid model's multi-turn conversation through a real serve and the official OpenAI client: each turn
reuses its history (usage.prompt_tokens_details.cached_tokens, the runner's prompt cache under serve's
default exact reuse) and answers bitwise as a cold runner does (kvcache/recurrent.py's resume checkpoints).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from serve_process import serve_process
from synthetic.models import write_synthetic

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

SYSTEM = "You are a patient storyteller. " + "Answer in short plain sentences about the sea and its people. " * 6
MESSAGE = "\nUser: " + "Tell me more about the old fisherman, his boat, his nets and the harbour on day {0}. " * 3


def unload(url: str, model: str) -> None:
    httpx.post(url + "/api/stop", json={"model": model}, timeout=60).raise_for_status()
    deadline = time.monotonic() + 60
    while any(model in (entry["name"], entry["model"]) for entry in httpx.get(url + "/api/ps").json()["models"]):
        assert time.monotonic() < deadline, "the model did not unload"
        time.sleep(0.05)


def complete(client, model: str, prompt: str):
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, seed=7)


def generate(url: str, model: str, prompt: str) -> dict:
    """The same completion through the native API, with logprobs (the OpenAI completion carries none)."""
    body = {"model": model, "prompt": prompt, "stream": False, "logprobs": True, "top_logprobs": 3,
            "options": {"num_predict": 8, "temperature": 0, "seed": 7}}
    response = httpx.post(url + "/api/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("preset", ["tiny-lfm2", "tiny-nemotron_h"])
def test_a_hybrid_conversation_through_serve_reuses_its_history(tmp_path: Path, preset: str):
    """Four turns through the official client: each reuses the previous prompt but for its last few inputs.
    Then the same turns through the native API, and the last one again on a fresh runner: the same logprobs."""
    path = str(write_synthetic(tmp_path / f"{preset}.gguf", preset, weight_type="Q8_0"))
    with serve_process(tmp_path / "models") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        conversation, prompts, turns = SYSTEM, [], []
        for turn in range(4):
            conversation += MESSAGE.format(turn) + "\nAssistant:"
            answer = complete(client, path, conversation)
            details = answer.usage.prompt_tokens_details
            prompts.append(conversation)
            turns.append((answer.usage.prompt_tokens, details.cached_tokens if details else 0))
            conversation += answer.choices[0].text
        assert turns[0][1] == 0, turns
        for (previous, _), (prompt, cached) in zip(turns, turns[1:], strict=False):
            assert previous - previous % 4 - 4 <= cached < prompt, turns  # the previous prompt but its last few
        unload(url, path)
        hits = [generate(url, path, prompt) for prompt in prompts]
        unload(url, path)
        cold = generate(url, path, prompts[-1])
        assert cold["response"] == hits[-1]["response"]
        assert cold["logprobs"] == hits[-1]["logprobs"]  # token, logprob and top alternatives, bitwise
