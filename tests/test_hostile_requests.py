"""Issue 38 items 6 and 11: request fields that broke serve for every client or answered 500: keep_alive past
Go's longest duration, numbers beyond float64 in options, every numeric option at its extremes, and a format
schema that can match nothing.

Rerun: .venv/bin/python -m pytest -q tests/test_hostile_requests.py
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from datetime import datetime

import assets
import httpx
import pytest
from serve_process import serve_process

from ollama_engine.api.native import ApiError, parse_keep_alive, split_options
from ollama_engine.envconfig import MAX_DURATION, DurationError, EnvConfig, keep_alive_seconds, parse_duration

FEW = {"num_predict": 2, "temperature": 0}
HUGE_INT = "1" + "0" * 400  # 10^400 as a JSON integer literal: Python reads it, a float64 cannot hold it


# ------------------------------------------------------------------------------------------ keep_alive (unit)


@pytest.mark.parametrize("value", [1e30, 1e12, MAX_DURATION, 10**400, -(10**400), -1, -1e30])
def test_keep_alive_past_gos_longest_duration_is_forever(value: float) -> None:
    assert parse_keep_alive(value) == math.inf


def test_keep_alive_within_range_is_kept() -> None:
    assert parse_keep_alive(0) == 0 and parse_keep_alive(300) == 300.0 and parse_keep_alive("5m") == 300.0
    assert parse_keep_alive("2562047h") == 2562047 * 3600.0  # just under Go's limit


@pytest.mark.parametrize("text", ["99999999999h", "2562048h", "9223372037s", "-99999999999h"])
def test_durations_that_overflow_go_are_refused_as_go_does(text: str) -> None:
    with pytest.raises(DurationError, match=f'time: invalid duration "{text}"'):
        parse_duration(text)
    with pytest.raises(ApiError) as caught:
        parse_keep_alive(text)
    assert caught.value.status == 400


def test_ollama_keep_alive_variable_past_the_limit() -> None:
    assert keep_alive_seconds(1e300) == math.inf
    assert EnvConfig.from_env({"OLLAMA_KEEP_ALIVE": "99999999999h"}).keep_alive == 300  # invalid: the default
    assert EnvConfig.from_env({"OLLAMA_KEEP_ALIVE": "99999999999999"}).keep_alive == math.inf


# ------------------------------------------------------------------------------------------ options (unit)


@pytest.mark.parametrize("key", ["temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "num_ctx",
                                 "seed", "top_k", "num_predict", "unknown_option"])
def test_numbers_beyond_float64_are_400(key: str) -> None:
    with pytest.raises(ApiError) as caught:
        split_options({key: 10**400})
    assert caught.value.status == 400 and key in str(caught.value) and "float64" in str(caught.value)


def test_num_predict_zero_is_bounded_like_minus_one() -> None:
    """num_predict 0 reached the runner as "no limit" and, with context shifting, generated for ever."""
    assert split_options({"num_predict": 0})[1]["num_predict"] == -1


# ------------------------------------------------------------------------------------------ serve


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    root = tmp_path_factory.mktemp("hostile-requests")
    with serve_process(root / "models") as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def model() -> str:
    return str(assets.stories())


def post(client: httpx.Client, path: str, text: str) -> httpx.Response:
    return client.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def assert_serving(client: httpx.Client) -> None:
    response = client.post("/api/generate", json={"model": model(), "prompt": "Once", "options": FEW,
                                                  "stream": False})
    assert response.status_code == 200, response.text
    assert client.get("/api/ps").status_code == 200


@pytest.mark.parametrize("keep_alive", ["1e30", "1e12", HUGE_INT, '"2562047h"'])
def test_huge_keep_alive_then_ps_answers(serve: httpx.Client, keep_alive: str) -> None:
    """Item 6: such a keep_alive was accepted, then every GET /api/ps answered 500 until the model unloaded."""
    body = f'{{"model": {json.dumps(model())}, "prompt": "Once", "options": {json.dumps(FEW)}, "stream": false, ' \
           f'"keep_alive": {keep_alive}}}'
    response = post(serve, "/api/generate", body)
    assert response.status_code == 200, response.text
    ps = serve.get("/api/ps")
    assert ps.status_code == 200, ps.text
    (row,) = [m for m in ps.json()["models"] if m["model"] == model()]
    years = (datetime.fromisoformat(row["expires_at"]).timestamp() - time.time()) / (365.25 * 86400)
    assert 290 < years < 293


def test_keep_alive_go_cannot_parse_is_400(serve: httpx.Client) -> None:
    response = serve.post("/api/generate", json={"model": model(), "prompt": "Once", "keep_alive": "99999999999h"})
    assert response.status_code == 400 and response.json() == {"error": 'time: invalid duration "99999999999h"'}
    assert serve.get("/api/ps").status_code == 200


@pytest.mark.parametrize("key", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("route", ["/api/generate", "/api/chat"])
def test_giant_integer_sampling_options_are_400(serve: httpx.Client, key: str, route: str) -> None:
    """Item 11: 10^400 as temperature / top_p / min_p reached the runner, which answered 500."""
    prompt = '"prompt": "Once"' if route == "/api/generate" else '"messages": [{"role": "user", "content": "Hi"}]'
    body = f'{{"model": {json.dumps(model())}, {prompt}, "stream": false, "options": {{"{key}": {HUGE_INT}}}}}'
    response = post(serve, route, body)
    assert response.status_code == 400, response.text
    assert key in response.json()["error"] and "float64" in response.json()["error"]
    assert_serving(serve)


NUMERIC_OPTIONS = ["num_predict", "num_keep", "top_k", "repeat_last_n", "seed", "temperature", "top_p", "min_p",
                   "typical_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "num_ctx", "num_batch",
                   "num_gpu", "main_gpu", "num_thread"]
EXTREMES = ["0", "-1", "-9223372036854775808", "9223372036854775807", "1e300", "-1e300", "0.5", HUGE_INT]


@pytest.mark.parametrize("key", NUMERIC_OPTIONS)
def test_every_numeric_option_at_its_extremes_is_answered(serve: httpx.Client, key: str) -> None:
    """Zero, negative, the int64 bounds, huge floats and a giant integer for every numeric option: a 200 or a
    400 with a reason, never a 500 (NaN and Infinity are not JSON: the decoder refuses them, as Go's)."""
    # unload first: the runner then loads with num_ctx 64, so an unbounded num_predict ends within 640 tokens
    assert serve.post("/api/generate", json={"model": model(), "keep_alive": 0}).status_code == 200
    for value in EXTREMES:
        options = {**FEW, "num_ctx": 64, key: None}
        body = json.dumps({"model": model(), "prompt": "Once", "stream": False, "options": options})
        body = body.replace('null', value)
        response = post(serve, "/api/generate", body)
        assert response.status_code in (200, 400), f"{key}={value[:20]}: {response.status_code} {response.text}"
        if response.status_code == 400:
            assert response.json()["error"]
    for value in ("NaN", "Infinity", "-Infinity", "1e400"):
        body = json.dumps({"model": model(), "prompt": "Once", "options": {key: None}}).replace("null", value)
        assert post(serve, "/api/generate", body).status_code == 400
    assert_serving(serve)


@pytest.mark.parametrize("route", ["/api/generate", "/api/chat", "/v1/chat/completions"])
def test_a_format_schema_that_refers_only_to_itself_is_400(serve: httpx.Client, route: str) -> None:
    """Item 11: format {"$ref": "#"} compiles but can match nothing: it was a 500 "grammar: NoExtensionBias"."""
    if route == "/v1/chat/completions":
        body = {"model": model(), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}
    else:
        body = {"model": model(), "stream": False, "options": FEW, "format": {"$ref": "#"},
                **({"prompt": "Once"} if route == "/api/generate" else {"messages": [{"role": "user",
                                                                                       "content": "Hi"}]})}
    response = serve.post(route, json=body)
    assert response.status_code == 400, response.text
    assert "format" in response.text or "schema" in response.text
    assert_serving(serve)


def test_an_ordinary_schema_still_works(serve: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    response = serve.post("/api/generate", json={"model": model(), "prompt": "Once", "stream": False,
                                                 "options": {"num_predict": 8, "temperature": 0}, "format": schema})
    assert response.status_code == 200, response.text
