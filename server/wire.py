"""The runner protocol's JSON, byte for byte as Ollama's Go runner (f63eea3d) reads and writes it.

Go conventions this follows: untagged struct fields use the Go field name as the key (`Operation`,
`GPULayers`, `Success`); enums are plain integers; durations are int64 nanoseconds; decoding matches
keys case-insensitively, ignores unknown keys and leaves missing ones at their zero value; the encoder
escapes `<`, `>`, `&`, U+2028 and U+2029 and ends every document with a newline.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from ollama_engine import envconfig
from ollama_engine.ml import BackendMemory, GPULayersList
from ollama_engine.runner.allocate import LoadParams
from ollama_engine.runner.images import ImageData
from ollama_engine.runner.sequence import DoneReason, SequenceOptions
from ollama_engine.runner.speculate import MAX_DRAFT
from ollama_engine.sample import MAX_TOP_LOGPROBS, Logprob, Sampler

MAX_THREADS = 512  # GGML_MAX_N_THREADS


class WireError(ValueError):
    """A request body that Go's decoder would reject."""


class ServerStatus(IntEnum):
    """/health status (Ollama's llm.ServerStatus); this runner reports LAUNCHED, LOADING_MODEL and READY."""

    READY = 0
    NO_SLOTS_AVAILABLE = 1
    LAUNCHED = 2
    LOADING_MODEL = 3
    NOT_RESPONDING = 4
    ERROR = 5


class LoadOperation(IntEnum):
    FIT = 0  # measure memory, allocate nothing
    ALLOC = 1  # allocate weights, KV cache and compute graphs; keep them
    COMMIT = 2  # load the weights (in the background) and start serving
    CLOSE = 3  # free everything


class Float32(float):
    """A float that Go holds as float32, so it is written with the shortest float32 digits."""


# ---------------------------------------------------------------- encoding


def _go_float(value: float) -> str:
    if not math.isfinite(value):
        raise ValueError(f"json: unsupported value: {value}")
    kind = np.float32 if isinstance(value, Float32) else np.float64
    number = kind(value)
    # Go compares in the value's own precision: float32(1e-6) is below 1e-6 as a float64, not as a float32
    if value == 0 or kind(1e-6) <= abs(number) < kind(1e21):
        return np.format_float_positional(number, unique=True, trim="-")
    return np.format_float_scientific(number, unique=True, trim="-", exp_digits=2).replace("e-0", "e-")


_GO_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))
_json_text = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _go_escaped(text: str) -> str:
    """JSON text as Go's encoder writes it: json.dumps escapes all else the same way."""
    for char, escape in _GO_ESCAPES:
        if char in text:
            text = text.replace(char, escape)
    return text


def _go_string(value: str) -> str:
    return _go_escaped(_json_text(value))


