"""POST /v1/responses and the completed chat completions (tool_choice enforced, logprobs, n, seed, the peer
suite's cases), driven by the official `openai` client against a real `serve` on real SmolLM2-135M-Instruct
weights. "smollm2-tools" is the same GGUF with a ChatML Go template that renders tools (its own template has
none)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import serve_process

openai = pytest.importorskip("openai")

from synthetic.models import write_synthetic  # noqa: E402

from ollama_engine.api.responses import ResponseStore  # noqa: E402

TOOLS_TEMPLATE = """{{- if or .System .Tools }}<|im_start|>system
{{ if .System }}{{ .System }}{{ else }}You are a helpful AI assistant named SmolLM, trained by Hugging Face{{ end }}
{{- if .Tools }}
To call a function, answer with a JSON object {"name": <function name>, "arguments": <arguments object>}.
Functions:
{{- range .Tools }}
{{ . }}
{{- end }}
{{- end }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ if .Content }}{{ .Content }}{{ else if .ToolCalls }}{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", \
"arguments": {{ .Function.Arguments }}}{{ end }}{{ end }}{{ if not $last }}<|im_end|>
{{ end }}
{{- else if eq .Role "tool" }}<|im_start|>user
Result of {{ .ToolName }}: {{ .Content }}<|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}"""

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"]}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                      "parameters": {"type": "object", "properties": {}}}},
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
ASK = "What is the weather in Paris?"


def valid_weather(arguments: Any) -> bool:
    """WEATHER's constraints, checked here independently of the grammar that enforced them."""
    import re

    if not isinstance(arguments, dict) or set(arguments) - {"city", "unit", "days"}:
        return False
    if not {"city", "unit"} <= set(arguments):
        return False
    if not isinstance(arguments["city"], str) or not re.fullmatch(r"[A-Z][a-z]{1,15}", arguments["city"]):
        return False
    if arguments["unit"] not in ("celsius", "fahrenheit"):
        return False
    days = arguments.get("days", 1)
    return isinstance(days, int) and not isinstance(days, bool) and 1 <= days <= 7


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path: Path) -> Iterator[str]:
    import ollama

    root = tmp_path_factory.mktemp("responses")
    with serve_process(root / "models", OLLAMA_NUM_PARALLEL="4") as url:  # 4 slots: the 50 calls run 4 at a time
        client = ollama.Client(host=url)
        blob = client.create_blob(smollm2_path)
        client.create(model="smollm2", files={"smollm2.gguf": blob})
        client.create(model="smollm2-tools", files={"smollm2.gguf": blob}, template=TOOLS_TEMPLATE)
        bert = write_synthetic(root / "bert.gguf", "tiny-bert")
        client.create(model="bert", files={"bert.gguf": client.create_blob(bert)})
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def post(server: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server + path, json=body, timeout=120)


# ---------------------------------------------------------------- /v1/responses


def test_response_text_equals_native_chat(client: openai.OpenAI, server: str):
    out = client.responses.create(model="smollm2", input=ASK, instructions="Answer briefly.", temperature=0,
                                  max_output_tokens=12)
    assert out.object == "response" and out.id.startswith("resp_") and out.status == "incomplete"
    assert out.incomplete_details.reason == "max_output_tokens"
    [item] = out.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert out.usage.output_tokens == 12 and out.usage.total_tokens == out.usage.input_tokens + 12
    native = post(server, "/api/chat", {"model": "smollm2", "stream": False, "options": {"temperature": 0,
                                                                                            "num_predict": 12},
                                        "messages": [{"role": "system", "content": "Answer briefly."},
                                                     {"role": "user", "content": ASK}]}).json()
    assert out.output_text == native["message"]["content"] and out.output_text
    assert out.usage.input_tokens == native["prompt_eval_count"]


