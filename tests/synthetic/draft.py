"""A draft model made from a real target: the same GGUF with fewer layers, optionally requantized.

No real model smaller than SmolLM2-135M-Instruct shares its vocabulary in the environment's package lists, so
speculative decoding with a draft model is tested (and benchmarked) with a draft cut from the target itself:
its first `layers` blocks, then the target's output norm and head. Its vocabulary and tokenizer are the
target's byte for byte. `quantize` requantizes every quantized matrix to that type with ggml's quantizers
(after gguf's dequantizer), for a draft that differs from the target in its rounding as well.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import gguf
import numpy as np

from ollama_engine import ggml
from ollama_engine.fs import GGUFFile

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def write_draft(source: Path, target: Path, layers: int, quantize: str | None = None) -> Path:
    """Write the draft (atomically) unless it exists; return its path."""
    target = Path(target)
    if target.exists():
        return target
    file = GGUFFile.open(source)
    arch = file.architecture
    count = file.metadata[f"{arch}.block_count"]
    if not 0 < layers <= count:
        raise ValueError(f"layers must be in 1..{count}, got {layers}")
    qtype = gguf.GGMLQuantizationType[quantize] if quantize else None
    kept = [info for info in file.tensors.values()
            if (m := _BLOCK.match(info.name)) is None or int(m.group(1)) < layers]

    def converted(info) -> tuple[int, bytes]:
        data = file.tensor_data(info.name)
        if qtype is None or len(info.shape) < 2 or not ggml.is_quantized(info.ggml_type):
            return info.ggml_type, bytes(data)
        rows = gguf.quants.dequantize(np.frombuffer(bytes(data), dtype=np.uint8), gguf.GGMLQuantizationType(
            info.ggml_type)).reshape(-1, info.shape[0]).astype(np.float32)
        return int(qtype), ggml.quantize(int(qtype), rows).tobytes()

    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch)
    writer.kv_data[0].pop("general.architecture")  # copied with the rest
    try:
        for key, value in file.metadata.items():
            vtype, etype = file.value_types[key]
            writer.add_key_value(key, layers if key == f"{arch}.block_count" else value, vtype, etype)
        data = [converted(info) for info in kept]
        for info, (kind, raw) in zip(kept, data, strict=True):
            writer.add_tensor_info(info.name, info.shape[::-1], np.dtype(np.float32), len(raw), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, raw in data:
            writer.write_tensor_data(np.frombuffer(raw, dtype=np.uint8))
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    writer.close()
    os.replace(partial, target)
    return target
