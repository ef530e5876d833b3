"""Synthetic Qwen2.5-VL towers: random weights in llama.cpp's mmproj layout (clip.projector_type
"qwen2.5vl_merger") or in Ollama's single file beside a qwen2vl text GGUF (architecture qwen25vl), the same
values in both.

Shapes are tiny but keep the tower's structure: two patch-embedding kernels (the temporal patch's two frames),
RMS-normed SwiGLU blocks with biases, window attention in all layers but every n_wa_pattern-th, the final
RMS norm, and the 2 x 2 merger MLP (mm.0, GELU, mm.2) to the text width.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from ollama_engine.fs.gguf_file import GGUFFile

from .vision import _stored, _Tensor, _write, clip_keys

QWEN_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2.5-VL's preprocessor_config (CLIP's)
QWEN_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Qwen25VLSpec:
    """Shapes of a synthetic tower; text_embd must equal the text model's n_embd. With Qwen2.5-VL's patches of
    14 pixels, merged 2 x 2, its window of 112 pixels holds 4 x 4 merged patches: images wider or taller than
    112 pixels have several windows. The window size is written in Ollama's file only: llama.cpp reads none
    for Qwen2.5-VL (112 fixed)."""

    n_layer: int = 4
    n_embd: int = 32
    n_head: int = 2  # heads of 16: M-RoPE's 4 sections of 4
    n_ff: int = 64
    image_size: int = 56  # read by nothing but the key's presence (a multiple of the patch)
    patch_size: int = 14
    window_size: int = 112
    wa_pattern: int = 2  # layers 1 and 3 attend fully, 0 and 2 within windows (llama.cpp needs one at least)
    text_embd: int = 64
    eps: float = 1e-6


# llama.cpp's mmproj names -> Ollama's qwen25vl names (models/qwen25vl_vision.py reads both)
_OLLAMA_QWEN25VL = (
    ("v.patch_embd.weight.1", "v.patch_embd_1.weight"), ("v.patch_embd.weight", "v.patch_embd_0.weight"),
    ("v.post_ln.", "v.merger.ln_q."), ("mm.0.", "v.merger.mlp.0."), ("mm.2.", "v.merger.mlp.2."),
)


def _tensors(s: Qwen25VLSpec) -> Iterator[_Tensor]:
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
        yield _Tensor(name, (s.patch_size, s.patch_size, 3, s.n_embd), "matrix")
    for i in range(s.n_layer):
        p = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            yield _Tensor(f"{p}{norm}.weight", (s.n_embd,), "norm")
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            yield _Tensor(f"{p}{name}.weight", (s.n_embd, s.n_embd), "matrix")
            yield _Tensor(f"{p}{name}.bias", (s.n_embd,), "bias")
        for name, shape in (("ffn_gate", (s.n_embd, s.n_ff)), ("ffn_up", (s.n_embd, s.n_ff)),
                            ("ffn_down", (s.n_ff, s.n_embd))):
            yield _Tensor(f"{p}{name}.weight", shape, "matrix")
            yield _Tensor(f"{p}{name}.bias", shape[1:], "bias")
    yield _Tensor("v.post_ln.weight", (s.n_embd,), "norm")
    yield _Tensor("mm.0.weight", (s.n_embd * 4, s.n_embd * 4), "matrix")
    yield _Tensor("mm.0.bias", (s.n_embd * 4,), "bias")
    yield _Tensor("mm.2.weight", (s.n_embd * 4, s.text_embd), "matrix")
    yield _Tensor("mm.2.bias", (s.text_embd,), "bias")


def _ollama_name(name: str) -> str:
    for ours, theirs in _OLLAMA_QWEN25VL:
        name = name.replace(ours, theirs)
    return name


def write_mmproj(path: str | os.PathLike[str], spec: Qwen25VLSpec = Qwen25VLSpec(), *,  # noqa: B008 - frozen
                 weight_type: str = "F32", seed: int = 0) -> Path:
    """A separate projector GGUF as llama.cpp's converter writes Qwen2.5-VL's."""
    keys = clip_keys("qwen2.5vl_merger", "use_silu", spec, ("n_wa_pattern", spec.wa_pattern), QWEN_MEAN, QWEN_STD)
    tensors = [_stored(t, t.name, weight_type, seed) for t in _tensors(spec)]
    return _write(Path(path), "clip", keys, tensors)


def add_vision(text_path: str | os.PathLike[str], path: str | os.PathLike[str],
               spec: Qwen25VLSpec = Qwen25VLSpec(), *, weight_type: str = "F32", seed: int = 0) -> Path:  # noqa: B008
    """The qwen2vl text GGUF at text_path (Ollama's layout: architecture qwen25vl) with the tower beside it,
    as Ollama's converter stores Qwen2.5-VL: qwen25vl.vision.* keys (its full-attention layers listed,
    its window size), v.* and mm.* tensors under its names."""
    text = GGUFFile.open(text_path)
    arch = text.architecture
    u32, f32, i32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.INT32
    keys: list = [(k, v, *text.value_types[k]) for k, v in text.metadata.items()
                  if k not in ("general.architecture", "general.alignment")]
    full = [i for i in range(spec.n_layer) if (i + 1) % spec.wa_pattern == 0]
    keys += [
        (f"{arch}.vision.block_count", spec.n_layer, u32, None),
        (f"{arch}.vision.embedding_length", spec.n_embd, u32, None),
        (f"{arch}.vision.feed_forward_length", spec.n_ff, u32, None),
        (f"{arch}.vision.attention.head_count", spec.n_head, u32, None),
        (f"{arch}.vision.attention.layer_norm_epsilon", spec.eps, f32, None),
        (f"{arch}.vision.image_size", spec.image_size, u32, None),
        (f"{arch}.vision.patch_size", spec.patch_size, u32, None),
        (f"{arch}.vision.num_channels", 3, u32, None),
        (f"{arch}.vision.spatial_merge_size", 2, u32, None),
        (f"{arch}.vision.temporal_patch_size", 2, u32, None),
        (f"{arch}.vision.window_size", spec.window_size, u32, None),
        (f"{arch}.vision.fullatt_block_indexes", full, GGUFValueType.ARRAY, i32),
        (f"{arch}.vision.rope.freq_base", 10000.0, f32, None),
    ]
    tensors = [(info.name, info.shape, info.file_type, np.array(text.tensor_data(info.name)))
               for info in text.tensors.values()]
    tensors += [_stored(t, _ollama_name(t.name), weight_type, seed) for t in _tensors(spec)]
    return _write(Path(path), arch, keys, tensors)