def test_response_stream_events_in_order(client: openai.OpenAI):
    whole = client.responses.create(model="smollm2", input=ASK, temperature=0, max_output_tokens=10)
    events = list(client.responses.create(model="smollm2", input=ASK, temperature=0, max_output_tokens=10,
                                          stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == 10
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id


def test_function_call_then_output_with_previous_response_id(client: openai.OpenAI):
    first = client.responses.create(model="smollm2-tools", input=ASK, tools=RESPONSES_TOOLS, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and valid_weather(json.loads(call.arguments))
    assert first.status == "completed"
    second = client.responses.create(
        model="smollm2-tools", previous_response_id=first.id, temperature=0, max_output_tokens=16,
        tools=RESPONSES_TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sunny, 21 C"}'}])
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    # the stored conversation (first prompt, its call, the result) is in the prompt; the cache reused its start
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert 0 < second.usage.input_tokens_details.cached_tokens <= first.usage.input_tokens
    assert client.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="smollm2", input="hi", previous_response_id="resp_unknown")
    assert "resp_unknown" in err.value.body["message"]


def test_function_call_streamed(client: openai.OpenAI):
    events = list(client.responses.create(model="smollm2-tools", input=ASK, tools=RESPONSES_TOOLS, temperature=0,
                                          tool_choice="required", max_output_tokens=60, stream=True))
    kinds = [e.type for e in events]
    start = kinds.index("response.function_call_arguments.delta")
    assert kinds[start - 1:start + 3] == ["response.output_item.added", "response.function_call_arguments.delta",
                                          "response.function_call_arguments.done", "response.output_item.done"]
    done = events[start + 1]
    arguments = json.loads(done.arguments)
    assert done.name in ("get_weather", "get_time") and events[start].delta == done.arguments
    assert done.name == "get_time" or valid_weather(arguments)
    assert kinds[-1] == "response.completed"
    [call] = [i for i in events[-1].response.output if i.type == "function_call"]
    assert call.arguments == done.arguments


def test_response_json_schema_format(client: openai.OpenAI):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    out = client.responses.create(model="smollm2", input="What is the capital of France? Answer in JSON.",
                                  temperature=0, max_output_tokens=40,
                                  text={"format": {"type": "json_schema", "name": "capital", "schema": schema}})
    value = json.loads(out.output_text)
    assert set(value) == {"capital"} and isinstance(value["capital"], str)


def test_response_errors(client: openai.OpenAI, server: str):
    for body in ({"model": "smollm2", "input": []}, {"model": "smollm2", "input": [{"type": "web_search_call"}]},
                 {"model": "smollm2", "input": "hi", "text": {"format": {"type": "yaml"}}},
                 {"model": "smollm2", "input": "hi", "tools": [{"type": "web_search"}]},
                 {"model": "smollm2", "input": [{"role": 123, "content": "hi"}]},
                 {"model": "smollm2", "input": "hi", "max_output_tokens": 0}):
        response = post(server, "/v1/responses", body)
        assert response.status_code == 400, body
        assert response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="missing", input="hi")


def test_store_is_bounded_by_count_and_bytes():
    store = ResponseStore(max_responses=3, max_bytes=2000)
    for i in range(5):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.get("r2")  # most recently used now: r3 goes first
    store.put({"id": "big"}, [{"role": "user", "content": "y" * 1500}])
    assert store.get("r2") is not None and store.get("r3") is None and store.bytes <= 2000
    store.put({"id": "huge"}, [{"role": "user", "content": "z" * 5000}])  # larger than the store: not kept
    assert store.get("huge") is None and store.get("big") is not None


# ---------------------------------------------------------------- chat completions: tool_choice


def test_named_tool_choice_validates_50_of_50_at_temperature_1(client: openai.OpenAI):
    from concurrent.futures import ThreadPoolExecutor

    choice = {"type": "function", "function": {"name": "get_weather"}}

    def call(seed: int) -> tuple[list[Any], str | None]:
        out = client.chat.completions.create(model="smollm2-tools", messages=[{"role": "user", "content": ASK}],
                                             tools=CHAT_TOOLS, tool_choice=choice, temperature=1, seed=seed,
                                             max_tokens=64)
        return out.choices[0].message.tool_calls or [], out.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:  # batched by the runner's 4 slots
        results = list(pool.map(call, range(50)))
    valid = [len(calls) == 1 and calls[0].function.name == "get_weather" and reason == "tool_calls"
             and valid_weather(json.loads(calls[0].function.arguments)) for calls, reason in results]
    assert sum(valid) == 50, [r for r, ok in zip(results, valid, strict=True) if not ok][:3]


def test_tool_choice_none_and_required(client: openai.OpenAI):
    messages = [{"role": "user", "content": ASK}]
    plain = client.chat.completions.create(model="smollm2-tools", messages=messages, tools=CHAT_TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=10)
    no_tools = client.chat.completions.create(model="smollm2-tools", messages=messages, temperature=0,
                                              max_tokens=10)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == no_tools.choices[0].message.content  # tools not even rendered
    required = client.chat.completions.create(model="smollm2-tools", messages=messages, tools=CHAT_TOOLS,
                                              tool_choice="required", temperature=0, max_tokens=64)
    [call] = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and call.type == "function"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-tools", messages=messages, tools=CHAT_TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "missing"}})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2-tools", messages=messages, tool_choice="required")


def test_streamed_tool_call_has_index(client: openai.OpenAI):
    chunks = list(client.chat.completions.create(
        model="smollm2-tools", messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64, stream=True))
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert [call.index for call in calls] == [0] and calls[0].id.startswith("call_")
    assert valid_weather(json.loads(calls[0].function.arguments))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# ---------------------------------------------------------------- chat completions: the rest


def test_logprobs_and_top_logprobs(client: openai.OpenAI):
    out = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASK}],
                                         temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == 5 and "".join(e.token for e in entries) == out.choices[0].message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def test_seed_repeats_and_n_choices(client: openai.OpenAI):
    def run(seed: int, n: int = 1) -> list[str]:
        out = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Tell a story."}],
                                             temperature=1.5, seed=seed, max_tokens=12, n=n)
        assert [c.index for c in out.choices] == list(range(n))
        return [c.message.content for c in out.choices]

    assert run(7) == run(7)
    three = run(7, n=3)
    assert len(three) == 3 and three[0] == run(7)[0] and len(set(three)) > 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], n=2,
                                       stream=True)


