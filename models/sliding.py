"""Sliding-window attention shared by architectures: which layers slide, and the cache that holds them.

llama.cpp's n_swa counts the token itself; kvcache.Causal's window counts the positions before it. Sliding
layers keep a ring of n_swa + batch cells, as llama.cpp's default (swa_full off), in the first cache of a
Wrapper; the global layers in its second.
"""

from __future__ import annotations

from collections.abc import Callable

from ollama_engine.fs import Config
from ollama_engine.kvcache import Causal, Wrapper

from .base import ModelError

SWA, GLOBAL = 0, 1  # the Wrapper's caches, by layer type
INT32_MAX = 2**31 - 1


def swa_layers(config: Config, blocks: int, pattern: int) -> tuple[bool, ...]:
    """Which layers use the sliding window (llama.cpp's load_swa_pattern, not dense-first).

    attention.sliding_window_pattern is either one flag per layer, or n: every n-th layer is global
    (0: none is); `pattern` is the architecture's n when the file has neither.
    """
    flags = config.value("attention.sliding_window_pattern")
    if isinstance(flags, list):
        if len(flags) != blocks:
            raise ModelError(f"attention.sliding_window_pattern has {len(flags)} flags for {blocks} layers")
        return tuple(bool(f) for f in flags)
    n = config.get_uint("attention.sliding_window_pattern", pattern)
    return tuple(n == 0 or i % n < n - 1 for i in range(blocks))


def check_window(window: int, swa: tuple[bool, ...]) -> None:
    """A sliding window must see at least the token and one before it, and fit the cache's int32 positions."""
    if window > INT32_MAX or (any(swa) and window < 2):
        raise ModelError(f"attention.sliding_window must be in 2..{INT32_MAX}, got {window}")


def sliding_cache(shift: Callable, window: int) -> Wrapper:
    """A cache of sliding layers (n_swa `window`) beside global ones; set_layer_type(SWA or GLOBAL) per layer."""
    return Wrapper(Causal(shift, window_size=max(window - 1, 1)), Causal(shift))
