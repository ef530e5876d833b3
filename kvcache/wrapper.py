"""Wrapper: several caches behind one, for models that mix layer types (gemma2/3: sliding and global).

The model selects a cache per layer with set_layer_type(); everything else fans out to all of them.
"""

from __future__ import annotations

from ollama_engine.ml import Backend, Context, DType, Tensor

from .batch import Batch
from .cache import Cache, CacheConfig, Segment


class Wrapper:
    def __init__(self, *caches: Cache):
        if not caches:
            raise ValueError("a wrapper cache needs at least one cache")
        self.caches = caches
        self._current = 0

    @property
    def config(self) -> CacheConfig:
        return self.underlying().config

    def set_config(self, config: CacheConfig) -> None:
        for cache in self.caches:
            cache.set_config(config)

    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int,
             value_dtype: DType | None = None) -> None:
        for cache in self.caches:
            cache.init(backend, dtype, max_sequences, capacity, max_batch, value_dtype=value_dtype)

    def close(self) -> None:
        for cache in self.caches:
            cache.close()

    def set_layer(self, layer: int) -> None:
        for cache in self.caches:
            cache.set_layer(layer)

    def set_layer_type(self, index: int) -> None:
        """Select the cache (by its position in the constructor) that put() and get() use."""
        if not 0 <= index < len(self.caches):
            raise IndexError(f"layer type {index} out of 0..{len(self.caches) - 1}")
        self._current = index

    def underlying(self) -> Cache:
        return self.caches[self._current]

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        self.prepare(batch, reserve)
        self.bind(ctx)

    def prepare(self, batch: Batch, reserve: bool = False) -> tuple:
        layouts = []
        for i, cache in enumerate(self.caches):
            try:
                layouts.append(cache.prepare(batch, reserve))
            except Exception:
                # take the batch back out of the caches that accepted it (removing to the end cannot fail)
                for earlier in self.caches[:i]:
                    for seq, position in zip(batch.sequences.tolist(), batch.positions.tolist(), strict=True):
                        earlier.remove(seq, position)
                raise
        self._current = 0
        return tuple(layouts)

    def bind(self, ctx: Context) -> None:
        for cache in self.caches:
            cache.bind(ctx)

    def repeat(self, ctx: Context) -> bool:
        return False  # a sliding-window cache's masks change at every step: each batch is prepared

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        self.underlying().put(ctx, key, value)

    def rotations(self, ctx: Context, k_dim: int, v_dim: int) -> tuple[Tensor | None, Tensor | None]:
        return self.underlying().rotations(ctx, k_dim, v_dim)

    def get(self, ctx: Context) -> list[Segment]:
        return self.underlying().get(ctx)

    def copy_prefix(self, source: int, destination: int, length: int) -> None:
        for cache in self.caches:
            cache.copy_prefix(source, destination, length)

    def can_resume(self, seq: int, position: int) -> bool:
        return all(cache.can_resume(seq, position) for cache in self.caches)

    def remove(self, seq: int, begin: int, end: int | None = None) -> None:
        for cache in self.caches:
            cache.remove(seq, begin, end)
