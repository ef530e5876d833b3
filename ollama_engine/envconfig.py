"""Ollama's environment variables, read with Ollama's defaults (envconfig/config.go at f63eea3d).

`serve` reads them once at start-up into an EnvConfig; the scheduler and the API take that object, so tests
build one directly instead of patching the environment. Durations are float seconds (math.inf: forever).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434
DEFAULT_KEEP_ALIVE = 5 * 60.0
DEFAULT_MAX_QUEUE = 512
DEFAULT_LOAD_TIMEOUT = 5 * 60.0
DEFAULT_STREAM_INTERVAL = 0.033  # 30 lines a second at most per stream; each line wakes serve (bench/RESULTS.md)
MAX_STREAM_INTERVAL = 1.0

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


MAX_DURATION = (2**63 - 1) / 1e9  # seconds in Go's longest time.Duration (int64 nanoseconds: about 292 years)


class DurationError(ValueError):
    """Text that Go's time.ParseDuration rejects (the message is Go's)."""


def parse_duration(text: str) -> float:
    """Go's time.ParseDuration ("5m", "1h30m", "-1.5s", "0"), in seconds."""
    original, text = text, text.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("+-")
    if text == "0":
        return 0.0
    if not text:
        raise DurationError(f'time: invalid duration "{original}"')
    total, position = 0.0, 0
    while position < len(text):
        match = _PART.match(text, position)
        if match is None:
            if re.fullmatch(r"[\d.]+", text[position:]):
                raise DurationError(f'time: missing unit in duration "{original}"')
            raise DurationError(f'time: invalid duration "{original}"')
        total += float(match.group(1)) * _UNITS[match.group(2)]
        position = match.end()
        if total > MAX_DURATION:  # Go's ParseDuration refuses what overflows int64 nanoseconds
            raise DurationError(f'time: invalid duration "{original}"')
    return sign * total


def keep_alive_seconds(value: float) -> float:
    """Ollama's reading of a keep-alive: negative means forever, and so does anything at or past Go's longest
    duration (Ollama's `forever` is that duration), so no deadline is ever past what clocks can hold."""
    return float(value) if 0 <= value < MAX_DURATION else math.inf


def _var(env: Mapping[str, str], key: str) -> str:
    """Ollama's envconfig.Var: spaces and quotes trimmed."""
    return env.get(key, "").strip().strip("\"'").strip()


def _uint(env: Mapping[str, str], key: str, default: int) -> int:
    text = _var(env, key)
    if not text:
        return default
    try:
        value = int(text)
        if value < 0:
            raise ValueError(text)
        return value
    except ValueError:
        log.warning("invalid environment variable, using default key=%s value=%s default=%s", key, text, default)
        return default


def _bool(env: Mapping[str, str], key: str) -> bool | None:
    """Go's strconv.ParseBool; None when unset, and (as Ollama does) true for unparseable text."""
    text = _var(env, key)
    if not text:
        return None
    lowered = text.lower()
    if lowered in ("1", "t", "true"):
        return True
    if lowered in ("0", "f", "false"):
        return False
    return True


def _duration(env: Mapping[str, str], key: str, default: float) -> float:
    """A Go duration or an integer of seconds; negative is forever."""
    text = _var(env, key)
    if not text:
        return default
    try:
        value = parse_duration(text)
    except DurationError:
        try:
            value = float(int(text))
        except ValueError:
            log.warning("invalid environment variable, using default key=%s value=%s", key, text)
            return default
    return keep_alive_seconds(value)


def _host(env: Mapping[str, str]) -> tuple[str, int]:
    """OLLAMA_HOST: [scheme://]host[:port][/path]; http means port 80 and https 443 when none is given."""
    text = _var(env, "OLLAMA_HOST")
    if not text:
        return DEFAULT_HOST, DEFAULT_PORT
    scheme, _, rest = text.rpartition("://")
    default_port = {"http": 80, "https": 443}.get(scheme, DEFAULT_PORT)
    parts = urlsplit("//" + rest)
    try:
        port = parts.port or default_port
    except ValueError:
        log.warning("invalid port, using default port=%s default=%s", rest, default_port)
        port = default_port
    return parts.hostname or DEFAULT_HOST, port


# Set by the parent for a runner it spawns (llm/runner_handle.py), read by the runner (server/parent.py)
PARENT_PID_ENV = "OLLAMA_ENGINE_PARENT_PID"
PARENT_DEATH_SIGNAL_ENV = "OLLAMA_ENGINE_PARENT_DEATH_SIGNAL"


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def debug(env: Mapping[str, str] | None = None) -> bool:
    """OLLAMA_DEBUG: any value but empty, 0 or false turns on debug logs."""
    return _var(_env(env), "OLLAMA_DEBUG").lower() not in ("", "0", "false")


