"""Qwen2: Llama's layer with biases on the query, key and value projections, and NeoX-style RoPE."""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.ml import RopeOptions, Tensor

from .base import register, weight
from .llama import Layer, Llama


@dataclass
class Qwen2Layer(Layer):
    attn_q_bias: Tensor = weight("attn_q.bias")
    attn_k_bias: Tensor = weight("attn_k.bias")
    attn_v_bias: Tensor = weight("attn_v.bias")


@register("qwen2")
class Qwen2(Llama):
    layer_type = Qwen2Layer
    rope_options = RopeOptions(neox=True)

    def qkv(self, layer: Qwen2Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        o, n = self.options, x.ne[1]
        q = layer.attn_q.matmul(x).add(layer.attn_q_bias).reshape(o.head_dim, o.heads, n)
        k = layer.attn_k.matmul(x).add(layer.attn_k_bias).reshape(o.head_dim, o.kv_heads, n)
        v = layer.attn_v.matmul(x).add(layer.attn_v_bias).reshape(o.head_dim, o.kv_heads, n)
        return q, k, v