def _encode(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif isinstance(value, bool):
        out.append("true" if value else "false")
    elif isinstance(value, int):
        out.append(str(int(value)))
    elif isinstance(value, float):
        out.append(_go_float(value))
    elif isinstance(value, str):
        out.append(_go_string(value))
    elif isinstance(value, Mapping):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append("," if i else "")
            out.append(_go_string(key) + ":")
            _encode(item, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            out.append("," if i else "")
            _encode(item, out)
        out.append("]")
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def _float_free(value: Any) -> bool:
    """Whether value holds only str keys, str, int, bool, None, dicts and lists: json's C encoder writes
    those as Go does (only floats differ). Exact types: subclasses (Float32, enums) take the slow path."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return True
    if kind is dict:
        return all(type(key) is str and _float_free(item) for key, item in value.items())
    if kind is list or kind is tuple:
        return all(_float_free(item) for item in value)
    return False


def encode(value: Any) -> bytes:
    """What Go's json.NewEncoder(w).Encode(value) writes."""
    if _float_free(value):  # json's C encoder: a third of the time per streamed chunk
        return (_go_escaped(_json_text(value)) + "\n").encode("utf-8")
    out: list[str] = []
    _encode(value, out)
    out.append("\n")
    return "".join(out).encode("utf-8")


def nanoseconds(seconds: float) -> int:
    return round(seconds * 1e9)


# ---------------------------------------------------------------- decoding


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid character {name[0]!r} looking for beginning of value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"json: cannot unmarshal number {text} into Go value of type float64")
    return value


def _replace_surrogates(value: Any) -> Any:
    """Go decodes an unpaired UTF-16 surrogate escape as U+FFFD; Python keeps it, and it cannot be encoded."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_replace_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_replace_surrogates(k): _replace_surrogates(v) for k, v in value.items()}
    return value


def go_loads(body: bytes) -> Any:
    """json.loads accepting what Go's encoding/json accepts: no NaN or Infinity, no number beyond float64,
    unpaired surrogates read as U+FFFD. Anything else (bad UTF-8, too deep) is a WireError."""
    try:
        data = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise WireError(str(err)) from err
    except RecursionError as err:
        raise WireError("exceeded max depth") from err
    if _SURROGATE_ESCAPE.search(body):
        data = _replace_surrogates(data)
    return data


def decode_object(body: bytes) -> dict[str, Any]:
    """A JSON object with its keys folded to lower case (Go matches field names case-insensitively)."""
    data = go_loads(body)
    if not isinstance(data, dict):
        raise WireError(f"expected a JSON object, got {type(data).__name__}")
    return {key.lower(): value for key, value in data.items()}


def _typed(data: Mapping[str, Any], key: str, kind: type, zero: Any) -> Any:
    """data[key] checked against a Go type; absent or null gives the zero value."""
    value = data.get(key)
    if value is None:
        return zero
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WireError(f"{key}: expected {kind.__name__}, got {value!r}")
    return value


def _strings(data: Mapping[str, Any], key: str) -> list[str]:
    values = _typed(data, key, list, [])
    if not all(isinstance(v, str) for v in values):
        raise WireError(f"{key}: expected a list of strings, got {values!r}")
    return values


# ---------------------------------------------------------------- /load


@dataclass
class LoadRequest:
    """llm.LoadRequest. ProjectorPath: a separate vision projector (mmproj GGUF); MainGPU is legacy and ignored
    (but compared); UseMmap maps the file for the weights on the CPU (Ollama's Go engine ignored it, its llama.cpp
    runner did not). DraftPath (ours): a draft model's GGUF for speculative decoding (same vocabulary; its
    weights, cache and graph are counted in the memory report)."""

    operation: LoadOperation = LoadOperation.FIT
    lora_path: list[str] = field(default_factory=list)
    parallel: int = 0
    batch_size: int = 0
    flash_attention: int = 0  # -1 auto, 0 disabled, 1 enabled
    kv_size: int = 0
    kv_cache_type: str = ""
    kv_cache_type_k: str = ""  # ours, beside Ollama's KvCacheType: the key or value cache alone
    kv_cache_type_v: str = ""
    num_threads: int = 0
    gpu_layers: GPULayersList = field(default_factory=GPULayersList)
    multi_user_cache: bool = False
    projector_path: str = ""
    main_gpu: int = 0
    use_mmap: bool = False
    draft_path: str = ""

    @classmethod
    def from_json(cls, body: bytes) -> LoadRequest:
        data = decode_object(body)
        operation = _typed(data, "operation", int, 0)
        if operation not in LoadOperation.__members__.values():
            raise WireError(f"Operation: unknown load operation {operation}")
        num_threads = _typed(data, "numthreads", int, 0)
        if not 0 <= num_threads <= MAX_THREADS:  # ggml's thread pool crashes beyond GGML_MAX_N_THREADS
            raise WireError(f"NumThreads: {num_threads} is not between 0 and {MAX_THREADS}")
        layers = _typed(data, "gpulayers", list, [])
        try:
            gpu_layers = GPULayersList.from_json(layers)
        except (AttributeError, TypeError) as err:
            raise WireError(f"GPULayers: {err}") from err
        return cls(
            operation=LoadOperation(operation),
            lora_path=_strings(data, "lorapath"),
            parallel=_typed(data, "parallel", int, 0),
            batch_size=_typed(data, "batchsize", int, 0),
            flash_attention=_typed(data, "flashattention", int, 0),
            kv_size=_typed(data, "kvsize", int, 0),
            kv_cache_type=_typed(data, "kvcachetype", str, ""),
            kv_cache_type_k=_typed(data, "kvcachetypek", str, ""),
            kv_cache_type_v=_typed(data, "kvcachetypev", str, ""),
            num_threads=num_threads,
            gpu_layers=gpu_layers,
            multi_user_cache=_typed(data, "multiusercache", bool, False),
            projector_path=_typed(data, "projectorpath", str, ""),
            main_gpu=_typed(data, "maingpu", int, 0),
            use_mmap=_typed(data, "usemmap", bool, False),
            draft_path=_typed(data, "draftpath", str, ""),
        )

    def same_layout(self, other: LoadRequest | None) -> bool:
        """Equal in everything but the operation: an alloc followed by such a commit reuses the allocation."""
        if other is None:
            return False
        mine, theirs = dict(vars(self)), dict(vars(other))
        mine.pop("operation"), theirs.pop("operation")
        return mine == theirs

    def params(self) -> LoadParams:
        return LoadParams(
            parallel=self.parallel,
            batch_size=self.batch_size,
            kv_size=self.kv_size,
            kv_cache_type=self.kv_cache_type,
            kv_cache_type_k=self.kv_cache_type_k,
            kv_cache_type_v=self.kv_cache_type_v,
            flash_attention=self.flash_attention,
            num_threads=self.num_threads,
            gpu_layers=tuple(self.gpu_layers),
            multi_user_cache=self.multi_user_cache,
            use_mmap=self.use_mmap,
            projector_path=self.projector_path,
            draft_path=self.draft_path,
        )


def load_response(success: bool, memory: BackendMemory) -> dict[str, Any]:
    """llm.LoadResponse."""
    return {"Success": success, "Memory": memory.to_json()}


def health_response(status: ServerStatus, progress: float) -> dict[str, Any]:
    """llm.ServerStatusResponse."""
    return {"status": int(status), "progress": Float32(progress)}


# ---------------------------------------------------------------- /completion


@dataclass
class CompletionRequest:
    """llm.CompletionRequest, reduced to what this runner uses (Format is the parent's business)."""

    prompt: str
    options: SequenceOptions
    grammar: str = ""
    images: list[ImageData] = field(default_factory=list)

    @classmethod
    def from_json(cls, body: bytes) -> CompletionRequest:
        data = decode_object(body)
        raw_options = data.get("options")
        if raw_options is not None and not isinstance(raw_options, dict):
            raise WireError(f"Options: expected an object, got {raw_options!r}")
        if raw_options is not None:
            raw_options = {key.lower(): value for key, value in raw_options.items()}
        # null Options are Ollama's api.DefaultOptions(); present ones leave omitted keys at zero
        options = {"num_predict": -1, "num_keep": 4} if raw_options is None else raw_options
        top_logprobs = _typed(data, "toplogprobs", int, 0)
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise WireError(f"TopLogprobs: must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}")
        draft_num_predict = _typed(options, "draft_num_predict", int, 0)
        if not 0 <= draft_num_predict <= MAX_DRAFT:
            raise WireError(f"draft_num_predict: must be between 0 and {MAX_DRAFT}, got {draft_num_predict}")
        spec_ngram = options.get("spec_ngram")
        if spec_ngram is not None and not isinstance(spec_ngram, bool):
            raise WireError(f"spec_ngram: expected bool, got {spec_ngram!r}")
        try:
            sampler = Sampler.from_options(raw_options)
        except TypeError as err:
            raise WireError(str(err)) from err
        return cls(
            prompt=_typed(data, "prompt", str, ""),
            grammar=_typed(data, "grammar", str, ""),
            images=_images(data.get("images")),
            options=SequenceOptions(
                sampler=sampler,
                num_predict=_typed(options, "num_predict", int, 0),
                num_keep=_typed(options, "num_keep", int, 0),
                stop=_strings(options, "stop"),
                shift=_typed(data, "shift", bool, False),
                truncate=_typed(data, "truncate", bool, False),
                logprobs=_typed(data, "logprobs", bool, False),
                top_logprobs=top_logprobs,
                spec_ngram=envconfig.spec_ngram() if spec_ngram is None else spec_ngram,
                draft_num_predict=draft_num_predict,
            ),
        )


def _images(raw: Any) -> list[ImageData]:
    """llm.ImageData entries: {"data": base64 (Go's []byte), "id": int}; keys matched case-insensitively."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise WireError(f"Images: expected an array, got {type(raw).__name__}")
    images = []
    for entry in raw:
        if not isinstance(entry, dict):
            raise WireError(f"Images: expected objects, got {entry!r:.40}")
        entry = {key.lower(): value for key, value in entry.items()}
        data = _typed(entry, "data", str, "")
        try:
            decoded = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as err:
            raise WireError(f"Images: data is not base64: {err}") from err
        images.append(ImageData(id=_typed(entry, "id", int, 0), data=decoded))
    return images


_CHUNK_TAIL = (b',"done_reason":0,"done":false,"prompt_eval_count":0,"prompt_eval_duration":0,"eval_count":0,'
               b'"eval_duration":0}\n')


def completion_line(content: str, logprobs: list[Logprob]) -> bytes:
    """encode(completion_chunk(...)), written straight for the common chunk without logprobs (one per token)."""
    if logprobs:
        return encode(completion_chunk(content, logprobs))
    return b'{"content":' + _go_string(content).encode("utf-8") + _CHUNK_TAIL


def completion_chunk(content: str, logprobs: list[Logprob]) -> dict[str, Any]:
    """One streamed llm.CompletionResponse line before the end."""
    out: dict[str, Any] = {
        "content": content, "done_reason": 0, "done": False, "prompt_eval_count": 0,
        "prompt_eval_duration": 0, "eval_count": 0, "eval_duration": 0,
    }
    if logprobs:
        out["logprobs"] = [_logprob(entry) for entry in logprobs]
    return out


def completion_done(
    reason: DoneReason, prompt_eval_count: int, prompt_eval_seconds: float, eval_count: int, eval_seconds: float
) -> dict[str, Any]:
    """The last llm.CompletionResponse line of a stream."""
    return {
        "content": "", "done_reason": int(reason), "done": True,
        "prompt_eval_count": prompt_eval_count, "prompt_eval_duration": nanoseconds(prompt_eval_seconds),
        "eval_count": eval_count, "eval_duration": nanoseconds(eval_seconds),
    }


def _logprob(entry: Logprob) -> dict[str, Any]:
    out: dict[str, Any] = {"token": entry["token"], "logprob": float(entry["logprob"])}
    if entry.get("top_logprobs"):
        out["top_logprobs"] = [{"token": t["token"], "logprob": float(t["logprob"])} for t in entry["top_logprobs"]]
    return out


# ---------------------------------------------------------------- /embedding


def embedding_content(body: bytes) -> str:
    """llm.EmbeddingRequest's `content`."""
    return _typed(decode_object(body), "content", str, "")


def rerank_pair(body: bytes) -> tuple[str, str]:
    """Our /rerank request's `query` and `document`."""
    data = decode_object(body)
    return _typed(data, "query", str, ""), _typed(data, "document", str, "")
