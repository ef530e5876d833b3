"""cffi bindings to ggml: the only package that touches the C API.

Everything above this package handles ggml objects (contexts, tensors, buffers, devices) as opaque
handles and calls the functions exported here. `ops` holds the graph operations, `backend` devices,
buffers and the scheduler, and this module the data types, tensor metadata and data transfer.

ggml orders dimensions fastest first: a tensor of shape (ne0, ne1) has ne1 rows of ne0 elements, the
numpy array of it has shape (ne1, ne0).
"""

from __future__ import annotations

import enum
import logging

import numpy as np

try:
    from ._ggml_cffi import ffi, lib
except ImportError as err:  # pragma: no cover - exercised only on a machine without a build
    raise ImportError(
        "the ggml bindings are not built: run `python build_ggml.py` in the repository root"
    ) from err

NULL = ffi.NULL
MAX_DIMS = 4

# ---------------------------------------------------------------- logging

_log = logging.getLogger("ggml")
_LEVELS = {lib.GGML_LOG_LEVEL_DEBUG: logging.DEBUG, lib.GGML_LOG_LEVEL_INFO: logging.DEBUG,
           lib.GGML_LOG_LEVEL_WARN: logging.WARNING, lib.GGML_LOG_LEVEL_ERROR: logging.ERROR}
_last_level = [logging.DEBUG]  # GGML_LOG_LEVEL_CONT continues the previous message's level


@ffi.callback("ggml_log_callback")
def _on_log(level: int, text, user_data) -> None:
    """ggml's messages go to the `ggml` logger (its info is our debug: per-tensor repacking, buffers)."""
    if level != lib.GGML_LOG_LEVEL_CONT:
        _last_level[0] = _LEVELS.get(level, logging.DEBUG)
    if _log.isEnabledFor(_last_level[0]):
        _log.log(_last_level[0], ffi.string(text).decode("utf-8", errors="replace").rstrip())


lib.ggml_log_set(_on_log, NULL)


class GGMLType(enum.IntEnum):
    """The ggml tensor types the engine reads, stores or computes with (values from ggml.h)."""

    F32 = lib.GGML_TYPE_F32
    F16 = lib.GGML_TYPE_F16
    Q4_0 = lib.GGML_TYPE_Q4_0
    Q4_1 = lib.GGML_TYPE_Q4_1
    Q5_0 = lib.GGML_TYPE_Q5_0
    Q5_1 = lib.GGML_TYPE_Q5_1
    Q8_0 = lib.GGML_TYPE_Q8_0
    Q2_K = lib.GGML_TYPE_Q2_K
    Q3_K = lib.GGML_TYPE_Q3_K
    Q4_K = lib.GGML_TYPE_Q4_K
    Q5_K = lib.GGML_TYPE_Q5_K
    Q6_K = lib.GGML_TYPE_Q6_K
    Q8_K = lib.GGML_TYPE_Q8_K
    IQ2_XXS = lib.GGML_TYPE_IQ2_XXS
    IQ2_XS = lib.GGML_TYPE_IQ2_XS
    IQ3_XXS = lib.GGML_TYPE_IQ3_XXS
    IQ1_S = lib.GGML_TYPE_IQ1_S
    IQ4_NL = lib.GGML_TYPE_IQ4_NL
    IQ3_S = lib.GGML_TYPE_IQ3_S
    IQ2_S = lib.GGML_TYPE_IQ2_S
    IQ4_XS = lib.GGML_TYPE_IQ4_XS
    I8 = lib.GGML_TYPE_I8
    I16 = lib.GGML_TYPE_I16
    I32 = lib.GGML_TYPE_I32
    I64 = lib.GGML_TYPE_I64
    F64 = lib.GGML_TYPE_F64
    IQ1_M = lib.GGML_TYPE_IQ1_M
    BF16 = lib.GGML_TYPE_BF16
    TQ1_0 = lib.GGML_TYPE_TQ1_0
    TQ2_0 = lib.GGML_TYPE_TQ2_0
    MXFP4 = lib.GGML_TYPE_MXFP4
    NVFP4 = lib.GGML_TYPE_NVFP4
    Q1_0 = lib.GGML_TYPE_Q1_0
    Q2_0 = lib.GGML_TYPE_Q2_0


NUMPY_TYPES: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype(np.float32),
    GGMLType.F16: np.dtype(np.float16),
    GGMLType.I8: np.dtype(np.int8),
    GGMLType.I16: np.dtype(np.int16),
    GGMLType.I32: np.dtype(np.int32),
    GGMLType.I64: np.dtype(np.int64),
    GGMLType.F64: np.dtype(np.float64),
}


