"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens), driven by the official `anthropic`
SDK against a real `serve` subprocess on the real SmolLM2-135M-Instruct weights."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import serve_process

anthropic = pytest.importorskip("anthropic")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# SmolLM2's ChatML with Ollama's Go-template variables for tools and thinking: `.Think` opens <think> in the
# prompt (as DeepSeek-R1's template does), so a model that never learnt to think still has a thinking part.
TOOLS_TEMPLATE = """{{- if .Tools }}<|im_start|>system
You can call these tools. To call one, answer with JSON {"name": ..., "arguments": ...}.
{{ range .Tools }}{{ json .Function }}
{{ end }}<|im_end|>
{{ end }}
{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ json .Function.Arguments }}}\
{{ end }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ if .Think }}<think>
{{ end }}"""
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string"},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"]}}
TIME = {"name": "get_time", "description": "The local time in a timezone.",
        "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path: Path) -> Iterator[str]:
    import ollama

    root = tmp_path_factory.mktemp("anthropic")
    with serve_process(root / "models") as url:
        client = ollama.Client(host=url)
        blob = client.create_blob(smollm2_path)
        client.create(model="smollm2", files={"smollm2.gguf": blob})
        client.create(model="smol-tools", files={"smollm2.gguf": blob}, template=TOOLS_TEMPLATE)
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


def greedy(model: str = "smollm2", **kwargs: Any) -> dict[str, Any]:
    """Temperature 0 (this SDK no longer takes sampling parameters as arguments: they go in the body)."""
    return {"model": model, "extra_body": {"temperature": 0}, **kwargs}


def runs(names: list[str]) -> list[str]:
    """The names with each run of repeats counted once."""
    return [name for name, _ in itertools.groupby(names)]


def test_message_and_stream(client: anthropic.Anthropic, server: str):
    whole = client.messages.create(**greedy(messages=QUESTION, max_tokens=8))
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == "smollm2"
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 8 and whole.usage.input_tokens > 0

    # on the wire (the SDK drops pings): Anthropic's order, each event named as its data's type
    with httpx.stream("POST", server + "/v1/messages", timeout=120, json={
            **greedy(messages=QUESTION, max_tokens=8, stream=True)["extra_body"],
            "model": "smollm2", "messages": QUESTION, "max_tokens": 8, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        wire = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in wire[0::2]]
    assert [json.loads(line.removeprefix("data: "))["type"] for line in wire[1::2]] == names
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}

    events = list(client.messages.create(**greedy(messages=QUESTION, max_tokens=8), stream=True))
    # as many deltas as lines the runner sent: the stream interval groups tokens by time
    assert runs([e.type for e in events]) == runs([n for n in names if n != "ping"])
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert events[1].content_block.type == "text" and events[1].index == 0
    assert "".join(e.delta.text for e in events[2:-3]) == block.text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 8

    with client.messages.stream(**greedy(messages=QUESTION, max_tokens=8)) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == block.text and final.stop_reason == "max_tokens"


def test_end_turn(client: anthropic.Anthropic):
    out = client.messages.create(**greedy(messages=[{"role": "user", "content": "Say hello."}], max_tokens=200))
    assert out.stop_reason == "end_turn" and 0 < out.usage.output_tokens < 200


def test_greedy_text_equals_api_chat(client: anthropic.Anthropic, server: str):
    """The same conversation (system, a finished turn, a question) through /v1/messages and /api/chat."""
    system = "You are a geography teacher. Answer in one sentence."
    turns = [{"role": "user", "content": "Name a large river."},
             {"role": "assistant", "content": "The Nile is a large river."},
             {"role": "user", "content": [{"type": "text", "text": "Which country is it in?"}]}]
    out = client.messages.create(**greedy(system=system, messages=turns, max_tokens=24))
    native = httpx.post(server + "/api/chat", timeout=120, json={
        "model": "smollm2", "stream": False, "options": {"temperature": 0, "num_predict": 24},
        "messages": [{"role": "system", "content": system}, turns[0], turns[1],
                     {"role": "user", "content": "Which country is it in?"}]}).json()
    assert out.content[0].text == native["message"]["content"]
    assert out.usage.input_tokens == native["prompt_eval_count"]
    assert out.usage.output_tokens == native["eval_count"]
    # the system prompt reaches the model (as blocks too) and changes the prompt
    blocks = client.messages.create(**greedy(system=[{"type": "text", "text": system}], messages=turns,
                                             max_tokens=24))
    assert blocks.content[0].text == out.content[0].text
    plain = client.messages.create(**greedy(messages=turns, max_tokens=24))
    assert plain.usage.input_tokens != out.usage.input_tokens


def test_assistant_prefill_is_continued(client: anthropic.Anthropic, server: str):
    """A final assistant message is continued (Anthropic's prefill): the same text as a raw generation
    from SmolLM2's rendered prompt with the prefill after the opened assistant turn."""
    prefill = "The capital of France is"
    messages = QUESTION + [{"role": "assistant", "content": prefill}]
    out = client.messages.create(**greedy(messages=messages, max_tokens=8))
    prompt = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
              "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n" + prefill)
    raw = httpx.post(server + "/api/generate", timeout=120, json={
        "model": "smollm2", "prompt": prompt, "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": 8}}).json()
    assert out.content[0].text == raw["response"] and out.usage.input_tokens == raw["prompt_eval_count"]
    assert client.messages.count_tokens(model="smollm2", messages=messages).input_tokens == raw["prompt_eval_count"]