def test_reasoning_effort(client: openai.OpenAI):
    out = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                         reasoning_effort="none", temperature=0, max_tokens=3)
    assert out.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:  # SmolLM2 cannot think: said, not ignored
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                       reasoning_effort="high", max_tokens=3)
    assert "thinking" in err.value.body["message"]


@pytest.mark.parametrize("body", [
    {"messages": [{}]}, {"messages": [{"role": 123, "content": "hi"}]}, {"messages": [{"content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
    {"messages": [{"role": "user", "content": "hi"}], "n": 0},
    {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes"},
    {"messages": [{"role": "assistant", "tool_calls": ["x"]}]},
], ids=["empty-message", "numeric-role", "no-role", "response-format-type", "max-tokens-0", "max-tokens-negative",
        "n-0", "tool-choice", "tool-call-not-object"])
def test_peer_suite_bad_requests_are_400(server: str, body: dict[str, Any]):
    response = post(server, "/v1/chat/completions", {"model": "smollm2", **body})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_completions_max_tokens_0_is_400(server: str):
    response = post(server, "/v1/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": 0})
    assert response.status_code == 400


def test_embeddings_accept_token_arrays(client: openai.OpenAI, server: str):
    tokens = [12, 34, 56]
    single = client.embeddings.create(model="bert", input=tokens, encoding_format="float")
    several = client.embeddings.create(model="bert", input=[tokens, [78, 90]], encoding_format="float")
    assert len(single.data) == 1 and [d.index for d in several.data] == [0, 1]
    assert single.data[0].embedding == pytest.approx(several.data[0].embedding, abs=1e-5)
    assert several.data[0].embedding != pytest.approx(several.data[1].embedding, abs=1e-3)
    bad = post(server, "/v1/embeddings", {"model": "bert", "input": [10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    assert post(server, "/v1/embeddings", {"model": "bert", "input": [[1], "x"]}).status_code == 400


def test_cached_tokens_reported_on_a_prompt_cache_hit(client: openai.OpenAI):
    messages = [{"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And a vegetable?"}]
    second = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=2)
    details = second.usage.prompt_tokens_details
    assert details is not None and 0 < details.cached_tokens < second.usage.prompt_tokens


def test_completions_report_cached_tokens_too(client: openai.OpenAI):
    """/v1/completions sends usage.prompt_tokens_details.cached_tokens as chat completions does, streamed or not."""
    prompt = "The lighthouse keeper counted the ships that passed"
    first = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=6)
    prompt += first.choices[0].text + " and"
    second = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=2)
    details = second.usage.prompt_tokens_details
    assert details is not None and 0 < details.cached_tokens < second.usage.prompt_tokens
    stream = client.completions.create(model="smollm2", prompt=prompt + " then", temperature=0, max_tokens=2,
                                       stream=True, stream_options={"include_usage": True})
    (streamed,) = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert streamed.prompt_tokens_details is not None
    assert 0 < streamed.prompt_tokens_details.cached_tokens < streamed.prompt_tokens


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, server: str, smollm2_path: Path):
    from ollama_engine.api.catalog import GGUFView

    tokenizer = GGUFView(smollm2_path).tokenizer
    messages = [{"role": "user", "content": ASK}]
    forced = tokenizer.encode(" banana", add_special=False)[0]
    out = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=3,
                                         logit_bias={str(forced): 100})
    assert out.choices[0].message.content == tokenizer.decode([forced]) * 3
    base = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=3,
                                          logprobs=True)
    first = base.choices[0].logprobs.content[0].token
    [first_id] = tokenizer.encode(first, add_special=False)
    banned = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=3,
                                            logprobs=True, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first
    # under a grammar: "banana" is refused where JSON syntax is due (the draw among allowed tokens keeps the
    # bias on the right ids) and chosen inside the string
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    constrained = client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=8, logit_bias={str(forced): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    content = constrained.choices[0].message.content
    assert content.startswith("{") and content.count("banana") >= 2
    for bad in ({"x": 1}, {"1": 101}, {"99999999": 1}):
        response = post(server, "/v1/chat/completions", {"model": "smollm2", "messages": messages, "logit_bias": bad})
        assert response.status_code == 400, bad


def test_sampler_logit_bias_on_the_whole_vocabulary_and_a_subset():
    import numpy as np

    from ollama_engine.sample import Sampler

    logits = np.array([0.0, 1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    greedy = Sampler(temperature=0, logit_bias={"1": 100, "9": 100})  # an id past the rows is ignored
    assert greedy.sample(logits) == 1
    assert greedy.sample(logits[[0, 1, 3]], np.array([0, 1, 3])) == 1  # a subset: the bias follows the ids
    assert greedy.sample(logits[[0, 3]], np.array([0, 3])) == 1  # id 1 absent: index 1 is id 3, the largest
    banned = Sampler.from_options({"temperature": 1.0, "seed": 3, "top_k": 0, "top_p": 1.0,
                                   "logit_bias": {"4": -100, "3": -100}})
    assert {banned.sample(logits) for _ in range(200)} == {0, 1, 2}
    assert logits.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]  # read, never modified
    with pytest.raises(TypeError):
        Sampler(logit_bias={"x": 1})