def models_dir(env: Mapping[str, str] | None = None) -> Path:
    """OLLAMA_MODELS, else ~/.ollama/models (Ollama's envconfig.Models)."""
    value = _var(_env(env), "OLLAMA_MODELS")
    return Path(value).expanduser() if value else Path.home() / ".ollama" / "models"


def noprune(env: Mapping[str, str] | None = None) -> bool:
    """OLLAMA_NOPRUNE: keep the blobs a re-created model no longer uses."""
    return bool(_var(_env(env), "OLLAMA_NOPRUNE"))


def library_path(env: Mapping[str, str] | None = None) -> list[str]:
    """OLLAMA_LIBRARY_PATH: where the GPU libraries were found, as the runner's /info reports it."""
    return [p for p in _var(_env(env), "OLLAMA_LIBRARY_PATH").split(os.pathsep) if p]


def build_dir(default: Path, env: Mapping[str, str] | None = None) -> Path:
    """OLLAMA_ENGINE_BUILD_DIR: where build_ggml.py builds (default: the repository's build/)."""
    value = _var(_env(env), "OLLAMA_ENGINE_BUILD_DIR")
    return Path(value) if value else default


def llama_cpp_source_override(env: Mapping[str, str] | None = None) -> Path | None:
    """OLLAMA_ENGINE_LLAMA_CPP: a llama.cpp tree of one's own (build_ggml.py --source)."""
    value = _var(_env(env), "OLLAMA_ENGINE_LLAMA_CPP")
    return Path(value) if value else None


def model_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """OLLAMA_ENGINE_CACHE, else $XDG_CACHE_HOME/ollama-engine, else ~/.cache/ollama-engine: real models."""
    env = _env(env)
    root = _var(env, "OLLAMA_ENGINE_CACHE")
    if root:
        return Path(root)
    xdg = _var(env, "XDG_CACHE_HOME")
    return Path(xdg) / "ollama-engine" if xdg else Path.home() / ".cache" / "ollama-engine"


def huge_pages(env: Mapping[str, str] | None = None) -> str:
    """OLLAMA_ENGINE_HUGE_PAGES as written (ml/model_backend.py checks it against the modes it knows)."""
    return _var(_env(env), "OLLAMA_ENGINE_HUGE_PAGES") or "collapse"


def parent_pid(env: Mapping[str, str] | None = None) -> int | None:
    """The serve a runner must not outlive (PARENT_PID_ENV), or None for a runner started by hand."""
    value = _var(_env(env), PARENT_PID_ENV)
    return int(value) if value.isdigit() else None


def parent_death_signal(env: Mapping[str, str] | None = None) -> bool:
    """Whether the parent lets the kernel signal the runner when the spawning thread ends."""
    return _var(_env(env), PARENT_DEATH_SIGNAL_ENV) == "1"


def rpc_servers(env: Mapping[str, str] | None = None) -> list[str]:
    """OLLAMA_RPC_SERVERS (ours, not Ollama's): `host:port,...` of ggml RPC servers whose devices join ours."""
    return server_list(_var(os.environ if env is None else env, "OLLAMA_RPC_SERVERS"))


