"""The OpenAI-compatible routes, driven by the official `openai` client against a real `serve` subprocess,
and the chat-stream translation (tool calls, thinking) on recorded runner lines."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_process import serve_process

openai = pytest.importorskip("openai")

from synthetic.models import write_synthetic  # noqa: E402

from ollama_engine.api.chat import ChatRoutes, collect_chat  # noqa: E402
from ollama_engine.api.openai import OpenAIRoutes, native_messages  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path: Path) -> Iterator[str]:
    import ollama

    root = tmp_path_factory.mktemp("openai")
    bert = write_synthetic(root / "bert.gguf", "tiny-bert")
    with serve_process(root / "models") as url:
        client = ollama.Client(host=url)
        client.create(model="smollm2", files={"smollm2.gguf": client.create_blob(smollm2_path)})
        client.create(model="bert", files={"bert.gguf": client.create_blob(bert)})
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_chat_completion_streamed_and_not(client: openai.OpenAI):
    whole = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.system_fingerprint == "fp_ollama"
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 8 and whole.usage.total_tokens == whole.usage.prompt_tokens + 8

    chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert len({c.created for c in chunks}) == 1
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content


def test_response_format_is_accepted(client: openai.OpenAI):
    out = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2, temperature=0,
                                         response_format={"type": "json_object"})
    assert out.choices[0].message.content is not None


def test_completions(client: openai.OpenAI):
    whole = client.completions.create(model="smollm2", prompt="Name a color.", max_tokens=6, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text and whole.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="smollm2", prompt="Name a color.", max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_embeddings_float_and_base64(client: openai.OpenAI):
    default = client.embeddings.create(model="bert", input=["hello world", "the sky"])  # base64 on the wire
    floats = client.embeddings.create(model="bert", input=["hello world", "the sky"], encoding_format="float")
    assert [d.index for d in default.data] == [0, 1]
    for a, b in zip(default.data, floats.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
        assert math.isclose(math.sqrt(sum(x * x for x in b.embedding)), 1.0, rel_tol=1e-4)
    assert floats.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="bert", input=[])


def test_models(client: openai.OpenAI):
    ids = {m.id: m for m in client.models.list()}
    assert ids["smollm2:latest"].owned_by == "library" and ids["smollm2:latest"].created > 0
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("missing")
    assert err.value.body["type"] == "not_found_error"


def test_errors_have_openai_shape(client: openai.OpenAI, server: str):
    import httpx

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="missing", messages=MESSAGES)
    assert err.value.body == {"message": "model 'missing' not found", "type": "not_found_error", "param": None,
                              "code": None}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smollm2", messages=[])
    assert bad.value.body["message"] == "[] is too short - 'messages'"
    response = httpx.post(server + "/v1/chat/completions", json={
        "model": "smollm2", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- translation, on recorded runner lines


def _lines(*pieces: str, reason: int = 0) -> list[dict]:
    """Runner /completion lines (the wire format) carrying `pieces`, then the final line."""
    lines = [{"content": p, "done": False, "done_reason": 0} for p in pieces]
    return lines + [{"content": "", "done": True, "done_reason": reason, "prompt_eval_count": 5,
                     "prompt_eval_duration": 1, "eval_count": len(pieces), "eval_duration": 1}]


async def _replay(lines: list[dict]):
    for line in lines:
        yield line


def _chat_chunks(tools, lines, think=None, entry_caps=("completion", "tools")) -> list[dict]:
    from types import SimpleNamespace

    from ollama_engine.api.completion import Job

    entry = SimpleNamespace(requested="m", capabilities=list(entry_caps))
    job = Job(entry, "", None, {}, None)  # type: ignore[arg-type]
    routes = ChatRoutes(None, None)  # type: ignore[arg-type]

    async def collect() -> list[dict]:
        return [c async for c in routes.chat_chunks(job, tools, think, source=_replay(lines))]

    return asyncio.run(collect())


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_tool_calls_parsed_into_message_tool_calls():
    chunks = _chat_chunks(TOOLS, _lines("<tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
                                        "</tool_call>"))
    final = collect_chat(chunks)
    [call] = final["message"]["tool_calls"]
    assert call["function"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}
    assert call["id"].startswith("call_") and len(call["id"]) == 13
    assert final["message"]["content"] == "" and final["done_reason"] == "stop"

    routes = OpenAIRoutes(None, None)  # type: ignore[arg-type]

    async def events() -> list[dict]:
        return [e async for e in routes._chat_events(_replay(chunks), "chatcmpl-1", 1, "m", True)]

    out = asyncio.run(events())
    assert out[0]["choices"][0]["delta"]["role"] == "assistant"
    [tool_call] = out[0]["choices"][0]["delta"]["tool_calls"]
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"} and tool_call["type"] == "function"
    assert out[-2]["choices"][0]["finish_reason"] == "tool_calls" and out[-1]["usage"]["total_tokens"] == 9


def test_plain_text_with_tools_stays_content():
    final = collect_chat(_chat_chunks(TOOLS, _lines("It is ", "sunny.")))
    assert final["message"] == {"role": "assistant", "content": "It is sunny."}


def test_thinking_split_from_content():
    chunks = _chat_chunks(None, _lines("<think>", "let me see", "</think>", "Paris."), think=True,
                          entry_caps=("completion", "thinking"))
    final = collect_chat(chunks)
    assert final["message"]["thinking"] == "let me see" and final["message"]["content"] == "Paris."


def test_openai_messages_translation():
    out = native_messages([
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ])
    assert out[0] == {"role": "user", "content": "hi"} and out[1]["images"] == ["AAAA"]
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert out[3]["tool_name"] == "f" and out[3]["tool_call_id"] == "call_1"


def test_streamed_tool_calls_have_an_index_each_and_parallel_false_keeps_one():
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    chunks = _chat_chunks(tools, _lines('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',
                                        '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'))
    routes = OpenAIRoutes(None, None)  # type: ignore[arg-type]

    async def events(max_calls: int | None) -> list[dict]:
        return [e async for e in routes._chat_events(_replay(chunks), "chatcmpl-1", 1, "m", False, max_calls)]

    calls = [c for e in asyncio.run(events(None)) for c in e["choices"][0]["delta"].get("tool_calls") or []]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert len({c["id"] for c in calls}) == 2
    out = asyncio.run(events(1))
    calls = [c for e in out for c in e["choices"][0]["delta"].get("tool_calls") or []]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_malformed_tool_calls_stay_content():
    for text in ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
                 '{"name": "get_weather", "arguments": "not json"}', '{"name": "unknown_tool", "arguments": {}}',
                 '[{"name": "get_weather"}, 5]'):
        final = collect_chat(_chat_chunks(TOOLS, _lines(text)))
        assert "tool_calls" not in final["message"] and final["message"]["content"] == text
