"""serve's GET /metrics on real weights: scraped during and after streamed chats through the official `ollama`
client, parsed with prometheus_client's own parser, and checked against what the responses themselves report.

OLLAMA_MAX_LOADED_MODELS=1, so asking for a second model must evict the first, and the eviction's reason shows.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_process import serve_process

httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")
parser = pytest.importorskip("prometheus_client.parser")

OPTIONS = {"num_predict": 40, "temperature": 0, "seed": 1}
SHORT = {"num_predict": 4, "temperature": 0}  # where only the load matters

# Long enough (over 64 tokens) that the first turn's prompt is evaluated as the second turn's is (the tiled
# attention kernel): exact reuse (runner/exact.py) then may reuse it from the cache.
SYSTEM = ("You are a patient assistant in a small museum of light and colour. Visitors ask about rainbows, prisms, "
          "paint, dyes and the way eyes see. Answer in plain words, briefly, and never invent facts. When a visitor "
          "asks for a poem, keep it to four short lines. When a visitor asks for a list, give it without numbers.")

Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("metrics")
    with serve_process(root / "models", OLLAMA_MAX_LOADED_MODELS="1", OLLAMA_NUM_PARALLEL="1") as url:
        yield url


def scrape(url: str) -> Samples:
    response = httpx.get(url + "/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples: Samples = {}
    for family in parser.text_string_to_metric_families(response.text):
        assert family.name.startswith("ollama_engine_"), family.name
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def stream_chat(url: str, model: str, messages: list[dict], during=None, options=OPTIONS) -> tuple[str, dict]:
    """A streamed chat; `during(chunk_index)` runs between chunks. Returns the text and the final chunk."""
    client = ollama.Client(host=url, timeout=600)
    text, final = [], None
    for i, chunk in enumerate(client.chat(model=model, messages=messages, stream=True, options=options)):
        if chunk.done:
            final = chunk
        else:
            text.append(chunk.message.content)
            if during is not None:
                during(i)
    assert final is not None
    return "".join(text), final.model_dump()


def test_a_streamed_chat_moves_the_counters(server, smollm2_path: Path):
    model = str(smollm2_path)
    before = scrape(server)
    mid: list[Samples] = []
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a short poem about the "
                                                                            "colours of the rainbow."}]
    reply, final = stream_chat(server, model, messages, lambda i: mid.append(scrape(server)) if i in (0, 3) else None)

    # mid-stream: the first chunk has been timed, the request holds the model's slot; tokens count at the end
    first, later = mid
    assert delta(before, first, "ollama_engine_time_to_first_token_seconds_count", model=model) == 1
    assert value(first, "ollama_engine_requests_in_flight", model=model) == 1
    assert value(first, "ollama_engine_model_state", model=model, state="busy") == 1
    assert value(first, "ollama_engine_loaded_models") == 1
    assert delta(before, first, "ollama_engine_generated_tokens_total", model=model) == 0
    # serve timed chunks 1..3 before the client could see chunk 3
    assert delta(before, later, "ollama_engine_inter_token_latency_seconds_count", model=model) >= 3

    after = scrape(server)
    assert delta(before, after, "ollama_engine_generated_tokens_total", model=model) == final["eval_count"]
    assert delta(before, after, "ollama_engine_prompt_tokens_total", model=model) == final["prompt_eval_count"]
    assert delta(before, after, "ollama_engine_prompt_cache_hit_tokens_total", model=model) == 0  # a cold prompt
    ttft = delta(before, after, "ollama_engine_time_to_first_token_seconds_sum", model=model)
    assert 0 < ttft < final["total_duration"] / 1e9
    itl = delta(before, after, "ollama_engine_inter_token_latency_seconds_count", model=model)
    assert 3 <= itl <= final["eval_count"] - 1
    assert delta(before, after, "ollama_engine_http_requests_total", method="POST", route="/api/chat",
                 status="200") == 1
    assert value(after, "ollama_engine_requests_in_flight", model=model) == 0
    assert value(after, "ollama_engine_model_state", model=model, state="idle") == 1

    # the second turn starts with the first turn's prompt and reply: the runner reuses them from its cache
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And two more?"}]
    _, final2 = stream_chat(server, model, messages)
    second = scrape(server)
    hits = delta(after, second, "ollama_engine_prompt_cache_hit_tokens_total", model=model)
    assert final["prompt_eval_count"] // 2 <= hits < final2["prompt_eval_count"]
    assert delta(after, second, "ollama_engine_prompt_tokens_total", model=model) == final2["prompt_eval_count"]
    assert delta(after, second, "ollama_engine_time_to_first_token_seconds_count", model=model) == 1


def test_the_memory_gauges_are_the_runners_report(server, smollm2_path: Path):
    model = str(smollm2_path)
    stream_chat(server, model, [{"role": "user", "content": "Hi"}], options=SHORT)
    samples = scrape(server)
    status = httpx.get(server + "/api/status", timeout=30).json()
    (loaded,) = [m for m in status["models"] if m["name"] == model]
    report = loaded["memory"]
    cpu = report["CPU"]
    assert value(samples, "ollama_engine_model_memory_bytes", model=model, device="CPU", kind="weights") == \
        report["InputWeights"] + sum(cpu["Weights"])
    assert value(samples, "ollama_engine_model_memory_bytes", model=model, device="CPU", kind="kv_cache") == \
        sum(cpu["Cache"]) > 0
    assert value(samples, "ollama_engine_model_memory_bytes", model=model, device="CPU", kind="graph") == \
        cpu["Graph"] > 0
    (ps,) = [m for m in httpx.get(server + "/api/ps").json()["models"] if m["name"] == model]
    total = sum(v for (name, labels), v in samples.items()
                if name == "ollama_engine_model_memory_bytes" and ("model", model) in labels)
    assert total == ps["size"]


def test_a_second_model_evicts_the_first_and_says_why(server, smollm2_path: Path, gemma3_path: Path):
    first, second = str(smollm2_path), str(gemma3_path)
    stream_chat(server, first, [{"role": "user", "content": "Hello"}], options=SHORT)
    before = scrape(server)
    stream_chat(server, second, [{"role": "user", "content": "Hello"}], options=SHORT)
    after = scrape(server)
    assert delta(before, after, "ollama_engine_model_unloads_total", model=first, reason="max_loaded_models") == 1
    assert delta(before, after, "ollama_engine_model_loads_total", model=second, outcome="ok") == 1
    assert delta(before, after, "ollama_engine_model_load_duration_seconds_count", model=second) == 1
    assert delta(before, after, "ollama_engine_model_load_duration_seconds_sum", model=second) > 0
    assert value(after, "ollama_engine_loaded_models") == 1
    assert value(after, "ollama_engine_model_state", model=second, state="idle") == 1
    assert ("ollama_engine_model_state", frozenset({("model", first), ("state", "idle")})) not in after
    assert value(after, "ollama_engine_runner_crashes_total", model=first) == 0


def test_a_stop_is_counted_as_one(server, smollm2_path: Path):
    model = str(smollm2_path)
    stream_chat(server, model, [{"role": "user", "content": "Hello"}], options=SHORT)
    before = scrape(server)
    assert httpx.post(server + "/api/stop", json={"model": model}).json()["stopped"] is True
    after = before
    for _ in range(200):  # the unload completes shortly after the answer
        after = scrape(server)
        if value(after, "ollama_engine_loaded_models") == 0:
            break
        time.sleep(0.05)
    assert delta(before, after, "ollama_engine_model_unloads_total", model=model, reason="stop") == 1
    assert value(after, "ollama_engine_loaded_models") == 0


def test_speculative_decoding_reports_its_drafts(server, smollm2_path: Path):
    model = str(smollm2_path)
    before = scrape(server)
    assert ("ollama_engine_speculative_draft_tokens_total", frozenset({("model", model)})) not in before, \
        "no request so far asked for speculation"
    text = ("The lighthouse stood on a rock at the mouth of the bay. Every night the keeper climbed the hundred "
            "steps, trimmed the wick and watched the beam sweep across the water.")
    stream_chat(server, model, [{"role": "user", "content": f"Copy this text exactly:\n{text}"}],
                options={"num_predict": 40, "temperature": 0, "spec_ngram": True})
    after = scrape(server)
    drafted = value(after, "ollama_engine_speculative_draft_tokens_total", model=model)
    accepted = value(after, "ollama_engine_speculative_accepted_tokens_total", model=model)
    assert ("ollama_engine_speculative_draft_tokens_total", frozenset({("model", model)})) in after
    assert 0 <= accepted <= drafted  # how much it drafts is the runner's choice (it adapts to the machine)


def test_unknown_routes_count_under_one_label(server):
    before = scrape(server)
    for path in ("/no/such/route", "/another/one"):
        assert httpx.get(server + path).status_code == 404
    after = scrape(server)
    assert delta(before, after, "ollama_engine_http_requests_total", method="GET", route="unmatched",
                 status="404") == 2
    assert not any("/no/such" in str(labels) for _, labels in after)
