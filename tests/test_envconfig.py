"""OLLAMA_* variables read with Ollama's defaults and parsing (envconfig/config.go), and Go durations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ollama_engine.envconfig import DurationError, EnvConfig, parse_duration


def test_defaults_are_ollamas():
    config = EnvConfig.from_env({})
    assert (config.host, config.port) == ("127.0.0.1", 11434)
    assert config.models == Path.home() / ".ollama" / "models"
    assert config.keep_alive == 300 and config.max_loaded_models == 0 and config.num_parallel == 1
    assert config.max_queue == 512 and config.load_timeout == 300 and config.context_length == 0
    assert config.flash_attention is None and config.kv_cache_type == "" and config.gpu_overhead == 0
    assert config.sched_spread is False


def test_values_and_their_parsing():
    config = EnvConfig.from_env({
        "OLLAMA_HOST": "http://0.0.0.0", "OLLAMA_MODELS": "/srv/models", "OLLAMA_KEEP_ALIVE": "-1",
        "OLLAMA_MAX_LOADED_MODELS": "2", "OLLAMA_NUM_PARALLEL": "0", "OLLAMA_MAX_QUEUE": "'7'",
        "OLLAMA_LOAD_TIMEOUT": "0", "OLLAMA_CONTEXT_LENGTH": "8192", "OLLAMA_FLASH_ATTENTION": "false",
        "OLLAMA_KV_CACHE_TYPE": "Q8_0", "OLLAMA_GPU_OVERHEAD": "1024", "OLLAMA_SCHED_SPREAD": "1",
    })
    assert (config.host, config.port) == ("0.0.0.0", 80)  # a scheme without a port means its port
    assert config.models == Path("/srv/models") and config.keep_alive == math.inf
    assert config.max_loaded_models == 2 and config.num_parallel == 1 and config.max_queue == 7
    assert config.load_timeout == math.inf and config.context_length == 8192
    assert config.flash_attention is False and config.kv_cache_type == "q8_0"
    assert config.gpu_overhead == 1024 and config.sched_spread is True
    assert EnvConfig.from_env({"OLLAMA_HOST": "example:1234"}).base_url == "http://example:1234"
    assert EnvConfig.from_env({"OLLAMA_KEEP_ALIVE": "90"}).keep_alive == 90  # plain seconds
    assert EnvConfig.from_env({"OLLAMA_KEEP_ALIVE": "1h30m"}).keep_alive == 5400
    assert EnvConfig.from_env({"OLLAMA_MAX_QUEUE": "lots"}).max_queue == 512  # bad: warn, default


@pytest.mark.parametrize("text, seconds", [
    ("0", 0), ("5m", 300), ("1h30m", 5400), ("-1m", -60), ("1.5s", 1.5), ("300ms", 0.3), ("2h45m30.5s", 9930.5),
])
def test_go_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text, message", [
    ("5", 'time: missing unit in duration "5"'), ("", 'time: invalid duration ""'),
    ("5x", 'time: invalid duration "5x"'), ("m", 'time: invalid duration "m"'),
])
def test_bad_durations(text, message):
    with pytest.raises(DurationError, match=message):
        parse_duration(text)
