"""Synthetic vision towers: random weights in llama.cpp's mmproj layout (a separate "clip" GGUF) or in
Ollama's single-file layout (v.* and mm.* tensors and <arch>.vision.* keys added to a text GGUF), so that
every tower can be compared with llama.cpp's mtmd without downloads. The same seed gives the same values
in both layouts.
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from ollama_engine.fs.gguf_file import GGUFFile


@dataclass(frozen=True)
class VisionSpec:
    """Shapes of a synthetic tower; text_embd must equal the text model's n_embd."""

    projector: str = "gemma3"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_ff: int = 128
    image_size: int = 64
    patch_size: int = 4
    merge: int = 4  # gemma3: patches a side pooled by this (64 / 4 / 4 = 4 a side: 16 tokens)
    text_embd: int = 64
    eps: float = 1e-6
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)


VISION_PRESETS = {"tiny-gemma3-vision": VisionSpec()}

# llama.cpp's mmproj names -> Ollama's gemma3 names (models/gemma3_vision.py reads both)
_OLLAMA_GEMMA3 = (
    ("v.patch_embd", "v.patch_embedding"), ("v.position_embd", "v.position_embedding"),
    ("v.post_ln", "v.post_layernorm"), (".attn_out.", ".attn_output."), (".ln1.", ".layer_norm1."),
    (".ln2.", ".layer_norm2."), (".ffn_up.", ".mlp.fc1."), (".ffn_down.", ".mlp.fc2."),
    ("mm.input_projection", "mm.mm_input_projection"), ("mm.soft_emb_norm", "mm.mm_soft_emb_norm"),
)


@dataclass(frozen=True)
class _Tensor:
    name: str  # llama.cpp's
    shape: tuple[int, ...]  # ggml order
    kind: str  # "matrix", "norm", "bias", "table"


def _tensors(s: VisionSpec) -> Iterator[_Tensor]:
    side = s.image_size // s.patch_size
    yield _Tensor("v.patch_embd.weight", (s.patch_size, s.patch_size, 3, s.n_embd), "matrix")
    yield _Tensor("v.patch_embd.bias", (s.n_embd,), "bias")
    yield _Tensor("v.position_embd.weight", (s.n_embd, side * side), "table")
    for i in range(s.n_layer):
        p = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            yield _Tensor(f"{p}{norm}.weight", (s.n_embd,), "norm")
            yield _Tensor(f"{p}{norm}.bias", (s.n_embd,), "bias")
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            yield _Tensor(f"{p}{name}.weight", (s.n_embd, s.n_embd), "matrix")
            yield _Tensor(f"{p}{name}.bias", (s.n_embd,), "bias")
        yield _Tensor(f"{p}ffn_up.weight", (s.n_embd, s.n_ff), "matrix")
        yield _Tensor(f"{p}ffn_up.bias", (s.n_ff,), "bias")
        yield _Tensor(f"{p}ffn_down.weight", (s.n_ff, s.n_embd), "matrix")
        yield _Tensor(f"{p}ffn_down.bias", (s.n_embd,), "bias")
    yield _Tensor("v.post_ln.weight", (s.n_embd,), "norm")
    yield _Tensor("v.post_ln.bias", (s.n_embd,), "bias")
    yield _Tensor("mm.soft_emb_norm.weight", (s.n_embd,), "norm")
    yield _Tensor("mm.input_projection.weight", (s.text_embd, s.n_embd), "matrix")