def test_stop_sequences(client: anthropic.Anthropic):
    free = client.messages.create(**greedy(messages=QUESTION, max_tokens=24)).content[0].text
    words = free.split()
    assert len(words) > 4, free
    stop = " " + words[3]
    cut = free[: free.index(stop)]
    out = client.messages.create(**greedy(messages=QUESTION, max_tokens=24, stop_sequences=["never seen", stop]))
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == cut
    assert 0 < out.usage.output_tokens < 24
    # the cut counts the generated tokens exactly: as many with max_tokens end the same text
    short = client.messages.create(**greedy(messages=QUESTION, max_tokens=out.usage.output_tokens))
    assert short.content[0].text.startswith(cut) and stop.startswith(short.content[0].text[len(cut):][:len(stop)])

    events = list(client.messages.create(**greedy(messages=QUESTION, max_tokens=24, stop_sequences=[stop]),
                                         stream=True))
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == cut
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "stop_sequence" and delta.delta.stop_sequence == stop
    # not found: the ordinary end, nothing held back
    out = client.messages.create(**greedy(messages=QUESTION, max_tokens=24, stop_sequences=["zzqx"]))
    assert out.content[0].text == free and out.stop_reason == "max_tokens" and out.usage.output_tokens == 24


def valid_weather(arguments: dict[str, Any]) -> bool:
    """WEATHER's input_schema, checked by hand: exactly its two properties, a string and one of the enum."""
    return (set(arguments) == {"city", "unit"} and isinstance(arguments["city"], str)
            and arguments["unit"] in ("celsius", "fahrenheit"))


def test_forced_tool_use(client: anthropic.Anthropic):
    ask = [{"role": "user", "content": "Is it warm in Paris today?"}]
    for _ in range(5):  # temperature 1: every sample is a valid call, by construction
        out = client.messages.create(model="smol-tools", messages=ask, max_tokens=64, extra_body={"temperature": 1},
                                     tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_weather"})
        calls = [b for b in out.content if b.type == "tool_use"]
        assert out.stop_reason == "tool_use" and len(calls) == 1, out
        assert calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
        assert valid_weather(calls[0].input), calls[0].input

    with client.messages.stream(**greedy("smol-tools", messages=ask, max_tokens=64, tools=[TIME]),
                                tool_choice={"type": "any"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    [call] = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "get_time" and isinstance(call.input.get("timezone"), str)
    assert final.stop_reason == "tool_use"

    # the result goes back as a tool_result block; tool_choice none: no tools, no call
    follow = ask + [{"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                       "input": call.input}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": [{"type": "text", "text": "14:00"}]}]}]
    out = client.messages.create(**greedy("smol-tools", messages=follow, max_tokens=16, tools=[TIME],
                                          tool_choice={"type": "none"}))
    assert out.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in out.content)


