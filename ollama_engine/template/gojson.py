"""JSON written byte for byte as Go's encoding/json writes it.

Ollama hashes the JSON it writes (manifests, config and params blobs) and prints JSON from templates
(`json`, tool arguments). To produce the same bytes, and so the same digests, we follow Go: compact,
map keys sorted, struct fields in declaration order, `<`, `>`, `&`, U+2028 and U+2029 escaped, and
floats in Go's shortest form (`42`, not `42.0`).
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

import numpy as np


class GoStruct(dict):
    """A JSON object whose keys keep their order (a Go struct); a plain dict is a Go map (keys sorted)."""


class Float32(float):
    """A float that Go holds as float32 (Options.temperature and friends): printed with float32's shortest digits."""


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f",
            "<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def go_string(s: str) -> str:
    """A JSON string literal as Go writes it (HTML-safe)."""
    out = []
    for ch in s:
        esc = _ESCAPES.get(ch)
        if esc is not None:
            out.append(esc)
        elif ch < " ":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def go_float(x: float, float32: bool = False, verb: str = "json") -> str:
    """A float as Go prints it, with the shortest digits that round-trip.

    verb "json": encoding/json (positional from 1e-6 up to 1e21, `1e-7`, `1e+21`); verb "v": fmt's %v
    (positional from 1e-4 up to 1e6, `1e-05`, `1e+06`).
    """
    if math.isnan(x) or math.isinf(x):
        raise ValueError(f"json: unsupported value: {x}")
    if x == 0:
        return "-0" if math.copysign(1, x) < 0 else "0"
    d = Decimal(np.format_float_scientific(np.float32(x), unique=True) if float32 else repr(float(x)))
    low, high = (-6, 21) if verb == "json" else (-4, 6)
    if low <= d.adjusted() < high:
        text = format(d, "f")
        return text[:-2] if text.endswith(".0") else text
    mantissa, exp = format(d.normalize(), "e").split("e")
    digits = exp.lstrip("+-").lstrip("0") or "0"
    if exp.startswith("-"):
        return f"{mantissa}e-{digits if verb == 'json' else digits.zfill(2)}"  # encoding/json writes e-7
    return f"{mantissa}e+{digits.zfill(2)}"


def go_json(value: Any) -> str:
    """Marshal like Go's json.Marshal (no trailing newline; json.Encoder adds one)."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return go_string(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_float(value, float32=isinstance(value, Float32))
    if hasattr(value, "__go_json__"):
        return value.__go_json__()
    if isinstance(value, dict):
        items = value.items() if isinstance(value, GoStruct) else sorted(value.items())
        return "{" + ",".join(f"{go_string(str(k))}:{go_json(v)}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(go_json(v) for v in value) + "]"
    raise TypeError(f"json: unsupported type: {type(value).__name__}")
