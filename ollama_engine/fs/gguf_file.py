"""Reading a GGUF file: its metadata and where each tensor's bytes are.

The header, metadata and tensor infos are parsed here from a memory map, with the `gguf` package's
constants for type ids and block sizes, copied (importing `gguf` took 0.07 s of every runner's start,
with yaml; a test checks the copies). gguf.GGUFReader is not used for this: it builds one numpy
object per array element (14 s for the Llama-3 vocabulary, against well under a second here) and
fails on damaged files with raw IndexError/ValueError, or loops, instead of saying what is wrong.
Every problem with a file surfaces as a GGUFError naming the file and the problem.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any

import numpy as np

from ollama_engine.fs.config import Config


class GGUFValueType(IntEnum):
    """gguf.GGUFValueType: the type of a metadata value."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class GGMLQuantizationType(IntEnum):
    """gguf.GGMLQuantizationType: a tensor's ggml type id."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


# gguf.GGML_QUANT_SIZES: (elements per block, bytes per block), in GGMLQuantizationType's order
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = dict(zip(GGMLQuantizationType, (
    (1, 4), (1, 2), (32, 18), (32, 20), (32, 22), (32, 24), (32, 34), (32, 40), (256, 84), (256, 110), (256, 144),
    (256, 176), (256, 210), (256, 292), (256, 66), (256, 74), (256, 98), (256, 50), (32, 18), (256, 110), (256, 82),
    (256, 136), (1, 1), (1, 2), (1, 4), (1, 8), (1, 8), (256, 56), (1, 2), (256, 54), (256, 66), (32, 17), (64, 36),
    (128, 18),
), strict=True))
GGUF_DEFAULT_ALIGNMENT = 32

# The tensor types this engine can compute with: every type ggml's CPU backend multiplies by (the
# others, such as Q8_K, I32 or F64, are intermediate or index types, never weights).
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name] for name in (
        "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S "
        "IQ3_XXS IQ3_S IQ4_NL IQ4_XS TQ1_0 TQ2_0 MXFP4 NVFP4 Q1_0").split()
)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: ggml keeps tensor names in a 64-byte field, terminator included
INT64_MAX = (1 << 63) - 1  # ggml counts elements and bytes in int64
# The fewest bytes a metadata pair, an array element and a tensor info can take: a count that could not
# fit in what is left of the file is refused before the loop that would read it.
_MIN_KV = 8 + 1 + 4 + 1  # key length, a one-byte key, value type, a one-byte value
_MIN_TENSOR_INFO = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, n_dims, one dimension, type, offset

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<B",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Conversion(Enum):
    """How a tensor's bytes in the file differ from what ggml computes with, converted at load.

    Ollama's gpt-oss files (its runtime converts both at load, ml/backend/ggml): until 26 August 2025, MXFP4
    experts under the retired type id 4 with each block's nibbles in OpenAI's order (byte i holds elements
    2i and 2i + 1; ggml's MXFP4 wants elements j and j + 16); until October 2025, the experts' biases in
    BF16 (ggml's add_id adds F32 only). value: (the file's type id, what it means, the type ggml gets).
    """

    OPENAI_MXFP4 = (4, GGMLQuantizationType.MXFP4, GGMLQuantizationType.MXFP4)
    BF16_TO_F32 = (GGMLQuantizationType.BF16, GGMLQuantizationType.BF16, GGMLQuantizationType.F32)

    @property
    def file_type_id(self) -> int:
        return int(self.value[0])

    @property
    def file_type(self) -> GGMLQuantizationType:
        """The type the file holds (Ollama's `show` names it): its block size is the file's."""
        return self.value[1]

    @property
    def ggml_type(self) -> GGMLQuantizationType:
        return self.value[2]

    @property
    def file_block(self) -> int:
        """Bytes in the file per block of the same elements in ggml_type."""
        return GGML_QUANT_SIZES[self.file_type][1]

    def ggml_bytes(self, n_bytes: int) -> int:
        """The ggml size of n_bytes of the file's (whole blocks)."""
        return n_bytes // self.file_block * GGML_QUANT_SIZES[self.ggml_type][1]

    def convert(self, raw: np.ndarray) -> np.ndarray:
        """The ggml bytes (uint8) of whole blocks of the file's bytes `raw` (uint8)."""
        if self is Conversion.BF16_TO_F32:  # a BF16 is the top half of the F32 of the same value
            return (raw.view("<u2").astype("<u4") << 16).view(np.uint8)
        blocks = raw.reshape(-1, 17)  # the E8M0 scale, then byte i = element 2i | element 2i + 1 << 4
        first, second = blocks[:, 1:9], blocks[:, 9:]  # elements 0..15, 16..31
        out = np.empty_like(blocks)
        out[:, 0] = blocks[:, 0]
        out[:, 1::2] = (first & 0x0F) | (second << 4)  # qs[2m] = element 2m | element 2m + 16 << 4
        out[:, 2::2] = (first >> 4) | (second & 0xF0)  # qs[2m + 1] = element 2m + 1 | element 2m + 17 << 4
        return out.reshape(-1)


class GGUFError(ValueError):
    """A file that is not a GGUF model this engine can read; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType  # what ggml computes with (see conversion)
    shape: tuple[int, ...]  # ggml order: shape[0] (ne0) varies fastest, as stored in the file
    offset: int  # absolute offset of the tensor's data in the file
    n_bytes: int  # in the file
    conversion: Conversion | None = None  # the file's bytes become ggml_type's at load

    @property
    def ggml_bytes(self) -> int:
        """The size in ggml_type: what the tensor takes once loaded."""
        return self.n_bytes if self.conversion is None else self.conversion.ggml_bytes(self.n_bytes)

    @property
    def file_type(self) -> GGMLQuantizationType:
        """The type the file holds: ggml_type's unless converted at load."""
        return self.ggml_type if self.conversion is None else self.conversion.file_type

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file. Tensor data is not read; `tensor_data` maps it on demand."""

    path: Path
    version: int
    metadata: dict[str, Any]  # key -> str, int, float, bool or list of those
    # key -> (value type, element type for arrays else None): enough to write a value back verbatim.
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    tensors: dict[str, TensorInfo]  # in file order
    alignment: int
    tensor_data_offset: int
    file_size: int
    config: Config = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", Config(self.metadata))

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        path = Path(path)
        if not path.exists():
            raise GGUFError(f"{path}: no such file")
        if path.is_dir():
            raise GGUFError(f"{path}: is a directory, not a GGUF file")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise GGUFError(f"{path}: empty file, not a GGUF file")
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    return _Parser(path, buf, size).parse()
        except OSError as e:
            raise GGUFError(f"{path}: cannot read: {e.strerror or e}") from e

    @property
    def architecture(self) -> str:
        return self.config.architecture()

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 array mapped from the file."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        if info.n_bytes == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.n_bytes,))


class _Parser:
    """Walks header, metadata and tensor infos; `section` names the part being read for error messages."""

    def __init__(self, path: Path, buf: mmap.mmap, size: int) -> None:
        self.path = path
        self.buf = buf
        self.size = size
        self.pos = 0
        self.section = "header"

    def error(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {problem}")

    def take(self, n: int) -> int:
        """Claim the next n bytes and return where they start."""
        if n > self.size - self.pos:
            raise self.error(
                f"truncated file: the {self.section} needs {n} bytes at offset {self.pos}, "
                f"but the file ends at {self.size}"
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def string(self, what: str) -> str:
        n = self.u64()
        start = self.take(n)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"corrupt {self.section}: {what} is not valid UTF-8") from e

    def value_type(self, key: str) -> GGUFValueType:
        raw = self.u32()
        try:
            return GGUFValueType(raw)
        except ValueError as e:
            raise self.error(f"corrupt metadata: key {key!r} has unknown value type {raw}") from e

    def value(self, vtype: GGUFValueType, key: str) -> Any:
        """A scalar or string value (arrays go through `array`)."""
        if vtype == GGUFValueType.STRING:
            return self.string(f"the value of {key!r}")
        fmt = _SCALARS[vtype]
        value = struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]
        if vtype == GGUFValueType.BOOL:
            if value > 1:
                raise self.error(f"corrupt metadata: key {key!r} has bool value {value}")
            return bool(value)
        return value

    def count(self, count: int, min_size: int, what: str) -> int:
        """A count read from the file, refused when that many items cannot fit in the bytes left."""
        if count > (self.size - self.pos) // min_size:
            raise self.error(
                f"corrupt {self.section}: {count} {what} at offset {self.pos} cannot fit in the "
                f"{self.size - self.pos} bytes left in the file"
            )
        return count

    def array(self, key: str) -> tuple[list[Any], GGUFValueType]:
        etype = self.value_type(key)
        count = self.u64()
        if etype == GGUFValueType.ARRAY:  # llama.cpp refuses these too; they would nest without bound
            raise self.error(f"corrupt metadata: key {key!r} is an array of arrays, which GGUF readers do not support")
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype])
            start = self.take(count * dtype.itemsize)
            values = np.frombuffer(self.buf[start : self.pos], dtype=dtype)
            if etype == GGUFValueType.BOOL:
                if values.size and values.max() > 1:
                    raise self.error(f"corrupt metadata: array {key!r} has a bool value other than 0 or 1")
                return values.astype(bool).tolist(), etype
            return values.tolist(), etype
        self.count(count, 8, f"strings of {key!r}")
        return self.strings(count, key), etype

    def strings(self, count: int, key: str) -> list[str]:
        """`count` strings in a row: the loop of `string` without its per-call overhead (a 128k vocabulary
        and its merges are 400k strings, read at every model load: 0.14 s, 0.10 s with this loop)."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack, values = _U64.unpack_from, []
        append, start = values.append, pos + 8
        try:
            for _ in range(count):
                start = pos + 8
                pos = start + unpack(buf, pos)[0]
                if pos > size:
                    break
                append(buf[start:pos])
        except struct.error:  # the file ends inside a length
            pass
        if len(values) < count:
            self.pos = start - 8
            self.string(f"an element of {key!r}")  # the file ends inside it: raises, saying where
        self.pos = pos
        try:
            return list(map(bytes.decode, values))
        except UnicodeDecodeError as e:
            raise self.error(f"corrupt {self.section}: an element of {key!r} is not valid UTF-8") from e

    def parse(self) -> GGUFFile:
        start = self.take(4)
        magic = self.buf[start : start + 4]
        if magic != GGUF_MAGIC:
            raise self.error(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        version = self.u32()
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0:
                raise self.error("big-endian GGUF files are not supported")
            raise self.error(f"unsupported GGUF version {version} (supported: {SUPPORTED_VERSIONS})")
        n_tensors = self.u64()
        n_kv = self.count(self.u64(), _MIN_KV, "metadata pairs")
        self.count(n_tensors, _MIN_TENSOR_INFO, "tensor infos")

        self.section = "metadata"
        metadata: dict[str, Any] = {}
        value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for _ in range(n_kv):
            key = self.string("a key")
            if not key:
                raise self.error("corrupt metadata: empty key")
            if key in metadata:
                raise self.error(f"corrupt metadata: duplicate key {key!r}")
            vtype = self.value_type(key)
            if vtype == GGUFValueType.ARRAY:
                metadata[key], etype = self.array(key)
                value_types[key] = (vtype, etype)
            else:
                metadata[key] = self.value(vtype, key)
                value_types[key] = (vtype, None)
        alignment = self.alignment(metadata, value_types)

        self.section = "tensor infos"
        infos = [self.tensor_info(alignment) for _ in range(n_tensors)]
        data_offset = -(-self.pos // alignment) * alignment

        tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, shape, relative_offset, n_bytes, conversion in infos:
            if name in tensors:
                raise self.error(f"duplicate tensor name {name!r}")
            start = data_offset + relative_offset
            if start + n_bytes > self.size:
                raise self.error(
                    f"tensor {name!r} data (bytes {start}..{start + n_bytes}) extends past the end of the "
                    f"file ({self.size} bytes): the file is truncated or corrupt"
                )
            tensors[name] = TensorInfo(name, ggml_type, shape, start, n_bytes, conversion)
        self.check_overlaps(tensors.values())
        return GGUFFile(self.path, version, metadata, value_types, tensors, alignment, data_offset, self.size)

    def check_overlaps(self, tensors: Any) -> None:
        """Two tensors sharing bytes would alias each other's weights: refused, as llama.cpp does."""
        ordered = sorted((t for t in tensors if t.n_bytes), key=lambda t: t.offset)
        for before, after in zip(ordered, ordered[1:], strict=False):
            if after.offset < before.offset + before.n_bytes:
                raise self.error(
                    f"tensor {after.name!r} data (from byte {after.offset}) overlaps tensor {before.name!r} "
                    f"(bytes {before.offset}..{before.offset + before.n_bytes}): the file is corrupt"
                )

    def alignment(
        self, metadata: dict[str, Any], value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    ) -> int:
        if "general.alignment" not in metadata:
            return GGUF_DEFAULT_ALIGNMENT
        alignment = metadata["general.alignment"]
        if value_types["general.alignment"][0] != GGUFValueType.UINT32:
            raise self.error("corrupt metadata: general.alignment is not a uint32")
        if alignment == 0 or alignment & (alignment - 1):
            raise self.error(f"corrupt metadata: general.alignment {alignment} is not a power of two")
        return alignment

    def tensor_info(
        self, alignment: int
    ) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int, int, Conversion | None]:
        name = self.string("a tensor name")
        if not name or len(name.encode()) >= MAX_NAME:
            raise self.error(f"tensor name {name[:MAX_NAME]!r}: must be 1 to {MAX_NAME - 1} bytes long")
        n_dims = self.u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.error(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        shape = tuple(self.u64() for _ in range(n_dims))
        if 0 in shape:  # no weight is empty; ggml would see it as transposed, and shape checks divide by it
            raise self.error(f"tensor {name!r} has an empty dimension: shape {shape}")
        if math.prod(shape) > INT64_MAX or max(shape) > INT64_MAX:
            raise self.error(f"tensor {name!r}: shape {shape} has more elements than ggml can count (int64)")
        raw_type = self.u32()
        relative_offset = self.u64()
        conversion = Conversion.OPENAI_MXFP4 if raw_type == Conversion.OPENAI_MXFP4.file_type_id else None
        try:
            ggml_type = GGMLQuantizationType.MXFP4 if conversion is not None else GGMLQuantizationType(raw_type)
        except ValueError as e:
            raise self.error(f"tensor {name!r} has unknown ggml type id {raw_type}") from e
        if ggml_type not in SUPPORTED_TYPES:
            raise self.error(f"tensor {name!r} has type {ggml_type.name}, which this engine does not support")
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if shape[0] % block_size:
            raise self.error(
                f"tensor {name!r}: row length {shape[0]} is not a multiple of the {ggml_type.name} "
                f"block size {block_size}"
            )
        if relative_offset % alignment:
            raise self.error(f"tensor {name!r}: data offset {relative_offset} is not aligned to {alignment}")
        n_bytes = math.prod(shape) // block_size * type_size
        if ggml_type == GGMLQuantizationType.BF16 and name.endswith("_exps.bias"):
            conversion = Conversion.BF16_TO_F32
            ggml_type = conversion.ggml_type
        return name, ggml_type, shape, relative_offset, n_bytes, conversion
