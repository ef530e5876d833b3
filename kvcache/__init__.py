"""The key/value cache (Ollama's kvcache), imported as ollama_engine.kvcache: see cache.py for the protocol."""

from .attention import attention
from .batch import Batch
from .cache import (
    CACHE_TYPES,
    Cache,
    CacheConfig,
    CacheError,
    CacheFullError,
    Segment,
    ShiftError,
    ShiftFn,
    backend_cache_config,
    cache_dtype,
)
from .causal import Causal, Layout
from .recurrent import Recurrent, StateError
from .wrapper import Wrapper

__all__ = [
    "CACHE_TYPES", "Batch", "Cache", "CacheConfig", "CacheError", "CacheFullError", "Causal", "Layout",
    "Recurrent", "Segment", "ShiftError", "ShiftFn", "StateError", "Wrapper", "attention", "backend_cache_config",
    "cache_dtype",
]