def ggml_type_of(dtype: np.dtype) -> GGMLType:
    for ggml_type, numpy_type in NUMPY_TYPES.items():
        if numpy_type == dtype:
            return ggml_type
    raise TypeError(f"numpy dtype {dtype} has no ggml equivalent")


def type_name(ggml_type: int) -> str:
    return ffi.string(lib.ggml_type_name(ggml_type)).decode()


def block_size(ggml_type: int) -> int:
    return lib.ggml_blck_size(ggml_type)


def row_size(ggml_type: int, n: int) -> int:
    """Bytes of `n` consecutive elements; `n` must be a multiple of the type's block size."""
    if n % block_size(ggml_type):
        raise ValueError(f"{type_name(ggml_type)} rows must be a multiple of {block_size(ggml_type)} elements, got {n}")
    return lib.ggml_row_size(ggml_type, n)


def is_quantized(ggml_type: int) -> bool:
    return bool(lib.ggml_is_quantized(ggml_type))


def version() -> str:
    return ffi.string(lib.ggml_version()).decode()


# ---------------------------------------------------------------- contexts and tensor metadata


def new_context(n_tensors: int, graph_nodes: int = 0):
    """A metadata-only ggml context: tensors get their memory from backend buffers, never from it."""
    size = n_tensors * lib.ggml_tensor_overhead()
    if graph_nodes:
        size += lib.ggml_graph_overhead_custom(graph_nodes, False)
    params = ffi.new("struct ggml_init_params *", {"mem_size": size, "mem_buffer": NULL, "no_alloc": True})
    ctx = lib.ggml_init(params[0])
    if ctx == NULL:
        raise MemoryError(f"ggml_init failed for a context of {size} bytes")
    return ctx


def free_context(ctx) -> None:
    lib.ggml_free(ctx)


def context_has_room(ctx, n_tensors: int = 1) -> bool:
    used = lib.ggml_used_mem(ctx)
    return used + n_tensors * lib.ggml_tensor_overhead() <= lib.ggml_get_mem_size(ctx)


def new_tensor(ctx, ggml_type: int, shape: tuple[int, ...]):
    ne = ffi.new("int64_t[4]", list(shape))
    return lib.ggml_new_tensor(ctx, ggml_type, len(shape), ne)


def shape(t) -> tuple[int, ...]:
    """ne[0..n_dims): the shape, fastest dimension first; a scalar has shape (1,)."""
    return tuple(t.ne[0 : lib.ggml_n_dims(t)])


def full_shape(t) -> tuple[int, int, int, int]:
    return tuple(t.ne[0:4])


def strides(t) -> tuple[int, int, int, int]:
    return tuple(t.nb[0:4])


def tensor_type(t) -> int:
    return t.type


def node_kind(t) -> str:
    """A node's op, with its weight's type and shape for matmuls ("MUL_MAT q8_0 576x1536"): to profile by.

    t may also be the address of a ggml_tensor as an int (a node another library's callback handed over).
    """
    if isinstance(t, int):
        t = ffi.cast("struct ggml_tensor *", t)
    kind = ffi.string(lib.ggml_op_desc(t)).decode()
    if t.op in (lib.GGML_OP_MUL_MAT, lib.GGML_OP_MUL_MAT_ID):
        weight = t.src[0]
        kind += f" {type_name(weight.type)} " + "x".join(str(d) for d in weight.ne[0 : lib.ggml_n_dims(weight)])
    return kind


def nbytes(t) -> int:
    return lib.ggml_nbytes(t)


def is_contiguous(t) -> bool:
    return bool(lib.ggml_is_contiguous(t))


def set_name(t, name: str) -> None:
    lib.ggml_set_name(t, name.encode())


def get_name(t) -> str:
    return ffi.string(lib.ggml_get_name(t)).decode()


def mark_input(t) -> None:
    lib.ggml_set_input(t)


def mark_output(t) -> None:
    lib.ggml_set_output(t)


def has_storage(t) -> bool:
    """Whether the tensor (or what it views) lives in a backend buffer, so data can be read or written."""
    source = t.view_src if t.view_src != NULL else t
    return source.buffer != NULL and t.data != NULL


def storage_address(t) -> int:
    """The address of the tensor whose memory t uses (t itself, or what it views): names a weight's storage."""
    return int(ffi.cast("uintptr_t", t.view_src if t.view_src != NULL else t))


def set_buffer(t, buffer) -> None:
    """Attach a buffer without data: the scheduler then treats the tensor as allocated elsewhere (fit mode)."""
    t.buffer = buffer


