"""The pieces every vision tower shares, written once: patch embedding, the pre-norm ViT block and its
full (both-ways) attention, as llama.cpp's clip_graph builds them (tools/mtmd/clip.cpp: build_inp,
build_vit, build_attn, build_ffn). Weights are declared under llama.cpp's mmproj names; `VisionWeights`
finds them under Ollama's names too, where a tower's file stores them so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ollama_engine.ml import Backend, DType, Tensor

from .base import weight


class VisionWeights:
    """A backend's tensors looked up by llama.cpp's mmproj names: for Ollama's single-file layout each
    name is rewritten by the tower's (llama.cpp fragment -> Ollama fragment) pairs. Stands in for the
    backend in base.bind()."""

    def __init__(self, backend: Backend, renames: Mapping[str, str] = {}):  # noqa: B006 - read only
        self.backend = backend
        self.model = backend.model
        self.renames = dict(renames)

    def name(self, name: str) -> str:
        for ours, theirs in self.renames.items():
            name = name.replace(ours, theirs)
        return name

    def get(self, name: str) -> Tensor | None:
        return self.backend.get(self.name(name))


@dataclass
class ViTLayer:
    """One pre-norm encoder block (SigLIP, CLIP): layer norms with biases, separate q/k/v."""

    ln1: Tensor = weight("ln1.weight")
    ln1_b: Tensor | None = weight("ln1.bias", optional=True)
    attn_q: Tensor = weight("attn_q.weight")
    attn_q_b: Tensor | None = weight("attn_q.bias", optional=True)
    attn_k: Tensor = weight("attn_k.weight")
    attn_k_b: Tensor | None = weight("attn_k.bias", optional=True)
    attn_v: Tensor = weight("attn_v.weight")
    attn_v_b: Tensor | None = weight("attn_v.bias", optional=True)
    attn_out: Tensor = weight("attn_out.weight")
    attn_out_b: Tensor | None = weight("attn_out.bias", optional=True)
    ln2: Tensor = weight("ln2.weight")
    ln2_b: Tensor | None = weight("ln2.bias", optional=True)
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_up_b: Tensor | None = weight("ffn_up.bias", optional=True)
    ffn_down: Tensor = weight("ffn_down.weight")
    ffn_down_b: Tensor | None = weight("ffn_down.bias", optional=True)

    def swap_legacy_ffn(self, n_embd: int) -> None:
        """Older conversions stored up and down under each other's names: llama.cpp swaps them back when
        ffn_down reads n_embd features (clip.cpp's is_ffn_swapped); so do we."""
        if self.ffn_down.ne[0] == n_embd and self.ffn_up.ne[0] != n_embd:
            self.ffn_up, self.ffn_down = self.ffn_down, self.ffn_up
            self.ffn_up_b, self.ffn_down_b = self.ffn_down_b, self.ffn_up_b


@dataclass(frozen=True)
class ViTOptions:
    n_embd: int
    n_head: int
    eps: float
    flash_attention: bool
    activation: Callable[[Tensor], Tensor] = Tensor.gelu  # clip.use_gelu: tanh-approximated GELU


def linear(w: Tensor, b: Tensor | None, x: Tensor) -> Tensor:
    out = w.matmul(x)
    return out.add(b) if b is not None else out


def patch_embedding(kernel: Tensor, bias: Tensor | None, pixels: Tensor, patch: int) -> Tensor:
    """Pixels (width, height, 3) cut into patch x patch squares, each projected: (n_embd, patches), patches
    row by row (clip_graph::build_inp)."""
    patches = kernel.conv2d(pixels, patch)  # (patches across, patches down, n_embd, 1)
    cols, rows, n_embd = patches.ne[:3]
    out = patches.reshape(cols * rows, n_embd).transpose().contiguous()
    return out.add(bias) if bias is not None else out


def attention(q: Tensor, k: Tensor, v: Tensor, o: ViTOptions) -> Tensor:
    """Every position attends to every other, no mask: q, k, v (head_dim, heads, positions) ->
    (n_embd, positions). flash: ggml's fused kernel on F16 keys and values, as clip_graph::build_attn."""
    scale = 1.0 / math.sqrt(q.ne[0])
    q = q.permute(0, 2, 1, 3)
    if o.flash_attention:
        k = k.permute(0, 2, 1, 3).cast(DType.F16)
        v = v.permute(0, 2, 1, 3).cast(DType.F16)
        out = q.flash_attention(k, v, None, scale)  # (head_dim, heads, positions)
        return out.reshape(out.ne[0] * out.ne[1], out.ne[2])
    scores = k.permute(0, 2, 1, 3).matmul(q).softmax(None, scale)
    out = v.permute(1, 2, 0, 3).contiguous().matmul(scores)  # (head_dim, positions, heads)
    out = out.permute(0, 2, 1, 3)
    return out.contiguous(out.ne[0] * out.ne[1], out.ne[2])


def vit_block(layer: ViTLayer, x: Tensor, o: ViTOptions) -> Tensor:
    """x + attention(norm(x)), then that + ffn(norm(that)): clip_graph::build_vit's layer."""
    positions, head_dim = x.ne[1], o.n_embd // o.n_head
    cur = x.layer_norm(layer.ln1, layer.ln1_b, o.eps)
    q = linear(layer.attn_q, layer.attn_q_b, cur).reshape(head_dim, o.n_head, positions)
    k = linear(layer.attn_k, layer.attn_k_b, cur).reshape(head_dim, o.n_head, positions)
    v = linear(layer.attn_v, layer.attn_v_b, cur).reshape(head_dim, o.n_head, positions)
    cur = linear(layer.attn_out, layer.attn_out_b, attention(q, k, v, o))
    x = cur.add(x)
    cur = x.layer_norm(layer.ln2, layer.ln2_b, o.eps)
    cur = linear(layer.ffn_down, layer.ffn_down_b, o.activation(linear(layer.ffn_up, layer.ffn_up_b, cur)))
    return x.add(cur)
