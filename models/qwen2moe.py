"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention; every FFN a mixture of experts plus
a shared expert that a sigmoid gates per token.

As llama.cpp's qwen2moe graph: the router's softmax picks expert_used_count of expert_count experts,
whose weights are not renormalised (build_moe_ffn without norm_w); each expert is a SwiGLU of width
expert_feed_forward_length. The shared expert is a SwiGLU (ffn_*_shexp), its output multiplied by
sigmoid(ffn_gate_inp_shexp · x) and added to the mixture's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.ml import Backend, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import register, weight
from .llama import MoeLayer
from .moe import Gating, Routing, bind_experts, moe
from .qwen2 import Qwen2


@dataclass
class Qwen2MoeLayer(MoeLayer):
    """Qwen2's attention weights and the shared expert's; the routed experts are bound apart."""

    attn_q_bias: Tensor = weight("attn_q.bias")
    attn_k_bias: Tensor = weight("attn_k.bias")
    attn_v_bias: Tensor = weight("attn_v.bias")
    ffn_gate_inp_shexp: Tensor = weight("ffn_gate_inp_shexp.weight")  # (n_embd,): the shared expert's gate
    ffn_gate_shexp: Tensor = weight("ffn_gate_shexp.weight")
    ffn_up_shexp: Tensor = weight("ffn_up_shexp.weight")
    ffn_down_shexp: Tensor = weight("ffn_down_shexp.weight")


@register("qwen2moe")
class Qwen2Moe(Qwen2):
    layer_type = Qwen2MoeLayer  # type: ignore[assignment]

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.routing = Routing.from_config(self.config, Gating.SOFTMAX, normalize=False)
        self.experts = [bind_experts(backend, i, self.routing, self.options.hidden)
                        for i in range(self.options.block_count)]

    def feed_forward(self, layer: Qwen2MoeLayer, x: Tensor, index: int) -> Tensor:  # type: ignore[override]
        mixed = moe(x, self.experts[index], self.routing, index)
        gate = layer.ffn_gate_inp_shexp.matmul(x).sigmoid().set_name(f"ffn_shexp_gate-{index}")  # (1, n)
        shared = layer.ffn_down_shexp.matmul(layer.ffn_gate_shexp.matmul(x).silu(layer.ffn_up_shexp.matmul(x)))
        shared = shared.set_name(f"ffn_shexp-{index}").mul(gate).set_name(f"ffn_shexp_out-{index}")
        return mixed.add(shared)
