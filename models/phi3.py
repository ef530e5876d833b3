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

from ollama_engine.kvcache import Batch, Causal
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, weight
from .layers import Output, attend, f32_reciprocal_sqrt, fused_heads, head, heads, inputs
from .options import Options


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
class Phi3(Model):
    reuse_graphs = True

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        c = self.config
        if c.get_uint("expert_count", 0) > 0:
            raise ModelError("unknown model architecture: mixture-of-experts phi3 (phimoe)")
        self.options = o = Options.from_config(c)
        self.weights = bind(Output, backend)
        self.layers = [bind(Phi3Layer, backend, f"blk.{i}.") for i in range(o.block_count)]
        for i, layer in enumerate(self.layers):
            if layer.attn_qkv is None and None in (layer.attn_q, layer.attn_k, layer.attn_v):
                raise ModelError(f"model is missing required tensor blk.{i}.attn_qkv.weight (or attn_q/k/v)")
        # llama.cpp's n_ctx_orig_yarn: compared with a sequence's context to choose the factors
        self.original_context = c.get_uint("rope.scaling.original_context_length", c.get_uint("context_length", 0))
        self.rope_options = RopeOptions(
            neox=True, original_context=self.original_context,
            attention_factor=c.get_float("rope.scaling.attn_factor", 1.0),
        )
        self.query_scale = f32_reciprocal_sqrt(o.head_dim)
        self.cache = Causal(self.shift)

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        """RoPE with the long factors where a sequence's context (the cache's, padded as llama.cpp's) exceeds
        the original context, else the short ones (llama_model::get_rope_factors)."""
        o, weights = self.options, self.layers[layer]
        long = self.cache.region > self.original_context
        factors = weights.rope_factors_long if long else weights.rope_factors_short
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, factors, self.rope_options)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def qkv(self, layer: Phi3Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        o = self.options
        if layer.attn_qkv is not None:
            return fused_heads(layer.attn_qkv.matmul(x), o.head_dim, o.heads, o.kv_heads)
        return (heads(x, layer.attn_q, None, o.head_dim, o.heads), heads(x, layer.attn_k, None, o.head_dim, o.kv_heads),
                heads(x, layer.attn_v, None, o.head_dim, o.kv_heads))

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        o, w = self.options, self.weights
        inp = inputs(ctx, batch, len(self.layers))
        h = w.token_embd.rows(inp.tokens).set_name("embd")
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            q, k, v = self.qkv(layer, h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}"))
            q = self.rope(q, inp.positions, i).scale(self.query_scale).set_name(f"Qcur-{i}")
            k = self.rope(k, inp.positions, i).set_name(f"Kcur-{i}")
            x = attend(ctx, self.cache, q, k, v.set_name(f"Vcur-{i}"), 1.0, i)
            if inp.done(i):
                return None
            x, h = inp.rows(i, layer.attn_output.matmul(x).set_name(f"attn_out-{i}"), h)
            h = x.add(h).set_name(f"ffn_inp-{i}")
            x = self.feed_forward(layer, h.rms_norm(layer.ffn_norm, o.eps).set_name(f"ffn_norm-{i}"), i)
            h = x.set_name(f"ffn_out-{i}").add(h).set_name(f"l_out-{i}")
        return head(h, w.output_norm, w.output, o.eps)

    @staticmethod
    def feed_forward(layer: Phi3Layer, x: Tensor, i: int) -> Tensor:
        """SwiGLU of the fused gate/up rows: ffn_down(silu(first half) * second half)."""
        up = layer.ffn_up.matmul(x).set_name(f"ffn_up-{i}")
        width, n, row = up.ne[0] // 2, up.ne[1], up.strides[1]
        gate, up = up.view(0, (width, n), (row,)), up.view(width * up.strides[0], (width, n), (row,))
        return layer.ffn_down.matmul(gate.silu(up).set_name(f"ffn_swiglu-{i}"))
