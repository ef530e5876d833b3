"""Pick the next token from one row of logits, the way Ollama's Go runner does.

Temperature 0 is greedy. Otherwise the chain is top-k, temperature, softmax, top-p, min-p and a
weighted draw from a per-request random generator, so a fixed seed reproduces a run exactly.
A `logit_bias` (OpenAI's: token id → value added to its logit) applies first, to greedy choice as well, then
the repeat/frequency/presence penalties over the sequence's recent tokens (penalties.py), as llama.cpp's chain
orders them. typical_p is ignored, as in Ollama's engine.
"""

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ollama_engine.sample import transforms
from ollama_engine.sample.penalties import Penalties, PenaltySettings

# The values Ollama's api.DefaultOptions() gives the sampling options when a request has none.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9
DEFAULT_MIN_P = 0.0
RANDOM_SEED = -1


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer literal beyond float64 (10^400)
        raise TypeError(f"{name} is out of range") from None
    if number != number:
        raise TypeError(f"{name} must be a number, got NaN")
    return number


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


class NonFiniteLogitsError(ValueError):
    """The model computed NaN or infinite logits: that sequence cannot go on (the others can)."""


class Sampler:
    """Sampling settings plus the random generator of one request.

    Out-of-range settings are clamped as Ollama clamps them: a negative temperature becomes 0
    (greedy), top_p and min_p are limited to [0, 1]; top_k <= 0 means no top-k limit.
    A seed of -1 or None draws from fresh OS entropy; any other integer seeds the generator
    (negative seeds are taken modulo 2**64, as Go's uint64 conversion does).
    """

    def __init__(
        self,
        temperature: float = DEFAULT_TEMPERATURE,
        top_k: int = DEFAULT_TOP_K,
        top_p: float = DEFAULT_TOP_P,
        min_p: float = DEFAULT_MIN_P,
        seed: int | None = RANDOM_SEED,
        logit_bias: Mapping[Any, Any] | None = None,
        penalties: PenaltySettings | None = None,
    ) -> None:
        self.temperature = max(_number("temperature", temperature), 0.0)
        self.top_k = _integer("top_k", top_k)
        self.top_p = min(max(_number("top_p", top_p), 0.0), 1.0)
        self.min_p = min(max(_number("min_p", min_p), 0.0), 1.0)
        if seed is None or _integer("seed", seed) == RANDOM_SEED:
            self.rng = np.random.default_rng()
        else:
            self.rng = np.random.default_rng(seed % 2**64)
        self.bias_ids, self.bias_values = _logit_bias(logit_bias)
        self.penalties = Penalties(penalties or PenaltySettings(last_n=0))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "Sampler":
        """Build from a /completion request's `options` object.

        Null options mean Ollama's defaults. Otherwise a missing key means 0, because the parent
        serialises options with `omitempty`: an absent temperature is greedy and an absent seed is 0 (and an
        absent repeat_penalty, whose 0 would be invalid, is 1: off).
        """
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise TypeError(f"options must be an object, got {options!r}")
        return cls(
            temperature=options.get("temperature", 0.0),
            top_k=options.get("top_k", 0),
            top_p=options.get("top_p", 0.0),
            min_p=options.get("min_p", 0.0),
            seed=options.get("seed", 0),
            logit_bias=options.get("logit_bias"),
            penalties=PenaltySettings.from_options(options, absent_is_zero=True),
        )

    def start(self, history: Iterable[int], num_ctx: int) -> None:
        """Begin a sequence whose context so far (its prompt) is `history`; a window of -1 is num_ctx long."""
        self.penalties = Penalties(self.penalties.settings, history, num_ctx)

    def accept(self, token: int) -> None:
        """Record a token the sequence has taken (for the penalties' window)."""
        self.penalties.accept(token)

    def sample(self, logits: np.ndarray, ids: np.ndarray | None = None) -> int:
        """The chosen index into `logits`, which is read, never modified. `ids`: the (ascending) token ids of
        the rows when `logits` is a subset of the vocabulary (a grammar's allowed tokens), for the bias and the
        penalties."""
        logits = np.asarray(logits, dtype=np.float32)
        if logits.ndim != 1:
            raise ValueError(f"sample: expected one row of logits, got shape {logits.shape}")
        if logits.size == 0:
            raise ValueError("sample: no logits provided to sample")
        if self.bias_ids.size:
            logits = self._biased(logits, ids)
        logits = self.penalties.apply(logits, ids)
        if self.temperature == 0.0:
            token = int(np.argmax(logits))  # the first NaN if there is one
            if not np.isfinite(logits[token]):
                raise NonFiniteLogitsError(f"sample: the model computed a logit of {logits[token]}")
            return token

        ids = transforms.top_k(logits, self.top_k)
        probs = transforms.softmax(transforms.temperature(logits[ids], self.temperature))
        probs = transforms.min_p(transforms.top_p(probs, self.top_p), self.min_p)

        cumulative = np.cumsum(probs, dtype=np.float32)
        total = cumulative[-1]
        if not np.isfinite(total):
            raise NonFiniteLogitsError("sample: logits sum to NaN, check model output")
        r = self.rng.random(dtype=np.float32) * total
        return int(ids[np.searchsorted(cumulative, r, side="left")])

    def _biased(self, logits: np.ndarray, ids: np.ndarray | None) -> np.ndarray:
        """A copy of `logits` with the bias added; ids beyond the rows are ignored."""
        out = logits.copy()
        rows, keep = transforms.rows_of(self.bias_ids, ids, out.shape[0])
        out[rows[keep]] += self.bias_values[keep]
        return out


def _logit_bias(value: Any) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, values) of a logit_bias map {id (int or its decimal string): number}; empty arrays for none."""
    if value is None or value == {}:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    if not isinstance(value, Mapping):
        raise TypeError(f"logit_bias must be an object of token id to number, got {value!r}")
    ids, values = [], []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise TypeError(f"logit_bias: {key!r} is not a token id") from None
        if token < 0 or isinstance(key, bool):
            raise TypeError(f"logit_bias: {key!r} is not a token id")
        ids.append(token)
        values.append(_number(f"logit_bias[{key}]", bias))
    return np.asarray(ids, dtype=np.int64), np.asarray(values, dtype=np.float32)
