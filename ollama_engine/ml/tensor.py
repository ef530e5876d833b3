"""Tensor: a node of a ggml graph, with the operations model code needs.

Shapes are in ggml order, fastest dimension first: a batch of 7 hidden states of width 64 has shape
(64, 7), and its numpy array shape (7, 64). Every operation checks its operands' shapes and types in
Python first and raises ShapeError, because ggml aborts the whole process on a failed assertion.

Operations build graph nodes in the graph context of whichever operand belongs to one (weights belong
to none), so `weight.matmul(x)` lands in x's graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ollama_engine import ggml
from ollama_engine.ggml import GGMLType, ops

if TYPE_CHECKING:
    from .context import Context

DType = GGMLType


class ShapeError(ValueError):
    """Operands whose shapes or types ggml would reject."""


@dataclass(frozen=True)
class RopeOptions:
    """RoPE variant and YaRN parameters (ggml's defaults: original context 128K, attention factor 1)."""

    neox: bool = False
    original_context: int = 131072
    extrapolation_factor: float = 0.0
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def _epsilon(op: str, eps: float) -> float:
    """ggml asserts eps >= 0 (a NaN fails too): a model file's bad epsilon is refused here instead."""
    if not eps >= 0:
        raise ShapeError(f"{op}: epsilon {eps} must be a non-negative number")
    return eps


def _pad4(shape: Sequence[int]) -> list[int]:
    return list(shape) + [1] * (4 - len(shape))


class Tensor:
    """A ggml tensor handle plus the graph context that new nodes go to (None for weights)."""

    __slots__ = ("ctx", "handle")

    def __init__(self, ctx: Context | None, handle):
        self.ctx = ctx
        self.handle = handle

    def in_graph(self, ctx: Context) -> Tensor:
        """This tensor, with the nodes of operations on it going to ctx's graph: for operations on a weight
        alone (its transpose), which belongs to no graph."""
        return Tensor(ctx, self.handle)

    # ------------------------------------------------------------ metadata

    @property
    def shape(self) -> tuple[int, ...]:
        return ggml.shape(self.handle)

    @property
    def ne(self) -> tuple[int, int, int, int]:
        """All four dimensions, trailing ones included."""
        return ggml.full_shape(self.handle)

    @property
    def strides(self) -> tuple[int, int, int, int]:
        """Byte strides nb[0..3]."""
        return ggml.strides(self.handle)

    @property
    def dtype(self) -> DType:
        return DType(ggml.tensor_type(self.handle))

    @property
    def storage(self) -> int:
        """Names the memory the tensor uses, its own or that of the tensor it views (a weight and its views)."""
        return ggml.storage_address(self.handle)

    @property
    def name(self) -> str:
        return ggml.get_name(self.handle)

    @property
    def nbytes(self) -> int:
        return ggml.nbytes(self.handle)

    def dim(self, n: int) -> int:
        return self.ne[n]

    def element_count(self) -> int:
        return math.prod(self.ne)

    def set_name(self, name: str) -> Tensor:
        ggml.set_name(self.handle, name)
        return self

    def __repr__(self) -> str:
        return f"Tensor({self.name or '?'}, {self.dtype.name}, shape={self.shape})"

    # ------------------------------------------------------------ data

    def numpy(self, copy: bool = True) -> np.ndarray:
        """The computed or stored values; numpy's shape is the ggml shape reversed.

        copy=False returns a view of the tensor's memory when it is in host memory (else a copy): valid
        only until that memory is written again, e.g. by the graph's next compute.
        """
        if not ggml.has_storage(self.handle):
            raise RuntimeError(f"{self!r} has no memory: compute its graph (or load the model) first")
        view = None if copy else ggml.host_view(self.handle)
        return view if view is not None else ggml.read(self.handle)

    def set(self, values: np.ndarray) -> None:
        """Write values into a tensor that has memory (a weight, a cache tensor, a computed input)."""
        values = np.asarray(values)
        if values.nbytes != self.nbytes:
            raise ShapeError(f"{values.nbytes} bytes of data for {self!r} of {self.nbytes} bytes")
        ggml.write(self.handle, values)

    # ------------------------------------------------------------ helpers

    def _graph(self, *others: Tensor | None) -> Context:
        for t in (self, *others):
            if t is not None and t.ctx is not None:
                return t.ctx
        raise RuntimeError("an operation needs at least one operand that belongs to a graph context")

    def _new(self, handle, *others: Tensor | None) -> Tensor:
        return Tensor(self._graph(*others), handle)

    def _check_broadcast(self, other: Tensor, op: str) -> None:
        if any(a % b for a, b in zip(self.ne, other.ne, strict=True)):
            raise ShapeError(f"{op}: {other.shape} does not broadcast to {self.shape}")

    # ------------------------------------------------------------ arithmetic

    def add(self, other: Tensor) -> Tensor:
        self._check_broadcast(other, "add")
        return self._new(ops.add(self._graph(other).handle, self.handle, other.handle), other)

    def sub(self, other: Tensor) -> Tensor:
        self._check_broadcast(other, "sub")
        return self._new(ops.sub(self._graph(other).handle, self.handle, other.handle), other)

    def mul(self, other: Tensor) -> Tensor:
        self._check_broadcast(other, "mul")
        return self._new(ops.mul(self._graph(other).handle, self.handle, other.handle), other)

    def div(self, other: Tensor) -> Tensor:
        self._check_broadcast(other, "div")
        return self._new(ops.div(self._graph(other).handle, self.handle, other.handle), other)

    def scale(self, factor: float, bias: float = 0.0) -> Tensor:
        """self * factor + bias."""
        if bias:
            return self._new(ops.scale_bias(self._graph().handle, self.handle, factor, bias))
        return self._new(ops.scale(self._graph().handle, self.handle, factor))

    def matmul(self, other: Tensor) -> Tensor:
        """self (K, M, ...) times other (K, N, ...) -> (M, N, ...): ggml's mul_mat, rows against rows."""
        a, b = self.ne, other.ne
        if a[0] != b[0] or b[2] % a[2] or b[3] % a[3]:
            raise ShapeError(f"matmul: {self.shape} x {other.shape}: inner dimensions differ or batch dims mismatch")
        ctx = self._graph(other)
        limits = ctx.matmul_row_limits
        limit = limits.get(self.storage) if limits else None
        if limit is not None and a[2] == a[3] == 1 and b[1] * b[2] * b[3] > limit:
            return self._matmul_in_pieces(ctx, other, limit)
        return self._new(ops.mul_mat(ctx.handle, self.handle, other.handle), other)

    def _matmul_in_pieces(self, ctx: Context, other: Tensor, rows: int) -> Tensor:
        """self (K, M) times other's rows, at most `rows` of them per product, joined in order."""
        k, total = other.ne[0], other.ne[1] * other.ne[2] * other.ne[3]
        x = other.packed().reshape(k, total)
        out = None
        for begin in range(0, total, rows):
            piece = x.view(x.strides[1] * begin, (k, min(rows, total - begin)))
            product = Tensor(ctx, ops.mul_mat(ctx.handle, self.handle, piece.handle))
            out = product if out is None else out.concat(product, 1)
        return out.reshape(self.ne[1], *other.ne[1:])

    def matmul_full_precision(self, other: Tensor) -> Tensor:
        out = self.matmul(other)
        ops.mul_mat_set_prec(out.handle, ops.PREC_F32)
        return out

    def hadamard(self, matrix: Tensor) -> Tensor:
        """Rotate every n-wide group of the fastest dimension by the Walsh-Hadamard matrix (n, n).

        The matrix must be hadamard_matrix(n): ggml's CPU and CUDA backends compute the product as a
        fast transform (O(n log n)) without reading it. The matrix is its own inverse.
        """
        n = matrix.ne[0]
        if matrix.ne[:2] != (n, n) or n & (n - 1) or self.ne[0] % n or matrix.dtype != DType.F32:
            raise ShapeError(f"hadamard: {self.shape} by {matrix.shape} ({matrix.dtype.name})")
        rows = self.packed().reshape(n, self.element_count() // n)
        ctx = self._graph(matrix)
        rotated = Tensor(ctx, ops.mul_mat(ctx.handle, matrix.handle, rows.handle))
        ops.mul_mat_set_hint(rotated.handle, ops.HINT_SRC0_IS_HADAMARD)
        return rotated.reshape(*self.shape)

    def matmul_id(self, other: Tensor, ids: Tensor) -> Tensor:
        """Experts self (K, M, n_expert) applied to other (K, n_used or 1, N) as chosen by ids (n_used, N)."""
        if ids.dtype != DType.I32:
            raise ShapeError("matmul_id: ids must be I32")
        if (self.ne[0] != other.ne[0] or ids.ne[1] != other.ne[2] or other.ne[1] not in (1, ids.ne[0])
                or self.ne[3] != 1 or other.ne[3] != 1 or ids.ne[2:] != (1, 1)):  # ggml's asserts
            raise ShapeError(f"matmul_id: experts {self.shape}, input {other.shape}, ids {ids.shape}")
        ctx = self._graph(other, ids)
        return Tensor(ctx, ops.mul_mat_id(ctx.handle, self.handle, other.handle, ids.handle))

    def add_id(self, biases: Tensor, ids: Tensor) -> Tensor:
        """self (d, n_used, N) plus the bias rows (d, n_expert) that ids (n_used, N) choose: per-expert biases."""
        if ids.dtype != DType.I32 or biases.dtype != DType.F32:
            raise ShapeError("add_id: ids must be I32 and biases F32")
        if biases.ne[0] != self.ne[0] or ids.ne[:2] != self.ne[1:3] or self.ne[3] != 1:
            raise ShapeError(f"add_id: input {self.shape}, biases {biases.shape}, ids {ids.shape}")
        ctx = self._graph(biases, ids)
        return Tensor(ctx, ops.add_id(ctx.handle, self.handle, biases.handle, ids.handle))

    # ------------------------------------------------------------ rows

    def rows(self, indices: Tensor) -> Tensor:
        """Gather rows (dim 1) by I32 indices: an embedding lookup, or keeping the rows that need logits."""
        if indices.dtype != DType.I32:
            raise ShapeError("rows: indices must be I32")
        if indices.ne[1] != self.ne[2] or indices.ne[2] != 1 or self.ne[3] != 1:
            raise ShapeError(f"rows: cannot index {self.shape} with {indices.shape}")
        ctx = self._graph(indices)
        return Tensor(ctx, ops.get_rows(ctx.handle, self.handle, indices.handle))

    def set_rows(self, source: Tensor, indices: Tensor) -> Tensor:
        """Scatter source's rows into self at indices (I32 or I64); returns the updated view of self."""
        if indices.dtype not in (DType.I32, DType.I64):
            raise ShapeError("set_rows: indices must be I32 or I64")
        if source.dtype not in (DType.F32, DType.F16):
            raise ShapeError("set_rows: source must be F32 or F16")
        s, d, i = source.ne, self.ne, indices.ne
        if s[0] != d[0] or s[2:] != d[2:] or s[1] != i[0] or s[2] % i[1] or s[3] % i[2] or i[3] != 1:
            raise ShapeError(f"set_rows: {source.shape} into {self.shape} at {indices.shape}")
        ctx = self._graph(source, indices)
        return Tensor(ctx, ops.set_rows(ctx.handle, self.handle, source.handle, indices.handle))

    # ------------------------------------------------------------ normalisation

    def rms_norm(self, weight: Tensor | None, eps: float) -> Tensor:
        out = self._new(ops.rms_norm(self._graph().handle, self.handle, _epsilon("rms_norm", eps)))
        return out.mul(weight) if weight is not None else out

    def layer_norm(self, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
        out = self._new(ops.norm(self._graph().handle, self.handle, _epsilon("layer_norm", eps)))
        if weight is not None:
            out = out.mul(weight)
        return out.add(bias) if bias is not None else out

    def l2_norm(self, eps: float) -> Tensor:
        return self._new(ops.l2_norm(self._graph().handle, self.handle, _epsilon("l2_norm", eps)))

    # ------------------------------------------------------------ positions and attention

    def rope(
        self,
        positions: Tensor,
        dims: int,
        base: float,
        scale: float = 1.0,
        factors: Tensor | None = None,
        options: RopeOptions = RopeOptions(),  # noqa: B008 - frozen dataclass
        offset: int = 0,
    ) -> Tensor:
        """Rotate `dims` features of (head_dim, heads, tokens), the first ones or those from `offset` on, by
        positions (I32, tokens). An offset rotates one part of a head, the rest unchanged (2-D RoPE in
        vision towers: clip.cpp's build_rope_2d; ggml_rope_set_offset)."""
        if positions.dtype != DType.I32 or positions.ne[0] != self.ne[2]:
            raise ShapeError(f"rope: positions {positions.shape} for input {self.shape}")
        if offset < 0 or offset + dims > self.ne[0] or dims % 2:
            raise ShapeError(f"rope: {dims} rotary dims from {offset} for head size {self.ne[0]}")
        if factors is not None and factors.ne[0] < dims // 2:
            raise ShapeError(f"rope: frequency factors {factors.shape} shorter than {dims // 2}")
        source = self if self.dtype in (DType.F32, DType.F16) else self.cast(DType.F32)
        mode = ops.ROPE_TYPE_NEOX if options.neox else ops.ROPE_TYPE_NORMAL
        ctx = self._graph(positions)
        handle = ops.rope_ext(
            ctx.handle, source.handle, positions.handle, factors.handle if factors is not None else ggml.NULL,
            dims, mode, options.original_context, base, scale, options.extrapolation_factor,
            options.attention_factor, options.beta_fast, options.beta_slow,
        )
        if offset:
            ops.rope_set_offset(handle, offset)
        return Tensor(ctx, handle)

    def rope_multi(self, positions: Tensor, dims: int, sections: Sequence[int], base: float,
                   options: RopeOptions = RopeOptions(),  # noqa: B008 - frozen dataclass
                   interleaved: bool = True, vision: bool = False) -> Tensor:
        """Multimodal RoPE (ggml_rope_multi) of (head_dim, heads, tokens): positions (I32, 4 * tokens) hold
        each token's 4 position components, sections (4) how many rotated pairs each component drives;
        interleaved: the components take turns over the pairs (IMROPE, Qwen3-VL and Qwen3.5), else each
        drives a run of consecutive pairs (MROPE, Qwen2-VL and Qwen2.5-VL); vision: ggml's VISION mode, a
        Qwen2-VL tower's 2-D rotation (dims half the head: each pair i turns with pair i + dims)."""
        if positions.dtype != DType.I32 or positions.ne[0] != 4 * self.ne[2] or len(sections) != 4:
            raise ShapeError(f"rope_multi: positions {positions.shape} and sections {tuple(sections)} for input "
                             f"{self.shape}: 4 positions per token, 4 sections")
        if dims > self.ne[0] or dims % 2 or (vision and dims * 2 != self.ne[0]):
            raise ShapeError(f"rope_multi: {dims} rotary dims for head size {self.ne[0]}")
        mode = ops.ROPE_TYPE_VISION if vision else ops.ROPE_TYPE_IMROPE if interleaved else ops.ROPE_TYPE_MROPE
        ctx = self._graph(positions)
        handle = ops.rope_multi(
            ctx.handle, self.handle, positions.handle, ggml.NULL, dims, [int(s) for s in sections],
            mode, options.original_context, base, 1.0,
            options.extrapolation_factor, options.attention_factor, options.beta_fast, options.beta_slow,
        )
        return Tensor(ctx, handle)

    def softmax(self, mask: Tensor | None = None, scale: float = 1.0, sinks: Tensor | None = None) -> Tensor:
        """softmax(self * scale + mask) along rows; sinks (F32, one per head: dim 2) add a logit to each
        head's denominator that takes probability without a value (gpt-oss's attention sinks)."""
        if mask is not None:
            if (mask.dtype not in (DType.F32, DType.F16) or mask.ne[0] != self.ne[0] or mask.ne[1] < self.ne[1]
                    or self.ne[2] % mask.ne[2] or self.ne[3] % mask.ne[3]):
                raise ShapeError(f"softmax: mask {mask.shape} for scores {self.shape}")
        _check_sinks(sinks, self.ne[2], "softmax")
        ctx = self._graph(mask, sinks)
        handle = ops.soft_max_ext(ctx.handle, self.handle, mask.handle if mask is not None else ggml.NULL, scale, 0.0)
        if sinks is not None:
            ops.soft_max_add_sinks(handle, sinks.handle)
        return Tensor(ctx, handle)

    def flash_attention(
        self, key: Tensor, value: Tensor, mask: Tensor | None, scale: float, softcap: float = 0.0,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Fused attention; q (d, n_q, heads[, m]), k/v (d, n_kv, kv_heads[, m]) -> (d_v, heads, n_q[, m]).

        softcap > 0 caps the scores as softcap * tanh(scores / softcap) before the softmax (Gemma 2);
        sinks as softmax's.
        """
        q, k, v = self.ne, key.ne, value.ne
        if q[0] != k[0] or k[1] != v[1] or q[2] % k[2] or k[2] != v[2] or not q[3] == k[3] == v[3]:
            raise ShapeError(f"flash_attention: q {self.shape}, k {key.shape}, v {value.shape}")
        if mask is not None and (mask.dtype != DType.F16 or mask.ne[0] != k[1] or mask.ne[1] < q[1]
                                 or q[2] % mask.ne[2] or q[3] % mask.ne[3] or not ggml.is_contiguous(mask.handle)):
            raise ShapeError(f"flash_attention: mask {mask.shape} ({mask.dtype.name}) needs F16 ({k[1]}, >={q[1]}), "
                             f"contiguous, its heads and slices dividing the query's {q[2]}, {q[3]}")
        _check_sinks(sinks, q[2], "flash_attention")
        ctx = self._graph(key, value, mask, sinks)
        handle = ops.flash_attn_ext(
            ctx.handle, self.handle, key.handle, value.handle, mask.handle if mask is not None else ggml.NULL,
            scale, 0.0, softcap,
        )
        if sinks is not None:
            ops.flash_attn_ext_add_sinks(handle, sinks.handle)
        ops.flash_attn_ext_set_prec(handle, ops.PREC_F32)
        return Tensor(ctx, handle)

    # ------------------------------------------------------------ activations

    def silu(self, up: Tensor | None = None) -> Tensor:
        """silu(self), or the gated silu(self) * up."""
        if up is None:
            return self._new(ops.silu(self._graph().handle, self.handle))
        if up.ne != self.ne:
            raise ShapeError(f"silu: gate {self.shape} and up {up.shape} differ")
        return self._new(ops.swiglu_split(self._graph(up).handle, self.handle, up.handle), up)

    def swiglu_oai(self, up: Tensor, alpha: float, limit: float) -> Tensor:
        """gpt-oss's gated activation: x * sigmoid(alpha * x) * (y + 1), x = min(self, limit), y = clamp(up, ±limit)."""
        if up.ne != self.ne:
            raise ShapeError(f"swiglu_oai: gate {self.shape} and up {up.shape} differ")
        return self._new(ops.swiglu_oai(self._graph(up).handle, self.handle, up.handle, alpha, limit), up)

    def gelu(self, up: Tensor | None = None) -> Tensor:
        """gelu(self) (tanh approximation), or the gated gelu(self) * up."""
        if up is None:
            return self._new(ops.gelu(self._graph().handle, self.handle))
        if up.ne != self.ne:
            raise ShapeError(f"gelu: gate {self.shape} and up {up.shape} differ")
        return self._new(ops.geglu_split(self._graph(up).handle, self.handle, up.handle), up)

    def gelu_erf(self) -> Tensor:
        return self._new(ops.gelu_erf(self._graph().handle, self.handle))

    def relu(self) -> Tensor:
        return self._new(ops.relu(self._graph().handle, self.handle))

    def softplus(self) -> Tensor:
        return self._new(ops.softplus(self._graph().handle, self.handle))

    def sigmoid(self) -> Tensor:
        return self._new(ops.sigmoid(self._graph().handle, self.handle))

    def tanh(self) -> Tensor:
        return self._new(ops.tanh(self._graph().handle, self.handle))

    def exp(self) -> Tensor:
        return self._new(ops.exp(self._graph().handle, self.handle))

    def log(self) -> Tensor:
        return self._new(ops.log(self._graph().handle, self.handle))

    def floor(self) -> Tensor:
        return self._new(ops.floor(self._graph().handle, self.handle))

    def sqr(self) -> Tensor:
        return self._new(ops.sqr(self._graph().handle, self.handle))

    def sqrt(self) -> Tensor:
        return self._new(ops.sqrt(self._graph().handle, self.handle))

    def neg(self) -> Tensor:
        return self._new(ops.neg(self._graph().handle, self.handle))

    def clamp(self, low: float, high: float) -> Tensor:
        return self._new(ops.clamp(self._graph().handle, self.handle, low, high))

    # ------------------------------------------------------------ reductions and sorting

    def sum_rows(self) -> Tensor:
        return self._new(ops.sum_rows(self._graph().handle, self.handle))

    def mean(self) -> Tensor:
        return self._new(ops.mean(self._graph().handle, self.handle))

    def argsort(self, descending: bool = False) -> Tensor:
        order = ops.SORT_DESC if descending else ops.SORT_ASC
        return self._new(ops.argsort(self._graph().handle, self.handle, order))

    def argsort_top_k(self, k: int) -> Tensor:
        """Indices of the k largest values of each row, largest first (a view of the descending argsort)."""
        if not 0 < k <= self.ne[0]:
            raise ShapeError(f"argsort_top_k: k={k} for rows of {self.ne[0]}")
        return self._new(ops.argsort_top_k(self._graph().handle, self.handle, k))

    def top_k(self, k: int) -> Tensor:
        """Indices of the k largest values of each row (in no particular order)."""
        if not 0 < k <= self.ne[0]:
            raise ShapeError(f"top_k: k={k} for rows of {self.ne[0]}")
        return self._new(ops.top_k(self._graph().handle, self.handle, k))

    # ------------------------------------------------------------ layout

    def reshape(self, *shape: int) -> Tensor:
        """Same elements, new shape; one dimension may be -1 (inferred). Needs a contiguous tensor."""
        shape = self._infer_shape(shape)
        if not ggml.is_contiguous(self.handle):
            raise ShapeError(f"reshape: {self!r} is not contiguous; call contiguous() first")
        ctx = self._graph().handle
        ne = _pad4(shape)
        functions = (ops.reshape_1d, ops.reshape_2d, ops.reshape_3d, ops.reshape_4d)
        return self._new(functions[len(shape) - 1](ctx, self.handle, *ne[: len(shape)]))

    def _infer_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        if not 1 <= len(shape) <= 4:
            raise ShapeError(f"shapes have 1 to 4 dimensions, got {tuple(shape)}")
        total = self.element_count()
        if shape.count(-1) == 1:
            known = math.prod(d for d in shape if d != -1)
            if known <= 0 or total % known:
                raise ShapeError(f"cannot infer -1 in {tuple(shape)} for {total} elements")
            shape = tuple(total // known if d == -1 else d for d in shape)
        if any(d < 1 for d in shape) or math.prod(shape) != total:
            raise ShapeError(f"cannot reshape {self.shape} ({total} elements) to {tuple(shape)}")
        return tuple(shape)

    def view(self, offset: int, shape: Sequence[int], strides: Sequence[int] = ()) -> Tensor:
        """A window onto self: `shape` elements, byte `strides` nb1..nb(n-1) (default: self's), from byte offset."""
        n = len(shape)
        if not 1 <= n <= 4:
            raise ShapeError(f"view: 1 to 4 dimensions, got {tuple(shape)}")
        nb = list(strides) if strides else list(self.strides[1:n])
        if len(nb) != n - 1:
            raise ShapeError(f"view: {n} dimensions need {n - 1} strides, got {len(nb)}")
        row = ggml.row_size(self.dtype, shape[0])
        extent = offset + row + sum((d - 1) * s for d, s in zip(shape[1:], nb, strict=True))
        if offset < 0 or extent > self.nbytes:
            raise ShapeError(f"view: bytes {offset}..{extent} outside {self!r} of {self.nbytes} bytes")
        ctx = self._graph().handle
        if n == 1:
            handle = ops.view_1d(ctx, self.handle, shape[0], offset)
        elif n == 2:
            handle = ops.view_2d(ctx, self.handle, shape[0], shape[1], nb[0], offset)
        elif n == 3:
            handle = ops.view_3d(ctx, self.handle, shape[0], shape[1], shape[2], nb[0], nb[1], offset)
        else:
            handle = ops.view_4d(ctx, self.handle, *shape, *nb, offset)
        return self._new(handle)

    def permute(self, *axes: int) -> Tensor:
        """Move dimension i to position axes[i] (ggml's convention); e.g. permute(0, 2, 1, 3) swaps 1 and 2."""
        axes = tuple(axes) + tuple(range(len(axes), 4))
        if sorted(axes) != [0, 1, 2, 3]:
            raise ShapeError(f"permute: {axes} is not a permutation of 0..3")
        return self._new(ops.permute(self._graph().handle, self.handle, *axes))

    def transpose(self) -> Tensor:
        return self._new(ops.transpose(self._graph().handle, self.handle))

    def packed(self) -> Tensor:
        """self where its elements are already packed in order (reshape() takes it), else a packed copy."""
        return self if ggml.is_contiguous(self.handle) else self.contiguous()

    def contiguous(self, *shape: int) -> Tensor:
        """A packed copy, optionally reshaped to `shape`."""
        out = self._new(ops.cont(self._graph().handle, self.handle))
        return out.reshape(*shape) if shape else out

    def cast(self, dtype: DType) -> Tensor:
        return self._new(ops.cast(self._graph().handle, self.handle, int(dtype)))

    def copy_to(self, destination: Tensor) -> Tensor:
        """Copy (converting type) into destination, which must have the same number of elements."""
        if self.element_count() != destination.element_count():
            raise ShapeError(f"copy: {self.shape} into {destination.shape}")
        ctx = self._graph(destination)
        return Tensor(ctx, ops.cpy(ctx.handle, self.handle, destination.handle))

    def concat(self, other: Tensor, dim: int) -> Tensor:
        others_differ = any(a != b for i, (a, b) in enumerate(zip(self.ne, other.ne, strict=True)) if i != dim)
        if self.dtype != other.dtype or others_differ:
            raise ShapeError(f"concat: {self.shape} and {other.shape} along {dim}")
        ctx = self._graph(other)
        return Tensor(ctx, ops.concat(ctx.handle, self.handle, other.handle, dim))

    def ssm_conv(self, kernel: Tensor) -> Tensor:
        """A causal depthwise convolution over time (ggml_ssm_conv): self (kernel + tokens - 1, channels,
        sequences) holds each channel's past inputs then its new ones along dim 0; kernel (width, channels)
        is F32. Returns (channels, tokens, sequences)."""
        k, x = kernel.ne, self.ne
        if kernel.dtype != DType.F32 or self.dtype != DType.F32 or k[1] != x[1] or x[0] < k[0] or k[2:] != (1, 1):
            raise ShapeError(f"ssm_conv: input {self.shape} ({self.dtype.name}) with kernel {kernel.shape} "
                             f"({kernel.dtype.name}); both F32, the kernel (width, channels)")
        ctx = self._graph(kernel)
        return Tensor(ctx, ops.ssm_conv(ctx.handle, self.handle, kernel.handle))

    def ssm_scan(self, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, ids: Tensor) -> Tensor:
        """Mamba-2's selective scan (ggml_ssm_scan) from the states self (d_state, head_dim, heads, slots),
        contiguous, slot ids[s] for sequence s: x (head_dim, heads, tokens, sequences), dt (heads, tokens,
        sequences), a (1, heads), b and c (d_state, groups, tokens, sequences), ids (sequences,) I32.
        Returns y then the sequences' new states, flat: x's element count + d_state * head_dim * heads * sequences."""
        s, xs = self.ne, x.ne
        if (s[1:3] != xs[0:2] or dt.ne[:3] != (xs[1], xs[2], xs[3]) or a.ne[:2] != (1, xs[1]) or b.ne != c.ne
                or b.ne[0] != s[0] or b.ne[2:] != xs[2:] or xs[1] % b.ne[1] or ids.ne[0] != xs[3]
                or ids.dtype != DType.I32):
            raise ShapeError(f"ssm_scan: states {self.shape}, x {x.shape}, dt {dt.shape}, A {a.shape}, "
                             f"B {b.shape}, C {c.shape}, ids {ids.shape} do not fit together")
        ctx = self._graph(x)
        return Tensor(ctx, ops.ssm_scan(ctx.handle, self.handle, x.handle, dt.handle, a.handle, b.handle, c.handle,
                                        ids.handle, 1))

    def gated_delta_net(self, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        """The gated delta rule (ggml_gated_delta_net) with self the queries: q and k (S, key heads, tokens,
        sequences), v (S, heads, tokens, sequences), heads a multiple of key heads (value head h reads key
        head h mod key heads), g and beta (1, heads, tokens, sequences), state (S, S, heads, sequences), all
        F32, g beta and state contiguous. Returns (S * heads, tokens * sequences + S * sequences): the
        outputs, then the new states."""
        q, shape = self.ne, v.ne
        if (q[0] != shape[0] or q[2:] != shape[2:] or shape[1] % q[1] or k.ne != q or g.ne != (1, *shape[1:])
                or beta.ne != g.ne
                or state.ne != (shape[0], shape[0], shape[1], shape[3])
                or any(t.dtype != DType.F32 for t in (self, k, v, g, beta, state))):
            raise ShapeError(f"gated_delta_net: q {self.shape}, k {k.shape}, v {v.shape}, g {g.shape}, "
                             f"beta {beta.shape}, state {state.shape} do not fit together")
        ctx = self._graph(k)
        return Tensor(ctx, ops.gated_delta_net(ctx.handle, self.handle, k.handle, v.handle, g.handle, beta.handle,
                                               state.handle, 1))

    def conv2d(self, image: Tensor, stride: int, padding: int = 0) -> Tensor:
        """self, a kernel (width, height, channels, filters) of F32 or F16, slid over image (width, height,
        channels, images) by `stride` with `padding` zeros around it (ggml_conv_2d: im2col then a matmul):
        (out width, out height, filters, images). A ViT's patch embedding is the kernel at its own stride."""
        k, x = self.ne, image.ne
        if self.dtype not in (DType.F32, DType.F16) or k[2] != x[2] or stride < 1 or padding < 0 or (
                x[0] + 2 * padding < k[0] or x[1] + 2 * padding < k[1]):
            raise ShapeError(f"conv2d: kernel {self.shape} ({self.dtype.name}) over {image.shape}, stride {stride}")
        ctx = image._graph(self)
        return Tensor(ctx, ops.conv_2d(ctx.handle, self.handle, image.handle, stride, stride, padding, padding, 1, 1))

    def im2col(self, image: Tensor, stride: int, dtype: DType = DType.F32) -> Tensor:
        """The kernel-sized windows of image (width, height, channels, images) at `stride`, each one flattened
        (ggml_im2col, 2-D, no padding; only self's shape (kernel width, height, channels) is read):
        (channels * kernel height * kernel width, out width, out height, images). A patch merger's unfold."""
        k, x = self.ne, image.ne
        if k[2] != x[2] or stride < 1 or x[0] < k[0] or x[1] < k[1] or dtype not in (DType.F32, DType.F16):
            raise ShapeError(f"im2col: kernel {self.shape} over {image.shape}, stride {stride}, {dtype.name}")
        ctx = image._graph(self)
        handle = ops.im2col(ctx.handle, self.handle, image.handle, stride, stride, 0, 0, 1, 1, True, int(dtype))
        return Tensor(ctx, handle)

    def avg_pool2d(self, kernel: int) -> Tensor:
        """The mean of each kernel x kernel square of dims 0 and 1, squares side by side (stride = kernel)."""
        if kernel < 1 or self.ne[0] < kernel or self.ne[1] < kernel:
            raise ShapeError(f"avg_pool2d: kernel {kernel} for {self.shape}")
        return self._new(ops.pool_2d(self._graph().handle, self.handle, ops.POOL_AVG, kernel, kernel, kernel, kernel,
                                     0.0, 0.0))

    def pad(self, *amounts: int) -> Tensor:
        """Zero-pad at the end of each dimension by amounts (p0, p1, p2, p3)."""
        if len(amounts) > 4 or any(p < 0 for p in amounts):
            raise ShapeError(f"pad: amounts {amounts} must be up to 4 non-negative numbers")
        padded = list(amounts) + [0] * (4 - len(amounts))
        return self._new(ops.pad(self._graph().handle, self.handle, *padded))

    def repeat_to(self, *shape: int) -> Tensor:
        """Tile self to `shape` (each of self's dimensions must divide the new one)."""
        ne = _pad4(shape)
        if len(shape) > 4 or any(n % m for n, m in zip(ne, self.ne, strict=True)):
            raise ShapeError(f"repeat_to: {self.shape} does not tile {tuple(shape)}")
        return self._new(ops.repeat_4d(self._graph().handle, self.handle, *ne))

    def repeat(self, like: Tensor) -> Tensor:
        """Tile self to like's shape."""
        like._check_broadcast(self, "repeat")
        ctx = self._graph(like)
        return Tensor(ctx, ops.repeat(ctx.handle, self.handle, like.handle))


def _check_sinks(sinks: Tensor | None, heads: int, op: str) -> None:
    if sinks is not None and (sinks.dtype != DType.F32 or sinks.shape != (heads,)):
        raise ShapeError(f"{op}: sinks {sinks.shape} ({sinks.dtype.name}) need one F32 per head ({heads})")


def hadamard_matrix(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of size n (a power of two), Sylvester's construction."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power of two, got {n}")
    matrix = np.full((1, 1), np.float32(1.0 / float(np.sqrt(np.float32(n)))), dtype=np.float32)
    while len(matrix) < n:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix
