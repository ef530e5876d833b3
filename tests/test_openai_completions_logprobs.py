"""/v1/completions `logprobs` (OpenAI's legacy integer form), driven by the official `openai` client against a real
`serve` on real SmolLM2-135M-Instruct weights.

The legacy shape is four parallel lists per choice: `tokens`, `token_logprobs`, `top_logprobs` (one dict of the
`logprobs` likeliest tokens' texts per token, plus the chosen one) and `text_offset`. Its values must be the native
API's for the same greedy request: both come from the same runner, whose prompt cache gives a cold run's logprobs
bitwise (README: "Ask twice, get the same answer"), so they are compared exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import serve_process

openai = pytest.importorskip("openai")

PROMPT = "Name three colors of the rainbow."
TOKENS = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path: Path) -> Iterator[str]:
    import ollama

    root = tmp_path_factory.mktemp("completions-logprobs")
    with serve_process(root / "models") as url:
        client = ollama.Client(host=url)
        client.create(model="smollm2", files={"smollm2.gguf": client.create_blob(smollm2_path)})
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def native_logprobs(server: str, top: int) -> tuple[str, list[dict[str, Any]]]:
    """The native /api/generate answer and logprobs of the same greedy request."""
    response = httpx.post(server + "/api/generate", timeout=120, json={
        "model": "smollm2", "prompt": PROMPT, "stream": False, "logprobs": True, "top_logprobs": top,
        "options": {"temperature": 0, "num_predict": TOKENS}})
    response.raise_for_status()
    body = response.json()
    return body["response"], body["logprobs"]


def expected_top(entry: dict[str, Any], top: int) -> dict[str, float]:
    """The native entry's alternatives as the legacy dict: the top `top`, best first, then the chosen token."""
    out: dict[str, float] = {}
    for alt in (entry.get("top_logprobs") or [])[:top]:
        out.setdefault(alt["token"], alt["logprob"])
    out.setdefault(entry["token"], entry["logprob"])
    return out


def check_against_native(logprobs: Any, text: str, native: list[dict[str, Any]], top: int) -> None:
    assert logprobs.tokens == [e["token"] for e in native]
    assert logprobs.token_logprobs == [e["logprob"] for e in native]  # exactly: one runner, bitwise cache hits
    assert logprobs.top_logprobs == [expected_top(e, top) for e in native]
    assert "".join(logprobs.tokens) == text
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    rows = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    for chosen, value, alternatives in rows:
        # greedy: the chosen token is the likeliest, so it adds no entry (tokens sharing a text share one)
        assert value <= 0 and 1 <= len(alternatives) <= max(top, 1)
        assert max(alternatives.values()) == value == alternatives[chosen]
        assert list(alternatives.values()) == sorted(alternatives.values(), reverse=True)


@pytest.mark.parametrize("top", [3, 0, 5])
def test_logprobs_equal_the_native_apis(client: openai.OpenAI, server: str, top: int):
    text, native = native_logprobs(server, top)
    assert len(native) == TOKENS
    out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=TOKENS, temperature=0, logprobs=top)
    [choice] = out.choices
    assert choice.text == text and choice.finish_reason == "length"
    check_against_native(choice.logprobs, text, native, top)


def test_streamed_chunks_carry_their_tokens_logprobs(client: openai.OpenAI, server: str):
    text, native = native_logprobs(server, 2)
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                            logprobs=2, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].logprobs is None
    pieces = [c.choices[0] for c in chunks[:-1]]
    assert all(p.logprobs is not None and "".join(p.logprobs.tokens) == p.text for p in pieces)
    assert pieces[0].logprobs.text_offset[0] == 0

    class Joined:  # the chunks' lists end to end, checked as one answer
        tokens = [t for p in pieces for t in p.logprobs.tokens]
        token_logprobs = [v for p in pieces for v in p.logprobs.token_logprobs]
        top_logprobs = [d for p in pieces for d in p.logprobs.top_logprobs]
        text_offset = [o for p in pieces for o in p.logprobs.text_offset]

    check_against_native(Joined, text, native, 2)
    assert "".join(p.text for p in pieces) == text


def test_no_logprobs_unless_asked(client: openai.OpenAI):
    out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].logprobs is None
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0, stream=True))
    assert all(c.choices[0].logprobs is None for c in chunks)


@pytest.mark.parametrize(("value", "message"), [
    (6, "Invalid 'logprobs': integer above maximum value. Expected a value <= 5, but got 6 instead."),
    (21, "Invalid 'logprobs': integer above maximum value. Expected a value <= 5, but got 21 instead."),
    (-1, "Invalid 'logprobs': integer below minimum value. Expected a value >= 0, but got -1 instead."),
    (True, "Invalid type for 'logprobs': expected an integer, but got a boolean instead."),
    ("2", "Invalid type for 'logprobs': expected an integer, but got a string instead."),
    (2.5, "Invalid type for 'logprobs': expected an integer, but got a decimal number instead."),
])
def test_bad_logprobs_are_a_400_in_openais_shape(client: openai.OpenAI, server: str, value: Any, message: str):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, logprobs=value)
    assert err.value.body == {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    streamed = httpx.post(server + "/v1/completions", json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 2,
                                                             "logprobs": value, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["message"] == message
