"""Synthetic Pixtral towers (Mistral 3's vision): random weights in llama.cpp's mmproj layout
(clip.projector_type "pixtral", with Mistral Small 3.1's patch merger) or in Ollama's single file beside a
mistral3 text GGUF, the same values in both.

The mmproj's [IMG_BREAK] embedding (v.token_embd.img_break) is copied from the text model's token_embd row of
that token, as llama.cpp's converter copies it; Ollama's file has no copy (its tower reads that row).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from ollama_engine.fs.gguf_file import GGUFFile

from .vision import _stored, _Tensor, _write, clip_keys

IMG_BREAK_ID = 12  # Ollama's fixed id where the vocabulary has no [IMG_BREAK] (as the synthetic vocabularies)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class PixtralSpec:
    """Shapes of a synthetic tower; text_embd must equal the text model's n_embd."""

    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_ff: int = 128
    image_size: int = 64  # read by nothing but the key's presence: the resolution is the image's own
    patch_size: int = 4
    merge: int = 2
    text_embd: int = 64
    eps: float = 1e-5


# llama.cpp's mmproj names -> Ollama's mistral3 names (models/mistral3_vision.py reads both)
_OLLAMA_MISTRAL3 = (
    ("v.patch_embd", "v.patch_conv"), ("v.pre_ln", "v.encoder_norm"), (".ln1.", ".attn_norm."),
    (".ln2.", ".ffn_norm."), (".attn_out.", ".attn_output."), ("mm.input_norm", "mm.norm"),
    ("mm.patch_merger.weight", "mm.patch_merger.merging_layer.weight"), ("mm.1.", "mm.linear_1."),
    ("mm.2.", "mm.linear_2."),
)


def _tensors(s: PixtralSpec) -> Iterator[_Tensor]:
    yield _Tensor("v.patch_embd.weight", (s.patch_size, s.patch_size, 3, s.n_embd), "matrix")
    yield _Tensor("v.pre_ln.weight", (s.n_embd,), "norm")
    for i in range(s.n_layer):
        p = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            yield _Tensor(f"{p}{norm}.weight", (s.n_embd,), "norm")
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            yield _Tensor(f"{p}{name}.weight", (s.n_embd, s.n_embd), "matrix")
        yield _Tensor(f"{p}ffn_gate.weight", (s.n_embd, s.n_ff), "matrix")
        yield _Tensor(f"{p}ffn_up.weight", (s.n_embd, s.n_ff), "matrix")
        yield _Tensor(f"{p}ffn_down.weight", (s.n_ff, s.n_embd), "matrix")
    yield _Tensor("mm.input_norm.weight", (s.n_embd,), "norm")
    yield _Tensor("mm.patch_merger.weight", (s.n_embd * s.merge * s.merge, s.n_embd), "matrix")
    yield _Tensor("mm.1.weight", (s.n_embd, s.text_embd), "matrix")
    yield _Tensor("mm.1.bias", (s.text_embd,), "bias")
    yield _Tensor("mm.2.weight", (s.text_embd, s.text_embd), "matrix")
    yield _Tensor("mm.2.bias", (s.text_embd,), "bias")


def _ollama_name(name: str) -> str:
    for ours, theirs in _OLLAMA_MISTRAL3:
        name = name.replace(ours, theirs)
    return name


def _img_break(text: GGUFFile) -> np.ndarray:
    """The text model's (F32) token_embd row of [IMG_BREAK]."""
    info = text.tensors["token_embd.weight"]
    if info.file_type != GGMLQuantizationType.F32:
        raise ValueError("the synthetic mmproj copies [IMG_BREAK] from an F32 token_embd")
    table = np.array(text.tensor_data(info.name)).view(np.float32).reshape(info.shape[1], info.shape[0])
    return table[IMG_BREAK_ID].copy()


def write_mmproj(path: str | os.PathLike[str], text_path: str | os.PathLike[str],
                 spec: PixtralSpec = PixtralSpec(), *, weight_type: str = "F32", seed: int = 0) -> Path:  # noqa: B008
    """A separate projector GGUF as llama.cpp's converter writes Mistral Small 3.1's."""
    keys = clip_keys("pixtral", "use_silu", spec, ("spatial_merge_size", spec.merge), CLIP_MEAN, CLIP_STD)
    tensors = [_stored(t, t.name, weight_type, seed) for t in _tensors(spec)]
    brk = _img_break(GGUFFile.open(text_path))
    tensors.append(("v.token_embd.img_break", brk.shape, GGMLQuantizationType.F32, brk))
    return _write(Path(path), "clip", keys, tensors)


def add_vision(text_path: str | os.PathLike[str], path: str | os.PathLike[str],
               spec: PixtralSpec = PixtralSpec(), *, weight_type: str = "F32", seed: int = 0) -> Path:  # noqa: B008
    """The mistral3 text GGUF at text_path with the tower beside it, as Ollama's converter stores Mistral
    Small 3.1: mistral3.vision.* keys, spatial_merge_size, text_config.rms_norm_eps; no image mean/std (Ollama
    uses CLIP's) and no [IMG_BREAK] copy."""
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
        (f"{arch}.vision.attention.key_length", spec.n_embd // spec.n_head, u32, None),
        (f"{arch}.vision.attention.layer_norm_epsilon", spec.eps, f32, None),
        (f"{arch}.vision.image_size", spec.image_size, u32, None),
        (f"{arch}.vision.patch_size", spec.patch_size, u32, None),
        (f"{arch}.vision.num_channels", 3, u32, None),
        (f"{arch}.vision.rope.freq_base", 10000.0, f32, None),
        (f"{arch}.spatial_merge_size", spec.merge, u32, None),
        (f"{arch}.text_config.rms_norm_eps", spec.eps, f32, None),
    ]
    tensors = [(info.name, info.shape, info.file_type, np.array(text.tensor_data(info.name)))
               for info in text.tensors.values()]
    tensors += [_stored(t, _ollama_name(t.name), weight_type, seed) for t in _tensors(spec)]
    return _write(Path(path), arch, keys, tensors)