def server_list(text: str) -> list[str]:
    """`host:port,...` (OLLAMA_RPC_SERVERS, --rpc-servers) as its items, blanks dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def exact_cache(env: Mapping[str, str] | None = None) -> bool:
    """OLLAMA_ENGINE_EXACT_CACHE (ours; default on): a prompt-cache hit gives a cold run's result bitwise.

    The runner then reuses only cached inputs computed as a cold run computes them (README, "Numerics");
    off, it reuses the longest cached prefix as Ollama does, and a hit may round differently.
    """
    return _bool(os.environ if env is None else env, "OLLAMA_ENGINE_EXACT_CACHE") is not False


def spec_ngram(env: Mapping[str, str] | None = None) -> bool:
    """OLLAMA_ENGINE_SPEC_NGRAM (ours; default off): n-gram speculative decoding for requests whose options do
    not say (`spec_ngram`). Exact: the same tokens and logprobs as plain decoding (runner/speculate.py)."""
    return _bool(os.environ if env is None else env, "OLLAMA_ENGINE_SPEC_NGRAM") is True


def stream_interval(env: Mapping[str, str] | None = None) -> float:
    """OLLAMA_ENGINE_STREAM_INTERVAL (ours; default 33ms, 0 sends every token on its own): how long the runner
    gathers tokens of a stream that decodes faster than that into one line. A duration ("5ms") or seconds."""
    value = _duration(os.environ if env is None else env, "OLLAMA_ENGINE_STREAM_INTERVAL", DEFAULT_STREAM_INTERVAL)
    return min(max(value, 0.0), MAX_STREAM_INTERVAL)


def image_urls(env: Mapping[str, str] | None = None) -> bool:
    """OLLAMA_ENGINE_IMAGE_URLS (ours; default off): serve fetches http(s) URLs in OpenAI `image_url` parts
    itself (api/image_urls.py: size and time limits, http(s) redirects only). Off, they are a 400 as in Ollama:
    a client could otherwise make serve request any address it can reach."""
    return _bool(os.environ if env is None else env, "OLLAMA_ENGINE_IMAGE_URLS") is True


@dataclass
class EnvConfig:
    """Every setting serve and the scheduler read from the environment."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    models: Path = Path.home() / ".ollama" / "models"
    keep_alive: float = DEFAULT_KEEP_ALIVE
    max_loaded_models: int = 0  # 0: 3 per GPU (3 without one)
    num_parallel: int = 1
    max_queue: int = DEFAULT_MAX_QUEUE
    load_timeout: float = DEFAULT_LOAD_TIMEOUT  # stall timeout while loading; inf: none
    context_length: int = 0  # 0: by total VRAM
    flash_attention: bool | None = None  # None: automatic
    kv_cache_type: str = ""
    # OLLAMA_KV_CACHE_TYPE_K / _V: the key or the value cache alone (llama.cpp's -ctk / -ctv); each overrides
    # OLLAMA_KV_CACHE_TYPE for its half
    kv_cache_type_k: str = ""
    kv_cache_type_v: str = ""
    gpu_overhead: int = 0
    sched_spread: bool = False
    origins: tuple[str, ...] = ()  # OLLAMA_ORIGINS: CORS origins allowed besides the defaults
    # OLLAMA_ENGINE_MODEL_PATHS: a model name may be the path of a GGUF file on the server (off: store names
    # only, as in Ollama, so that a client cannot make serve open files outside OLLAMA_MODELS)
    model_paths: bool = False
    # OLLAMA_RPC_SERVERS (or serve's --rpc-servers): ggml RPC servers whose devices serve's runners use as GPUs
    rpc_servers: tuple[str, ...] = ()
    image_urls: bool = False  # OLLAMA_ENGINE_IMAGE_URLS: fetch http(s) image URLs (off: a 400, as Ollama)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EnvConfig:
        env = os.environ if env is None else env
        host, port = _host(env)
        load_timeout = _duration(env, "OLLAMA_LOAD_TIMEOUT", DEFAULT_LOAD_TIMEOUT)
        return cls(
            host=host,
            port=port,
            models=models_dir(env),
            keep_alive=_duration(env, "OLLAMA_KEEP_ALIVE", DEFAULT_KEEP_ALIVE),
            max_loaded_models=_uint(env, "OLLAMA_MAX_LOADED_MODELS", 0),
            num_parallel=max(_uint(env, "OLLAMA_NUM_PARALLEL", 1), 1),
            max_queue=_uint(env, "OLLAMA_MAX_QUEUE", DEFAULT_MAX_QUEUE),
            load_timeout=math.inf if load_timeout <= 0 else load_timeout,
            context_length=_uint(env, "OLLAMA_CONTEXT_LENGTH", 0),
            flash_attention=_bool(env, "OLLAMA_FLASH_ATTENTION"),
            kv_cache_type=_var(env, "OLLAMA_KV_CACHE_TYPE").lower(),
            kv_cache_type_k=_var(env, "OLLAMA_KV_CACHE_TYPE_K").lower(),
            kv_cache_type_v=_var(env, "OLLAMA_KV_CACHE_TYPE_V").lower(),
            gpu_overhead=_uint(env, "OLLAMA_GPU_OVERHEAD", 0),
            sched_spread=bool(_bool(env, "OLLAMA_SCHED_SPREAD")),
            origins=tuple(_var(env, "OLLAMA_ORIGINS").split(",")) if _var(env, "OLLAMA_ORIGINS") else (),
            model_paths=bool(_bool(env, "OLLAMA_ENGINE_MODEL_PATHS")),
            rpc_servers=tuple(rpc_servers(env)),
            image_urls=image_urls(env),
        )

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
