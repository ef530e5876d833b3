"""Issue 31's native fields through a real `serve` on real SmolLM2 weights: `think` levels reach the template,
`truncate: false` refuses a prompt longer than the context, `shift: false` ends at a full context, and a tool
call the model writes wrong (arguments against the tool's schema, an unknown tool) is never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import serve_process

ollama = pytest.importorskip("ollama")

# ChatML with a reasoning line whose length says the level (one " x" more per level), so the level that reached
# the template shows in the prompt's token count.
THINK_TEMPLATE = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}{{ if .Think }}<|im_start|>system
Effort:{{ if eq .ThinkLevel "low" }} x{{ else if eq .ThinkLevel "medium" }} x x{{ else if eq .ThinkLevel "high" }}\
 x x x{{ else if eq .ThinkLevel "max" }} x x x x{{ end }}<|im_end|>
{{ end }}<|im_start|>assistant
"""
COUNT = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path: Path) -> Iterator[str]:
    from test_openai_responses import TOOLS_TEMPLATE

    root = tmp_path_factory.mktemp("think-truncate-shift")
    with serve_process(root / "models") as url:
        client = ollama.Client(host=url)
        blob = client.create_blob(smollm2_path)
        client.create(model="smollm2", files={"smollm2.gguf": blob})
        client.create(model="smollm2-think", files={"smollm2.gguf": blob}, template=THINK_TEMPLATE)
        client.create(model="smollm2-tools", files={"smollm2.gguf": blob}, template=TOOLS_TEMPLATE)
        yield url


def post(server: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server + path, json={"stream": False, **body}, timeout=300)


def unload(server: str) -> None:
    """A loaded runner serves any smaller num_ctx (the scheduler's choice): unload it, so that the next request
    loads one with its own num_ctx."""
    assert post(server, "/api/generate", {"model": "smollm2", "keep_alive": 0}).status_code == 200


def test_think_levels_reach_the_template(server: str):
    counts = {}
    for think in (False, "low", "medium", "high", "max", True):
        for path, body in (("/api/chat", {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/api/generate", {"prompt": "Hi"})):
            response = post(server, path, {"model": "smollm2-think", "think": think, **body,
                                           "options": {"num_predict": 1, "temperature": 0}})
            assert response.status_code == 200, response.text
            counts[path, think] = response.json()["prompt_eval_count"]
    for path in ("/api/chat", "/api/generate"):
        levels = [counts[path, level] for level in (False, "low", "medium", "high", "max")]
        assert levels == sorted(set(levels)) and levels[-1] - levels[1] == 3, counts
        assert counts[path, True] == counts[path, "medium"]  # Ollama: `true` is "medium" to a template
    bad = post(server, "/api/chat", {"model": "smollm2-think", "think": "extreme",
                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert bad.status_code == 400 and "invalid think value" in bad.json()["error"]
    no = post(server, "/api/chat", {"model": "smollm2", "think": "high",
                                    "messages": [{"role": "user", "content": "x"}]})
    assert no.status_code == 400 and "does not support thinking" in no.json()["error"]


def test_truncate_false_refuses_a_prompt_longer_than_the_context(server: str):
    prompt = " ".join(["word"] * 200)
    options = {"num_ctx": 64, "num_predict": 1, "temperature": 0}
    unload(server)
    for path, body in (("/api/generate", {"prompt": prompt, "raw": True}),
                       ("/api/chat", {"messages": [{"role": "user", "content": prompt}]})):
        refused = post(server, path, {"model": "smollm2", "truncate": False, "options": options, **body})
        assert refused.status_code == 400, refused.text
        assert "exceeds the context length" in refused.json()["error"]
        cut = post(server, path, {"model": "smollm2", "options": options, **body})
        assert cut.status_code == 200 and cut.json()["prompt_eval_count"] <= 64


def test_shift_false_stops_at_a_full_context_with_length(server: str):
    options = {"num_ctx": 64, "num_predict": 48, "temperature": 0}
    body = {"model": "smollm2", "prompt": COUNT, "raw": True, "options": options}
    unload(server)
    stopped = post(server, "/api/generate", {**body, "shift": False}).json()
    assert stopped["done_reason"] == "length"
    assert stopped["prompt_eval_count"] + stopped["eval_count"] <= 64 < stopped["prompt_eval_count"] + 48
    shifted = post(server, "/api/generate", body).json()
    assert (shifted["done_reason"], shifted["eval_count"]) == ("length", 48)  # went on past the full context


@pytest.mark.parametrize("call", [
    {"name": "get_weather", "arguments": {"city": 5, "unit": "kelvin"}},  # against the tool's schema
    {"name": "no_such_tool", "arguments": {}},
    {"name": "get_weather", "arguments": "city=Paris"},  # arguments not an object
])
def test_a_wrong_tool_call_is_never_a_500(server: str, call: dict[str, Any]):
    """The model is made to write exactly `call` (a `const` schema) with tools offered under `auto`."""
    from test_openai_responses import CHAT_TOOLS

    unload(server)  # the context of 64 the tests above loaded is too small for the tools' prompt
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    native = post(server, "/api/chat", {"model": "smollm2-tools", "messages": messages, "tools": CHAT_TOOLS,
                                        "format": {"const": call}, "options": {"num_predict": 60,
                                                                              "temperature": 0}})
    assert native.status_code == 200, native.text
    message = native.json()["message"]
    assert message.get("tool_calls") or message["content"]
    if call["name"] != "get_weather" or not isinstance(call["arguments"], dict):
        return  # the OpenAI layer parses the same way: one case through it is enough on 2 cores
    openai = post(server, "/v1/chat/completions", {
        "model": "smollm2-tools", "messages": messages, "tools": CHAT_TOOLS, "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "call", "schema": {"const": call}}}})
    assert openai.status_code == 200, openai.text
