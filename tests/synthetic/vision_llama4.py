"""A synthetic Llama 4 vision tower in llama.cpp's mmproj layout or in Ollama's single-file layout (beside a
llama4 text GGUF), random weights from the same seed in both, to compare with llama.cpp's mtmd."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from ollama_engine.fs.gguf_file import GGUFFile

from .vision import _stored, _Tensor, _write, clip_keys


@dataclass(frozen=True)
class Llama4VisionSpec:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_ff: int = 128
    image_size: int = 32
    patch_size: int = 4
    merge: int = 2  # 8 patches a side shuffled by 2: 16 rows per tile
    adapter: int = 96  # the adapter MLP's width (projector_input_dim; its output too)
    text_embd: int = 64
    eps: float = 1e-5
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)


# llama.cpp's mmproj names -> Ollama's llama4 names (models/llama4_vision.py reads both)
_OLLAMA_LLAMA4 = (
    ("v.patch_embd", "v.patch_embedding"), ("v.class_embd", "v.class_embedding"),
    ("v.position_embd.weight", "v.positional_embedding_vlm"), ("v.pre_ln", "v.layernorm_pre"),
    ("v.post_ln", "v.layernorm_post"), (".attn_out.", ".attn_output."), (".ln1.", ".attn_norm."),
    (".ln2.", ".ffn_norm."), (".ffn_up.", ".mlp.fc1."), (".ffn_down.", ".mlp.fc2."),
    ("mm.model.mlp.1", "v.vision_adapter.mlp.fc1"), ("mm.model.mlp.2", "v.vision_adapter.mlp.fc2"),
    ("mm.model.fc", "mm.linear_1"),
)


def _tensors(s: Llama4VisionSpec) -> Iterator[_Tensor]:
    patches = (s.image_size // s.patch_size) ** 2
    yield _Tensor("v.patch_embd.weight", (3 * s.patch_size * s.patch_size, s.n_embd), "matrix")
    yield _Tensor("v.class_embd", (s.n_embd,), "bias")
    yield _Tensor("v.position_embd.weight", (s.n_embd, patches + 1), "table")
    yield _Tensor("v.pre_ln.weight", (s.n_embd,), "norm")
    yield _Tensor("v.pre_ln.bias", (s.n_embd,), "bias")
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
    yield _Tensor("mm.model.mlp.1.weight", (s.n_embd * s.merge * s.merge, s.adapter), "matrix")
    yield _Tensor("mm.model.mlp.2.weight", (s.adapter, s.adapter), "matrix")
    yield _Tensor("mm.model.fc.weight", (s.adapter, s.text_embd), "matrix")


def _ollama_name(name: str) -> str:
    for ours, theirs in _OLLAMA_LLAMA4:
        name = name.replace(ours, theirs)
    return name


def _stored_any(t: _Tensor, name: str, weight_type: str, seed: int) -> tuple:
    """As vision._stored, but the unfolding patch embedding (a 2-D matrix of fan-in 3 * patch²) scaled to
    unit-ish output: _values divides it by a 4-D kernel's fan-in, sqrt(n_embd) too much here."""
    stored = _stored(t, name, weight_type, seed)
    if t.name != "v.patch_embd.weight":
        return stored
    name, shape, qtype, data = stored
    return name, shape, qtype, (data.astype(np.float32) * np.float32(np.sqrt(shape[1]))).astype(data.dtype)


def write_llama4_mmproj(path: str | os.PathLike[str], spec: Llama4VisionSpec = Llama4VisionSpec(), *,  # noqa: B008
                        weight_type: str = "F32", seed: int = 0) -> Path:
    """A separate projector GGUF as llama.cpp's converter writes Llama 4's (clip.projector_type llama4)."""
    keys = clip_keys("llama4", "use_gelu", spec, ("projector.scale_factor", spec.merge), spec.mean, spec.std)
    tensors = [_stored_any(t, t.name, weight_type, seed) for t in _tensors(spec)]
    return _write(Path(path), "clip", keys, tensors)


def add_llama4_vision(text_path: str | os.PathLike[str], path: str | os.PathLike[str],
                      spec: Llama4VisionSpec = Llama4VisionSpec(), *,  # noqa: B008
                      weight_type: str = "F32", seed: int = 0) -> Path:
    """The llama4 text GGUF at text_path with the tower beside it, as Ollama's converter stores Llama 4:
    llama4.vision.* keys (the pixel shuffle as a ratio), v.* and mm.* tensors under Ollama's names."""
    text = GGUFFile.open(text_path)
    arch = text.architecture
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    keys: list = [(k, v, *text.value_types[k]) for k, v in text.metadata.items()
                  if k not in ("general.architecture", "general.alignment")]
    keys += [
        (f"{arch}.vision.block_count", spec.n_layer, u32, None),
        (f"{arch}.vision.embedding_length", spec.n_embd, u32, None),
        (f"{arch}.vision.feed_forward_length", spec.n_ff, u32, None),
        (f"{arch}.vision.attention.head_count", spec.n_head, u32, None),
        (f"{arch}.vision.layer_norm_epsilon", spec.eps, f32, None),
        (f"{arch}.vision.image_size", spec.image_size, u32, None),
        (f"{arch}.vision.patch_size", spec.patch_size, u32, None),
        (f"{arch}.vision.num_channels", 3, u32, None),
        (f"{arch}.vision.rope.freq_base", 10000.0, f32, None),
        (f"{arch}.vision.pixel_shuffle_ratio", 1.0 / spec.merge, f32, None),
    ]
    tensors = [(info.name, info.shape, info.file_type, np.array(text.tensor_data(info.name)))
               for info in text.tensors.values()]
    tensors += [_stored_any(t, _ollama_name(t.name), weight_type, seed) for t in _tensors(spec)]
    return _write(Path(path), arch, keys, tensors)
