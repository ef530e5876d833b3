"""Typed access to GGUF metadata, after Ollama's fs.Config.

Model code asks for `config.get_uint("block_count")` and gets `<arch>.block_count`: keys that do not
start with "general." or "tokenizer." are prefixed with the architecture. A missing key, or a key
holding a value of another type, gives the caller's default, so optional hyper-parameters read as
one line each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_UNPREFIXED = ("general.", "tokenizer.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Config:
    def __init__(self, metadata: Mapping[str, Any]) -> None:
        self._metadata = metadata

    def architecture(self) -> str:
        arch = self._metadata.get("general.architecture")
        return arch if isinstance(arch, str) else ""

    def full_key(self, key: str) -> str:
        if key.startswith(_UNPREFIXED):
            return key
        return f"{self.architecture()}.{key}"

    def keys(self) -> list[str]:
        """All keys as stored in the file (already prefixed)."""
        return list(self._metadata)

    def __len__(self) -> int:
        return len(self._metadata)

    def __contains__(self, key: str) -> bool:
        return self.full_key(key) in self._metadata

    def value(self, key: str, default: Any = None) -> Any:
        """The raw value whatever its type."""
        return self._metadata.get(self.full_key(key), default)

    def get_string(self, key: str, default: str = "") -> str:
        value = self.value(key)
        return value if isinstance(value, str) else default

    def get_uint(self, key: str, default: int = 0) -> int:
        """An integer of any GGUF width; negative values count as the wrong type."""
        value = self.value(key)
        return value if _is_int(value) and value >= 0 else default

    def get_float(self, key: str, default: float = 0.0) -> float:
        """A FLOAT32/FLOAT64 value; integers are the wrong type, as in Ollama."""
        value = self.value(key)
        return value if isinstance(value, float) else default

    def get_bool(self, key: str, default: bool = False) -> bool:
        value = self.value(key)
        return value if isinstance(value, bool) else default

    def get_strings(self, key: str, default: list[str] | None = None) -> list[str]:
        return self._list(key, lambda v: isinstance(v, str), default)

    def get_ints(self, key: str, default: list[int] | None = None) -> list[int]:
        return self._list(key, _is_int, default)

    def get_floats(self, key: str, default: list[float] | None = None) -> list[float]:
        return self._list(key, lambda v: isinstance(v, float), default)

    def get_bools(self, key: str, default: list[bool] | None = None) -> list[bool]:
        return self._list(key, lambda v: isinstance(v, bool), default)

    def _list(self, key: str, is_element: Any, default: list[Any] | None) -> list[Any]:
        value = self.value(key)
        if isinstance(value, list) and all(is_element(v) for v in value):
            return list(value)
        return list(default) if default is not None else []