def _values(t: _Tensor, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    if t.kind == "norm":
        values = 1.0 + 0.1 * rng.standard_normal(t.shape[::-1], dtype=np.float32)
    elif t.kind == "bias":
        values = 0.1 * rng.standard_normal(t.shape[::-1], dtype=np.float32)
    else:  # rows of unit-ish output: inputs have about unit variance
        fan_in = math.prod(t.shape[:3]) if t.name == "v.patch_embd.weight" else t.shape[0]
        values = rng.standard_normal(t.shape[::-1], dtype=np.float32) / np.float32(math.sqrt(fan_in))
    return values.astype(np.float32)


def _stored(t: _Tensor, name: str, weight_type: str, seed: int) -> tuple:
    """(name, shape, type, data): matrices in weight_type (F32 or F16), vectors and tables F32."""
    values = _values(t, seed)
    if t.kind == "matrix" and weight_type == "F16":
        return name, t.shape, GGMLQuantizationType.F16, values.astype(np.float16)
    if weight_type not in ("F32", "F16"):
        raise ValueError(f"synthetic vision weights are F32 or F16, not {weight_type!r}")
    return name, t.shape, GGMLQuantizationType.F32, values


def _ollama_name(name: str) -> str:
    for ours, theirs in _OLLAMA_GEMMA3:
        name = name.replace(ours, theirs)
    return name


def _write(path: Path, arch: str, keys: list[tuple[str, object, GGUFValueType, GGUFValueType | None]],
           tensors: list[tuple[str, tuple[int, ...], GGMLQuantizationType, np.ndarray]]) -> Path:
    """A GGUF of these keys and tensors: (name, ggml shape, type, the stored data)."""
    partial = path.with_name(path.name + ".partial")
    try:
        with contextlib.closing(gguf.GGUFWriter(partial, arch)) as writer:
            for key, value, vtype, etype in keys:
                writer.add_key_value(key, value, vtype, etype)
            for name, shape, qtype, data in tensors:  # the writer takes numpy's (reversed) shape
                writer.add_tensor_info(name, shape[::-1], np.dtype(np.float32), data.nbytes, raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for _, _, _, data in tensors:
                writer.write_tensor_data(data)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
    return path


def clip_keys(projector: str, activation: str, spec: Any, extra: tuple[str, int],
              mean: Sequence[float], std: Sequence[float]) -> list[tuple[str, object, GGUFValueType, Any]]:
    """The clip.* keys every tower's mmproj has, in llama.cpp's converter's order; `activation` is the flag's
    name (use_gelu, use_silu) and `extra` the tower's own clip.vision.* key before the normalisation."""
    u32, f32, b = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
    return [
        ("clip.projector_type", projector, GGUFValueType.STRING, None),
        ("clip.has_vision_encoder", True, b, None),
        (f"clip.{activation}", True, b, None),
        ("clip.vision.embedding_length", spec.n_embd, u32, None),
        ("clip.vision.feed_forward_length", spec.n_ff, u32, None),
        ("clip.vision.block_count", spec.n_layer, u32, None),
        ("clip.vision.attention.head_count", spec.n_head, u32, None),
        ("clip.vision.attention.layer_norm_epsilon", spec.eps, f32, None),
        ("clip.vision.image_size", spec.image_size, u32, None),
        ("clip.vision.patch_size", spec.patch_size, u32, None),
        ("clip.vision.projection_dim", spec.text_embd, u32, None),
        (f"clip.vision.{extra[0]}", extra[1], u32, None),
        ("clip.vision.image_mean", list(mean), GGUFValueType.ARRAY, f32),
        ("clip.vision.image_std", list(std), GGUFValueType.ARRAY, f32),
    ]


def write_mmproj(path: str | os.PathLike[str], spec: VisionSpec = VisionSpec(), *,  # noqa: B008 - frozen
                 weight_type: str = "F32", seed: int = 0) -> Path:
    """A separate projector GGUF as llama.cpp's converter writes it (general.architecture "clip")."""
    keys = clip_keys(spec.projector, "use_gelu", spec, ("projector.scale_factor", spec.merge), spec.mean, spec.std)
    tensors = [_stored(t, t.name, weight_type, seed) for t in _tensors(spec)]
    return _write(Path(path), "clip", keys, tensors)


def add_vision(text_path: str | os.PathLike[str], path: str | os.PathLike[str],
               spec: VisionSpec = VisionSpec(), *, weight_type: str = "F32", seed: int = 0) -> Path:  # noqa: B008
    """The text GGUF at text_path with the tower beside it, as Ollama's converter stores a vision model in
    one file: <arch>.vision.* keys, <arch>.mm_tokens_per_image, v.* and mm.* tensors under its names."""
    text = GGUFFile.open(text_path)
    arch = text.architecture
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    keys: list = [(k, v, *text.value_types[k]) for k, v in text.metadata.items()
                  if k not in ("general.architecture", "general.alignment")]
    side = spec.image_size // spec.patch_size // spec.merge
    keys += [
        (f"{arch}.vision.block_count", spec.n_layer, u32, None),
        (f"{arch}.vision.embedding_length", spec.n_embd, u32, None),
        (f"{arch}.vision.feed_forward_length", spec.n_ff, u32, None),
        (f"{arch}.vision.attention.head_count", spec.n_head, u32, None),
        (f"{arch}.vision.attention.layer_norm_epsilon", spec.eps, f32, None),
        (f"{arch}.vision.image_size", spec.image_size, u32, None),
        (f"{arch}.vision.patch_size", spec.patch_size, u32, None),
        (f"{arch}.vision.num_channels", 3, u32, None),
        (f"{arch}.mm_tokens_per_image", side * side, u32, None),
    ]
    tensors = [(info.name, info.shape, info.file_type, np.array(text.tensor_data(info.name)))
               for info in text.tensors.values()]
    tensors += [_stored(t, _ollama_name(t.name), weight_type, seed) for t in _tensors(spec)]
    return _write(Path(path), arch, keys, tensors)
