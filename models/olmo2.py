"""OLMo 2: Llama's layer with the norms after attention and feed-forward instead of before.

As llama.cpp's olmo2 graph: h += post_attention_norm(attn_output(attention(q, k, v))) with q and k
RMS-normalised over their whole width (all heads at once, not per head as Qwen3's) before NeoX RoPE;
then h += post_ffw_norm(ffn_down(silu(ffn_gate(h)) * ffn_up(h))). No norm before either, and a separate
output matrix. Llama's forward does this once the layer declares post-norms and no pre-norms.

OLMo 3 files use this architecture with sliding-window layers (attention.sliding_window) and YaRN on
the global ones; they are refused with a clear error rather than run without their window.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.ml import Backend, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import ModelError, register, weight
from .llama import Llama


@dataclass
class Olmo2Layer:
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_q_norm: Tensor = weight("attn_q_norm.weight")  # heads * head_dim wide
    attn_k_norm: Tensor = weight("attn_k_norm.weight")  # kv_heads * head_dim wide
    attn_output: Tensor = weight("attn_output.weight")
    post_attention_norm: Tensor = weight("post_attention_norm.weight")
    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")
    post_ffw_norm: Tensor = weight("post_ffw_norm.weight")


@register("olmo2")
class Olmo2(Llama):
    layer_type = Olmo2Layer
    rope_options = RopeOptions(neox=True)

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        window = self.config.get_uint("attention.sliding_window", 0)
        if window > 0:
            raise ModelError(f"olmo2 with sliding-window attention (OLMo 3, window {window}) is not supported yet")
        if self.options.head_dim * self.options.heads != self.options.hidden:
            raise ModelError("olmo2 needs attention.head_count * head size == embedding_length")

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o = self.options
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, None, self.rope_options)

    def qkv(self, layer: Olmo2Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        o, n, eps = self.options, x.ne[1], self.options.eps
        q = layer.attn_q.matmul(x).rms_norm(layer.attn_q_norm, eps).reshape(o.head_dim, o.heads, n)
        k = layer.attn_k.matmul(x).rms_norm(layer.attn_k_norm, eps).reshape(o.head_dim, o.kv_heads, n)
        v = layer.attn_v.matmul(x).reshape(o.head_dim, o.kv_heads, n)
        return q, k, v
