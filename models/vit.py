"""The pieces every vision tower shares, written once: patch embedding, the pre-norm ViT block and its
full (both-ways) attention, as llama.cpp's clip_graph builds them (tools/mtmd/clip.cpp: build_inp,
build_vit, build_attn, build_ffn). Weights are declared under llama.cpp's mmproj names; `VisionWeights`
finds them under Ollama's names too, where a tower's file stores them so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ollama_engine.ml import Backend, DType, RopeOptions, Tensor

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
    """One pre-norm encoder block (SigLIP, CLIP; Pixtral with RMS norms and a gate): norms, separate q/k/v."""

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
    ffn_gate: Tensor | None = weight("ffn_gate.weight", optional=True)  # gated FFN (Pixtral's SwiGLU)
    ffn_gate_b: Tensor | None = weight("ffn_gate.bias", optional=True)
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
    activation: Callable[..., Tensor] = Tensor.gelu  # clip.use_gelu: tanh GELU; (gate, up) when gated
    rms_norm: bool = False  # clip.cpp's NORM_TYPE_RMS (Pixtral) instead of layer norms


def norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, o: ViTOptions) -> Tensor:
    """clip_graph::build_norm: RMS or layer norm, then the weight and bias where the file has them."""
    if o.rms_norm:
        out = x.rms_norm(weight, o.eps)
        return out.add(bias) if bias is not None else out
    return x.layer_norm(weight, bias, o.eps)


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


def attention(q: Tensor, k: Tensor, v: Tensor, o: ViTOptions, mask: Tensor | None = None) -> Tensor:
    """Every position attends to every other but where the mask (F32 (positions, positions), 0 or -inf: a
    window tower's) says not: q, k, v (head_dim, heads, positions) -> (n_embd, positions). flash: ggml's fused
    kernel on F16 keys, values and mask, as clip_graph::build_attn."""
    scale = 1.0 / math.sqrt(q.ne[0])
    q = q.permute(0, 2, 1, 3)
    if o.flash_attention:
        k = k.permute(0, 2, 1, 3).cast(DType.F16)
        v = v.permute(0, 2, 1, 3).cast(DType.F16)
        out = q.flash_attention(k, v, mask.cast(DType.F16) if mask is not None else None, scale)
        return out.reshape(out.ne[0] * out.ne[1], out.ne[2])
    scores = k.permute(0, 2, 1, 3).matmul(q).softmax(mask, scale)
    out = v.permute(1, 2, 0, 3).contiguous().matmul(scores)  # (head_dim, positions, heads)
    out = out.permute(0, 2, 1, 3)
    return out.contiguous(out.ne[0] * out.ne[1], out.ne[2])


def vit_block(layer: ViTLayer, x: Tensor, o: ViTOptions,
              add_pos: Callable[[Tensor], Tensor] | None = None, mask: Tensor | None = None) -> Tensor:
    """x + attention(norm(x)), then that + ffn(norm(that)): clip_graph::build_vit's layer. add_pos turns
    the queries and keys (head_dim, heads, positions) by their positions (a tower's RoPE); mask: attention's."""
    positions, head_dim = x.ne[1], o.n_embd // o.n_head
    cur = norm(x, layer.ln1, layer.ln1_b, o)
    q = linear(layer.attn_q, layer.attn_q_b, cur).reshape(head_dim, o.n_head, positions)
    k = linear(layer.attn_k, layer.attn_k_b, cur).reshape(head_dim, o.n_head, positions)
    v = linear(layer.attn_v, layer.attn_v_b, cur).reshape(head_dim, o.n_head, positions)
    if add_pos is not None:
        q, k = add_pos(q), add_pos(k)
    cur = linear(layer.attn_out, layer.attn_out_b, attention(q, k, v, o, mask))
    x = cur.add(x)
    cur = norm(x, layer.ln2, layer.ln2_b, o)
    up = linear(layer.ffn_up, layer.ffn_up_b, cur)
    if layer.ffn_gate is not None:  # build_ffn's split GLU: act(gate) * up
        hidden = o.activation(linear(layer.ffn_gate, layer.ffn_gate_b, cur), up)
    else:
        hidden = o.activation(up)
    return x.add(linear(layer.ffn_down, layer.ffn_down_b, hidden))


ROPE_2D = RopeOptions(neox=False, original_context=0, extrapolation_factor=0.0, attention_factor=1.0,
                      beta_fast=0.0, beta_slow=0.0)
"""clip.cpp's ggml_rope_ext arguments for a tower's RoPE: no YaRN, no context."""


def rope_2d(x: Tensor, pos_a: Tensor, pos_b: Tensor, base: float, interleave_freq: bool) -> Tensor:
    """2-D RoPE of (head_dim, heads, positions), clip_graph::build_rope_2d: the first half of each head turned
    by pos_a (a patch's row), the second half by pos_b (its column). interleave_freq: the second half takes
    the odd frequencies (a scale of base^(-2/head_dim), computed in float32 as the C++ does), Pixtral's."""
    n_dim = x.ne[0]
    half = n_dim // 2
    odd_scale = float(np.power(np.float32(base), np.float32(-2.0) / np.float32(n_dim))) if interleave_freq else 1.0
    x = x.rope(pos_a, half, base, 1.0, None, ROPE_2D)
    return x.rope(pos_b, half, base, odd_scale, None, ROPE_2D, offset=half)
