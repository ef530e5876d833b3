"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, a mixture of experts for every FFN.

The router's softmax picks expert_used_count of expert_count experts per token; their weights are
renormalised to sum to 1 (llama.cpp's build_moe_ffn with norm_w, as qwen3moe.cpp calls it). Each
expert is a SwiGLU of width expert_feed_forward_length. There are no shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.ml import Backend, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import register, weight
from .moe import Gating, Routing, bind_experts, moe
from .qwen3 import Qwen3


@dataclass
class Qwen3MoeLayer:
    """Qwen3's attention weights; the FFN's are bound separately as Experts."""

    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_q_norm: Tensor = weight("attn_q_norm.weight")
    attn_k_norm: Tensor = weight("attn_k_norm.weight")
    attn_output: Tensor = weight("attn_output.weight")
    rope_freqs: Tensor | None = weight("rope_freqs.weight", optional=True)
    ffn_norm: Tensor = weight("ffn_norm.weight")


@register("qwen3moe")
class Qwen3Moe(Qwen3):
    layer_type = Qwen3MoeLayer

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.routing = Routing.from_config(self.config, Gating.SOFTMAX, normalize=True)
        self.experts = [bind_experts(backend, i, self.routing, self.options.hidden)
                        for i in range(self.options.block_count)]

    def feed_forward(self, layer: Qwen3MoeLayer, x: Tensor, index: int) -> Tensor:
        return moe(x, self.experts[index], self.routing, index)
