"""The Cache protocol models and the runner program against, its configuration and its errors.

A forward pass goes: the runner calls `start_forward(ctx, batch)` (which picks cells for the batch and
creates the mask and cell-index inputs in ctx), then for every layer the model calls `set_layer(i)`,
`put(ctx, k, v)` and `get(ctx)` (usually through `attention()`), and the runner computes the graph.
`get` returns one Segment per sequence of the batch: each sequence attends to its own history alone.

So that one built graph can serve many decode steps, `start_forward` is also available in two halves:
`prepare(batch)` updates the cache's bookkeeping and returns the layout (everything the graph's shape
depends on); when that equals the layout the graph was built for, `bind(ctx)` with the old context
writes the new mask and cell indices into the tensors that graph already holds (the Context keeps
the numpy arrays its inputs were created from and writes them at every compute).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from ollama_engine.ml import Backend, Context, DType, Tensor

from .batch import Batch


@dataclass(frozen=True)
class Segment:
    """One sequence's rows of a batch (rows begin..begin+count) and the history they attend to.

    key (k_head_dim, kv_heads, history), value (v_head_dim, kv_heads, history) or with permuted V
    (history, v_head_dim, kv_heads), mask (history, count): 0 where a row may attend, -inf where not.
    apart: each row attends as a one-row batch would (rows verifying drafts, `Batch.apart`), with this history,
    which is the one each row alone gets (only without flash attention; with it, such rows are segments of one);
    or one row of each of several sequences (decode steps), whose histories key and value then hold along a
    fourth dimension (k_head_dim, kv_heads, history, rows).
    """

    begin: int
    count: int
    key: Tensor
    value: Tensor
    mask: Tensor
    apart: bool = False


ShiftFn = Callable[[Context, int, Tensor, Tensor], Tensor]
"""shift(ctx, layer, key, positions_delta) -> key re-rotated by the delta (I32, one per cell)."""

CACHE_TYPES: dict[str, DType] = {"f16": DType.F16, "q8_0": DType.Q8_0, "q4_0": DType.Q4_0, "f32": DType.F32}
QUANTIZED_TYPES = (DType.Q8_0, DType.Q4_0)


def cache_dtype(name: str) -> DType:
    """The cache data type for an OLLAMA_KV_CACHE_TYPE-style name; empty means the default, f16."""
    key = name.strip().lower() or "f16"
    if key not in CACHE_TYPES:
        raise ValueError(f"unsupported kv cache type {name!r}: choose one of {', '.join(CACHE_TYPES)}")
    return CACHE_TYPES[key]


class CacheError(Exception):
    """Base class of the cache's recoverable errors."""


class CacheFullError(CacheError):
    """No free cells for the batch: the runner must shrink the batch or shift a sequence."""


class ShiftError(CacheError):
    """remove() could not move later positions down; clear the sequence with remove(seq, 0) and reprocess."""


@dataclass(frozen=True)
class CacheConfig:
    """How the backend wants the history laid out (Ollama's ml.CacheConfig).

    padding: the history that get() returns (and the number of cells) is a multiple of this, so the
    graph's shapes change only every `padding` tokens. permuted_v: V is stored transposed (cells
    fastest), the layout the matmul attention path wants. mask_dtype: F16 for flash attention.
    The defaults are the plain layout a model asks for with set_config(CacheConfig()).
    """

    padding: int = 1
    permuted_v: bool = False
    mask_dtype: DType = DType.F32

    def __post_init__(self) -> None:
        if self.padding < 1:
            raise ValueError(f"cache padding must be at least 1, got {self.padding}")
        if self.mask_dtype not in (DType.F32, DType.F16):
            raise ValueError(f"mask dtype must be F32 or F16, got {self.mask_dtype.name}")


def backend_cache_config(backend: Backend) -> CacheConfig:
    """The ggml backend's preference: padded to 256; an F16 mask with flash attention, else permuted V."""
    if backend.flash_attention:
        return CacheConfig(padding=256, mask_dtype=DType.F16)
    return CacheConfig(padding=256, permuted_v=True)


class Cache(Protocol):
    """What every cache offers (Ollama's kvcache.Cache)."""

    config: CacheConfig

    def set_config(self, config: CacheConfig) -> None:
        """Override the backend's layout; only before init()."""

    def init(self, backend: Backend, dtype: DType, max_sequences: int, capacity: int, max_batch: int,
             value_dtype: DType | None = None) -> None:
        """Size the cache for max_sequences sequences of `capacity` tokens each, in batches of max_batch;
        keys of type dtype, values of value_dtype (default: dtype)."""

    def close(self) -> None: ...

    def set_layer(self, layer: int) -> None:
        """Select the layer that the next put() and get() work on."""

    def put(self, ctx: Context, key: Tensor, value: Tensor) -> None:
        """Store the batch's key (k_head_dim, kv_heads, batch) and value (v_head_dim, kv_heads, batch)."""

    def rotations(self, ctx: Context, k_dim: int, v_dim: int) -> tuple[Tensor | None, Tensor | None]:
        """Rotations (Walsh-Hadamard matrices) to apply to queries and keys, and to values, before put()
        (and to the attention output after); None for none."""

    def get(self, ctx: Context) -> list[Segment]:
        """The history visible to the batch, one segment per sequence in it."""

    def prepare(self, batch: Batch, reserve: bool = False) -> Hashable:
        """Place the batch in the cache and return the layout a graph for it depends on."""

    def bind(self, ctx: Context) -> None:
        """Give ctx the mask and cell-index inputs of the prepared batch."""

    def repeat(self, ctx: Context) -> bool:
        """Place the prepared batch of decode steps again, each row one position on, in place (ctx's inputs too,
        ctx bound last); False, with nothing changed, where prepare() must place the next batch."""

    def start_forward(self, ctx: Context, batch: Batch, reserve: bool = False) -> None:
        """prepare() then bind(); reserve sizes a worst-case graph without touching the bookkeeping."""

    def copy_prefix(self, source: int, destination: int, length: int) -> None:
        """Let `destination` share `source`'s cells for positions below `length`."""

    def can_resume(self, seq: int, position: int) -> bool:
        """Whether the sequence can continue at `position` with the history the cache still holds."""

    def remove(self, seq: int, begin: int, end: int | None = None) -> None:
        """Drop positions [begin, end) of seq (end None: to the end) and move later ones down.

        Raises ShiftError when later positions cannot be moved; remove(seq, 0) never raises.
        """