def test_count_tokens(client: anthropic.Anthropic):
    request = {"model": "smol-tools", "system": "Be brief.", "tools": [WEATHER], "messages": QUESTION}
    counted = client.messages.count_tokens(**request)
    out = client.messages.create(**greedy(**request, max_tokens=4))
    assert counted.input_tokens == out.usage.input_tokens > 0
    assert client.messages.count_tokens(model="smol-tools", messages=QUESTION).input_tokens < counted.input_tokens


def test_thinking_budget_enforced(client: anthropic.Anthropic, server: str):
    """8 tokens of thinking (the template opens <think>; SmolLM2 never closes it), then </think> and the
    answer: both parts equal raw greedy generations of the same prompts."""
    out = client.messages.create(**greedy("smol-tools", messages=QUESTION, max_tokens=24,
                                          thinking={"type": "enabled", "budget_tokens": 8}))
    kinds = [b.type for b in out.content]
    assert kinds == ["thinking", "text"], out
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n<think>\n"

    def raw(text: str, n: int) -> dict[str, Any]:
        return httpx.post(server + "/api/generate", timeout=120, json={
            "model": "smol-tools", "prompt": text, "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": n}}).json()

    thought = raw(prompt, 8)
    assert thought["eval_count"] == 8 and out.content[0].thinking == thought["response"].lstrip("\n")
    close = ("" if thought["response"].endswith("\n") else "\n") + "</think>\n\n"
    answer = raw(prompt + thought["response"] + close, 16)
    assert out.content[1].text == answer["response"]
    assert out.usage.output_tokens == 8 + answer["eval_count"]

    events = list(client.messages.create(**greedy("smol-tools", messages=QUESTION, max_tokens=24,
                                                  thinking={"type": "enabled", "budget_tokens": 8}), stream=True))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert "".join(e.delta.thinking for e in events
                   if e.type == "content_block_delta" and e.delta.type == "thinking_delta") == out.content[0].thinking


