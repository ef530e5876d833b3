"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): Llama's layer with fused projections and LongRoPE.

As llama.cpp's phi3 graph: q, k and v come from one matmul (attn_qkv; some files have attn_q/k/v
instead), the feed-forward's gate and up from one (ffn_up, 2 * feed_forward_length wide: the first half
is the gate, silu(gate) * up); NeoX RoPE over rope.dimension_count dims (partial for Phi-4-mini). The
128k-context models carry two sets of per-frequency factors: rope_factors_long where a sequence's
context is longer than rope.scaling.original_context_length, else rope_factors_short, with the cos/sin
multiplier rope.scaling.attn_factor. The query is scaled by 1/sqrt(head_dim) before attention.

No sliding window: llama.cpp, the reference, disables Phi-3's even where the file sets
attention.sliding_window (the converters' values are not what the models were trained with, see
llama.cpp PR 13676), so a file with one attends to its whole context here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ollama_engine.ml import Backend, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import ModelError, register, weight
from .llama import Llama


@dataclass
class Phi3Layer:
    attn_norm: Tensor = weight("attn_norm.weight")
    attn_qkv: Tensor | None = weight("attn_qkv.weight", optional=True)
    attn_q: Tensor | None = weight("attn_q.weight", optional=True)
    attn_k: Tensor | None = weight("attn_k.weight", optional=True)
    attn_v: Tensor | None = weight("attn_v.weight", optional=True)
    attn_output: Tensor = weight("attn_output.weight")
    ffn_norm: Tensor = weight("ffn_norm.weight")
    ffn_up: Tensor = weight("ffn_up.weight")  # gate and up, stacked
    ffn_down: Tensor = weight("ffn_down.weight")
    rope_factors_long: Tensor | None = weight("rope_factors_long.weight", optional=True)  # per layer, copied
    rope_factors_short: Tensor | None = weight("rope_factors_short.weight", optional=True)


@register("phi3")
class Phi3(Llama):
    layer_type = Phi3Layer

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        if backend.model is not None and backend.model.config.get_uint("expert_count", 0) > 0:
            raise ModelError("unknown model architecture: mixture-of-experts phi3 (phimoe)")
        super().__init__(backend, tokenizer)
        for i, layer in enumerate(self.layers):
            if layer.attn_qkv is None and None in (layer.attn_q, layer.attn_k, layer.attn_v):
                raise ModelError(f"model is missing required tensor blk.{i}.attn_qkv.weight (or attn_q/k/v)")
        c = self.config
        # llama.cpp's n_ctx_orig_yarn: compared with a sequence's context to choose the factors
        self.original_context = c.get_uint("rope.scaling.original_context_length", c.get_uint("context_length", 0))
        self.rope_options = RopeOptions(
            neox=True, original_context=self.original_context,
            attention_factor=c.get_float("rope.scaling.attn_factor", 1.0),
        )
        # 1.0f / sqrtf(head_dim) in float32, as llama.cpp computes it
        self.query_scale = float(np.float32(1) / np.sqrt(np.float32(self.options.head_dim)))

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        """RoPE with the long factors where a sequence's context (the cache's, padded as llama.cpp's) exceeds
        the original context, else the short ones (llama_model::get_rope_factors)."""
        o, weights = self.options, self.layers[layer]
        long = self.cache.region > self.original_context
        factors = weights.rope_factors_long if long else weights.rope_factors_short
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, factors, self.rope_options)

    def qkv(self, layer: Phi3Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if layer.attn_qkv is None:
            return super().qkv(layer, x)  # type: ignore[arg-type]
        o, n = self.options, x.ne[1]
        qkv = layer.attn_qkv.matmul(x)
        element, row = qkv.strides[0], qkv.strides[1]
        head = o.head_dim * element

        def heads(first: int, count: int) -> Tensor:  # views of the fused rows, as llama.cpp's build_qkv
            return qkv.view(first * head, (o.head_dim, count, n), (head, row))

        return heads(0, o.heads), heads(o.heads, o.kv_heads), heads(o.heads + o.kv_heads, o.kv_heads).contiguous()

    def query(self, q: Tensor, layer: int) -> tuple[Tensor, float]:
        return q.scale(self.query_scale).set_name(f"Qcur-{layer}"), 1.0

    def feed_forward(self, layer: Phi3Layer, x: Tensor, index: int) -> Tensor:  # type: ignore[override]
        """SwiGLU of the fused gate/up rows: ffn_down(silu(first half) * second half)."""
        up = layer.ffn_up.matmul(x).set_name(f"ffn_up-{index}")
        width, n, row = up.ne[0] // 2, up.ne[1], up.strides[1]
        gate, up = up.view(0, (width, n), (row,)), up.view(width * up.strides[0], (width, n), (row,))
        return layer.ffn_down.matmul(gate.silu(up).set_name(f"ffn_swiglu-{index}"))
