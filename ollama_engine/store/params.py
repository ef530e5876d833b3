"""Modelfile PARAMETERs, typed as Ollama's api.Options fields (api.FormatParams), and printed back.

Each known parameter has the Go type of its Options field: int (ParseInt base 10), float32 (ParseFloat),
bool (ParseBool), *bool, or []string (stop, which accumulates). An unknown name is an error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ollama_engine.template.gojson import Float32, go_float, go_string

# Options and Runner fields of api/types.go at f63eea3d, by JSON name.
PARAMETER_TYPES: dict[str, str] = {
    "num_ctx": "int", "num_batch": "int", "num_gpu": "int", "main_gpu": "int", "use_mmap": "*bool",
    "num_thread": "int", "num_keep": "int", "seed": "int", "num_predict": "int", "top_k": "int",
    "top_p": "float", "min_p": "float", "typical_p": "float", "repeat_last_n": "int", "temperature": "float",
    "repeat_penalty": "float", "presence_penalty": "float", "frequency_penalty": "float", "stop": "[]string",
}
# Accepted in a Modelfile with a warning and dropped (parser.deprecatedParameters).
DEPRECATED_PARAMETERS = ("penalize_newline", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock",
                         "mirostat", "mirostat_tau", "mirostat_eta")

_INT = re.compile(r"^[+-]?[0-9]+$")
_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}


class ParameterError(ValueError):
    """An unknown parameter name or a value that does not parse as the parameter's type."""


def format_param(key: str, value: str) -> Any:
    """One PARAMETER value typed as Ollama types it; stop becomes a one-item list."""
    kind = PARAMETER_TYPES.get(key)
    if kind is None:
        raise ParameterError(f"unknown parameter '{key}'")
    if kind == "int":
        if not _INT.match(value) or not -(2**63) <= int(value) < 2**63:
            raise ParameterError(f"invalid int value [{value}]")
        return int(value)
    if kind == "float":
        try:
            number = float(value)
        except ValueError:
            raise ParameterError(f"invalid float value [{value}]") from None
        if "_" in value or value != value.strip() or math.isnan(number) or math.isinf(number):
            raise ParameterError(f"invalid float value [{value}]")
        return Float32(number)
    if kind in ("bool", "*bool"):
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ParameterError(f"invalid bool value [{value}]")
    return [value]


def merge_param(params: dict[str, Any], key: str, value: str) -> None:
    """Add one PARAMETER line: lists (stop) accumulate, other keys take the last value."""
    typed = format_param(key, value)
    if isinstance(typed, list) and isinstance(params.get(key), list):
        params[key] = params[key] + typed
    else:
        params[key] = typed


def go_value(value: Any, quoted: bool) -> str:
    """A JSON-decoded parameter value as Go prints it: %#v (quoted strings) for /api/show, %v for Modelfiles."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return go_string(value) if quoted else value
    if isinstance(value, (int, float)):  # JSON numbers decode to float64 in Go
        return go_float(float(value), verb="v")
    return str(value)


def parameter_lines(params: Mapping[str, Any]) -> str:
    """/api/show's `parameters`: `key` padded to 30 columns, a space, the Go-quoted value; lists one per line."""
    lines = []
    for key in sorted(params):
        values = params[key] if isinstance(params[key], list) else [params[key]]
        lines.extend(f"{key:<30} {go_value(v, quoted=True)}" for v in values)
    return "\n".join(lines)