def error_of(excinfo: pytest.ExceptionInfo) -> dict[str, Any]:
    body = excinfo.value.body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def test_errors_have_anthropic_shape(client: anthropic.Anthropic, server: str):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="missing", messages=QUESTION, max_tokens=8)
    assert error_of(missing) == {"type": "not_found_error", "message": "model 'missing' not found"}

    with pytest.raises(anthropic.BadRequestError) as no_max:
        client.post("/v1/messages", cast_to=object, body={"model": "smollm2", "messages": QUESTION})
    assert error_of(no_max) == {"type": "invalid_request_error", "message": "max_tokens: Field required"}

    for messages in ([], [{"role": "system", "content": "x"}], [{"content": "hi"}], [{"role": "user", "content": 3}],
                     [{"role": "user", "content": [{"type": "video"}]}], "hi"):
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(model="smollm2", messages=messages, max_tokens=8)
        assert error_of(bad)["type"] == "invalid_request_error", messages

    with pytest.raises(anthropic.BadRequestError) as no_tool:
        client.messages.create(model="smol-tools", messages=QUESTION, max_tokens=8, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    assert "nope" in error_of(no_tool)["message"]
    with pytest.raises(anthropic.BadRequestError) as budget:
        client.messages.create(model="smol-tools", messages=QUESTION, max_tokens=8,
                               thinking={"type": "enabled", "budget_tokens": 8})
    assert "budget_tokens" in error_of(budget)["message"]
    with pytest.raises(anthropic.BadRequestError) as cannot_think:
        client.messages.create(model="smollm2", messages=QUESTION, max_tokens=16,
                               thinking={"type": "enabled", "budget_tokens": 8})
    assert "does not support thinking" in error_of(cannot_think)["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="missing", messages=QUESTION)
    response = httpx.post(server + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- translation, on recorded lines


def _lines(*pieces: str, tokens_per_piece: int = 1) -> list[dict[str, Any]]:
    """Runner lines carrying `pieces` (each with one logprob entry per token), then the final line."""
    def entries(piece: str) -> list[dict[str, Any]]:
        size = max(len(piece) // tokens_per_piece, 1)
        return [{"token": piece[i:i + size], "logprob": -1.0} for i in range(0, len(piece), size)]

    lines = [{"content": p, "done": False, "logprobs": entries(p)} for p in pieces]
    return lines + [{"content": "", "done": True, "done_reason": 1, "prompt_eval_count": 5,
                     "prompt_eval_duration": 1, "eval_count": 99, "eval_duration": 1}]


def _cut(lines: list[dict[str, Any]], stops: list[str]) -> tuple[list[dict[str, Any]], str | None]:
    from ollama_engine.api.stop_sequences import Outcome, stopped_lines

    async def source():
        for line in lines:
            yield line

    async def run():
        outcome = Outcome()
        return [line async for line in stopped_lines(source(), stops, 7, outcome)], outcome.stop_sequence

    return asyncio.run(run())


def test_stop_sequence_across_lines_counts_tokens():
    out, stop = _cut(_lines("Hel", "lo wo", "rld"), ["o w"])
    assert stop == "o w" and "".join(line["content"] for line in out) == "Hell"
    assert out[-1]["done"] and out[-1]["done_reason"] == 0 and out[-1]["prompt_eval_count"] == 7
    assert out[-1]["eval_count"] == 2  # "Hel" and "lo wo": the token that completed the stop counts
    out, _ = _cut(_lines("ab", "cdef", tokens_per_piece=2), ["cd"])
    # tokens "a", "b", then "cd" of "cd", "ef": the cut counts 3, not the line's 4
    assert out[-1]["eval_count"] == 3 and "".join(line["content"] for line in out) == "ab"


def test_stop_sequences_hold_back_only_what_may_begin_one():
    out, stop = _cut(_lines("one t", "wo", " three"), ["two!", "three"])
    assert stop == "three" and [line["content"] for line in out[:-1]] == ["one ", "two "]
    out, stop = _cut(_lines("xy", "z"), ["yq"])
    assert stop is None and "".join(line["content"] for line in out) == "xyz" and out[-1]["eval_count"] == 99
    out, stop = _cut(_lines("a stop b", "x"), ["b", "stop"])
    assert stop == "stop" and out[0]["content"] == "a "  # the earliest in the text wins, not the first listed


def test_stream_blocks_on_recorded_chunks():
    from ollama_engine.api.anthropic import message_events
    from ollama_engine.api.stop_sequences import Outcome

    chunks = [{"message": {"thinking": "hmm"}}, {"message": {"thinking": " ok"}}, {"message": {"content": "Hi"}},
              {"message": {"content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}},
              {"done": True, "done_reason": "stop", "prompt_eval_count": 3, "eval_count": 4}]

    async def source():
        for chunk in chunks:
            yield chunk

    async def run():
        return [e async for e in message_events(source(), "msg_1", "m", 3, Outcome())]

    events = asyncio.run(run())
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None), ("content_block_start", 0), ("ping", None), ("content_block_delta", 0),
        ("content_block_delta", 0), ("content_block_stop", 0), ("content_block_start", 1),
        ("content_block_delta", 1), ("content_block_stop", 1), ("content_block_start", 2),
        ("content_block_delta", 2), ("content_block_stop", 2), ("message_delta", None), ("message_stop", None)]
    assert events[10]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 3, "output_tokens": 4}
