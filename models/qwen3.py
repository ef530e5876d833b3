"""Qwen3: Llama's layer with RMSNorm on each query and key head before NeoX-style RoPE."""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.ml import RopeOptions, Tensor

from .base import register, weight
from .llama import Layer, Llama


@dataclass
class Qwen3Layer(Layer):
    attn_q_norm: Tensor = weight("attn_q_norm.weight")
    attn_k_norm: Tensor = weight("attn_k_norm.weight")


@register("qwen3")
class Qwen3(Llama):
    layer_type = Qwen3Layer
    rope_options = RopeOptions(neox=True)

    def qkv(self, layer: Qwen3Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().qkv(layer, x)
        eps = self.options.eps
        return q.rms_norm(layer.attn_q_norm, eps), k.rms_norm(layer.attn_k_norm, eps), v
