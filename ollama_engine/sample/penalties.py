"""Repeat, frequency and presence penalties, applied as llama.cpp's penalties sampler applies them.

Ollama's Go engine ignored these options; Ollama today hands them to llama-server, whose sampler chain
starts with logit_bias, then the penalties, then top-k and the rest. So here: a sequence keeps a window of
its last `last_n` tokens, the prompt's included (llama-server feeds every prompt token to the sampler before
the first draw), and counts how often each occurs in it. Before any other step, greedy choice included, a
token in the window has its logit divided by `repeat` (multiplied where the logit is not positive, so the
penalty always lowers it) and then lowered by `count * frequency + presence`, in float32 as llama.cpp does.

`last_n` -1 means the context length (Ollama's documented meaning); 0 turns the penalties off, as do
repeat 1, frequency 0 and presence 0 together.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ollama_engine.sample import transforms

INT32_MAX = 2**31 - 1  # llama.cpp's penalty_last_n is an int32
_F32_MAX = float(np.finfo(np.float32).max)


def _float32(name: str, value: Any) -> float:
    """A number that stays finite as a float32 (llama.cpp's type for these settings)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer literal beyond float64
        raise TypeError(f"{name} is out of range") from None
    if not math.isfinite(number) or abs(number) > _F32_MAX:
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    return number


@dataclass(frozen=True)
class PenaltySettings:
    """The four options, checked as llama.cpp checks them (TypeError with the reason otherwise)."""

    last_n: int = 64
    repeat: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.last_n, bool) or not isinstance(self.last_n, int):
            raise TypeError(f"repeat_last_n must be an integer, got {self.last_n!r}")
        if not -1 <= self.last_n <= INT32_MAX:
            raise TypeError(f"repeat_last_n must be between -1 (the context length) and {INT32_MAX}, "
                            f"got {self.last_n}")
        repeat = _float32("repeat_penalty", self.repeat)
        with np.errstate(over="ignore", divide="ignore"):
            inverse = float(np.float32(1) / np.float32(repeat))  # llama.cpp divides by it: must stay finite
        if repeat <= 0 or not math.isfinite(inverse):
            raise TypeError(f"repeat_penalty must be greater than 0 (1 turns it off), got {self.repeat!r}")
        object.__setattr__(self, "repeat", repeat)
        object.__setattr__(self, "frequency", _float32("frequency_penalty", self.frequency))
        object.__setattr__(self, "presence", _float32("presence_penalty", self.presence))

    @classmethod
    def from_options(cls, options: Mapping[str, Any], absent_is_zero: bool = False) -> PenaltySettings:
        """From API or runner options. `absent_is_zero`: the runner's reading, where the parent leaves out zero
        values (Go's omitempty): a missing window is 0 (off) and a missing or zero repeat_penalty is 1 (off),
        never the invalid 0."""
        default = cls(last_n=0) if absent_is_zero else cls()
        repeat = _value(options, "repeat_penalty", default.repeat)
        if absent_is_zero and type(repeat) in (int, float) and repeat == 0:
            repeat = default.repeat
        return cls(
            last_n=_value(options, "repeat_last_n", default.last_n),
            repeat=repeat,
            frequency=_value(options, "frequency_penalty", default.frequency),
            presence=_value(options, "presence_penalty", default.presence),
        )

    @property
    def off(self) -> bool:
        return self.last_n == 0 or (self.repeat == 1.0 and self.frequency == 0.0 and self.presence == 0.0)


def _value(options: Mapping[str, Any], key: str, default: Any) -> Any:
    value = options.get(key)
    return default if value is None else value


class Penalties:
    """One sequence's window of recent tokens and the penalties it puts on their logits."""

    def __init__(self, settings: PenaltySettings, history: Iterable[int] = (), num_ctx: int = 0) -> None:
        self.settings = settings
        size = settings.last_n if settings.last_n >= 0 else num_ctx
        self._window: deque[int] = deque(maxlen=max(size, 0))
        self._counts: dict[int, int] = {}
        if not settings.off:
            for token in history:
                self.accept(token)

    def accept(self, token: int) -> None:
        """A token joins the window; the oldest leaves once the window is full."""
        window = self._window
        if self.settings.off or window.maxlen == 0:
            return
        if len(window) == window.maxlen:
            old = window[0]
            left = self._counts[old] - 1
            if left:
                self._counts[old] = left
            else:
                del self._counts[old]
        window.append(token)
        self._counts[token] = self._counts.get(token, 0) + 1

    def apply(self, logits: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
        """`logits` with the penalties applied (a copy when any applies; never modified in place). `ids`: the
        ascending token ids of the rows when `logits` covers only part of the vocabulary."""
        if self.settings.off or not self._counts:
            return logits
        tokens = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
        counts = np.fromiter(self._counts.values(), dtype=np.int64, count=len(self._counts))
        rows, keep = transforms.rows_of(tokens, ids, logits.shape[0])
        rows, counts = rows[keep], counts[keep]
        out = logits.copy()
        values = out[rows]
        repeat = np.float32(self.settings.repeat)
        values = np.where(values <= 0, values * repeat, values / repeat)
        values -= counts.astype(np.float32) * np.float32(self.settings.frequency) + np.float32(self.settings.presence)
        out[rows] = values
        return out