# ---------------------------------------------------------------- data transfer


def write(t, array: np.ndarray, offset: int = 0) -> None:
    """Copy a C-contiguous array's bytes into the tensor's memory, whatever device it is on."""
    data = np.ascontiguousarray(array)
    if offset + data.nbytes > nbytes(t):
        raise ValueError(f"writing {data.nbytes} bytes at {offset} overflows tensor of {nbytes(t)} bytes")
    lib.ggml_backend_tensor_set(t, ffi.from_buffer(data), offset, data.nbytes)


def write_bytes(t, data, offset: int = 0) -> None:
    """Like write() for any buffer-protocol object (bytes, memoryview, mmap slices)."""
    buffer = ffi.from_buffer(data)
    lib.ggml_backend_tensor_set(t, buffer, offset, len(buffer))


def read(t) -> np.ndarray:
    """The tensor's contents as a new numpy array (numpy shape = reversed ggml shape)."""
    dtype = NUMPY_TYPES.get(t.type)  # per decoded token (the logits): no enum conversion
    if not is_contiguous(t):
        raise ValueError("read() needs a contiguous tensor; make it contiguous in the graph first")
    if dtype is not None:
        out = np.empty(tuple(reversed(shape(t))), dtype=dtype)
    else:
        out = np.empty(nbytes(t), dtype=np.uint8)
    lib.ggml_backend_tensor_get(t, ffi.from_buffer(out), 0, out.nbytes)
    return out


def host_bytes(t) -> memoryview | None:
    """The bytes of a contiguous tensor in a host buffer, writable in place (a file can be read straight
    into a weight); None for device memory and for layouts other than ggml's plain one (repacked)."""
    source = t.view_src if t.view_src != NULL else t
    if not has_storage(t) or not is_contiguous(t) or not lib.ggml_backend_buffer_is_host(source.buffer):
        return None
    return memoryview(ffi.buffer(ffi.cast("char *", t.data), nbytes(t)))


def host_view(t) -> np.ndarray | None:
    """The tensor's memory as a numpy array without copying, if it is contiguous host memory, else None.

    The view is only valid while the memory is: a graph output is overwritten by the graph's next run.
    """
    source = t.view_src if t.view_src != NULL else t
    dtype = NUMPY_TYPES.get(t.type)  # per decoded token: no enum conversion
    if (dtype is None or not has_storage(t) or not is_contiguous(t)
            or not lib.ggml_backend_buffer_is_host(source.buffer)):
        return None
    memory = ffi.buffer(ffi.cast("char *", t.data), nbytes(t))
    return np.frombuffer(memory, dtype=dtype).reshape(tuple(reversed(shape(t))))


# ---------------------------------------------------------------- quantization


def requires_importance(ggml_type: int) -> bool:
    """Whether ggml quantizes to this type only with an importance matrix (IQ2_XXS, IQ2_XS, IQ1_S)."""
    return bool(lib.ggml_quantize_requires_imatrix(ggml_type))


def quantize(ggml_type: int, data: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """Quantize rows of float32 (shape (rows, cols)) to `ggml_type`; returns the raw blocks as uint8.

    `importance` (cols,) weighs each column's rounding error, as llama-quantize's --imatrix does (the
    mean squared activation each column sees); the types of requires_importance() need one.
    """
    rows = np.ascontiguousarray(data, dtype=np.float32)
    if rows.ndim == 1:
        rows = rows[None, :]
    if rows.ndim != 2:
        raise ValueError(f"quantize takes a 2-D array of rows, got shape {data.shape}")
    n_rows, n_cols = rows.shape
    if type_name(ggml_type) in ("q8_1", "q8_K") or not block_size(ggml_type):
        raise ValueError(f"ggml cannot quantize to {type_name(ggml_type)}")
    out = np.empty(n_rows * row_size(ggml_type, n_cols), dtype=np.uint8)
    weights = NULL
    if importance is not None:
        importance = np.ascontiguousarray(importance, dtype=np.float32)
        if importance.shape != (n_cols,):
            raise ValueError(f"an importance matrix for rows of {n_cols} has shape ({n_cols},), got {importance.shape}")
        weights = ffi.cast("float *", ffi.from_buffer(importance))
    elif requires_importance(ggml_type):
        raise ValueError(f"{type_name(ggml_type)} needs an importance matrix")
    lib.ggml_quantize_init(ggml_type)
    written = lib.ggml_quantize_chunk(
        ggml_type, ffi.cast("float *", ffi.from_buffer(rows)), ffi.from_buffer(out), 0, n_rows, n_cols, weights
    )
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out
