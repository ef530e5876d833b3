"""Nomic BERT (nomic-embed-text v1/v1.5): BERT's post-norm encoder with rotary positions and SwiGLU.

Against BERT: no learned position table (queries and keys are NeoX-rotated by their positions, base
rope.freq_base), one fused q/k/v projection (attn_qkv, cut into views as llama.cpp's build_qkv does),
no biases on the projections, and a SwiGLU feed-forward (ffn_gate, ffn_up, ffn_down). Token type 0
is added when the file has a token-type table. Pooling and normalisation are BERT's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ollama_engine.kvcache import Batch, attention
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, weight
from .bert import Bert, Options, Pooling


@dataclass
class Layer:
    attn_qkv: Tensor = weight("attn_qkv.weight")
    attn_qkv_bias: Tensor | None = weight("attn_qkv.bias", optional=True)
    attn_output: Tensor = weight("attn_output.weight")
    attn_output_bias: Tensor | None = weight("attn_output.bias", optional=True)
    attn_output_norm: Tensor = weight("attn_output_norm.weight")
    attn_output_norm_bias: Tensor = weight("attn_output_norm.bias")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_down: Tensor = weight("ffn_down.weight")
    layer_output_norm: Tensor = weight("layer_output_norm.weight")
    layer_output_norm_bias: Tensor = weight("layer_output_norm.bias")


@dataclass
class Weights:
    token_embd: Tensor = weight("token_embd.weight")
    token_types: Tensor | None = weight("token_types.weight", optional=True)
    token_embd_norm: Tensor = weight("token_embd_norm.weight")
    token_embd_norm_bias: Tensor = weight("token_embd_norm.bias")


@register("nomic-bert", "nomic-bert_embed")
class NomicBert(Bert):
    rope_options = RopeOptions(neox=True)

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        Model.__init__(self, backend, tokenizer)  # not Bert's: its weights (a position table) differ
        self.options = Options.from_config(self.config)
        if self.config.get_uint("expert_count", 0) > 0 or self.config.get_uint("moe_every_n_layers", 0) > 0:
            raise ModelError("unknown model architecture: nomic-bert with a mixture of experts (nomic-bert-moe)")
        self.rope_base = self.config.get_float("rope.freq_base", 10000.0)
        self.rope_dims = self.config.get_uint("rope.dimension_count", self.options.head_dim)
        self.weights = bind(Weights, backend)
        self.layers = [bind(Layer, backend, f"blk.{i}.") for i in range(self.options.block_count)]
        self.cache = None

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        """The pooled embedding (hidden,) of the batch, or every token's hidden state without pooling."""
        if batch.tokens is None:
            raise ValueError("a text model's batch needs token ids")
        o, w, n = self.options, self.weights, len(batch)
        inputs = ctx.input()
        positions = inputs.from_numpy(batch.positions).set_name("positions")
        h = w.token_embd.rows(inputs.from_numpy(batch.tokens).set_name("tokens"))
        if w.token_types is not None:
            h = h.add(w.token_types.rows(inputs.from_numpy(np.zeros(1, dtype=np.int32)).set_name("token_type")))
        h = h.set_name("inp_embd").layer_norm(w.token_embd_norm, w.token_embd_norm_bias, o.eps).set_name("inp_norm-0")
        scale = 1.0 / math.sqrt(o.head_dim)
        for i, layer in enumerate(self.layers):
            q, k, v = self.qkv(layer, h)
            q = q.rope(positions, self.rope_dims, self.rope_base, options=self.rope_options).set_name(f"Qcur-{i}")
            k = k.rope(positions, self.rope_dims, self.rope_base, options=self.rope_options).set_name(f"Kcur-{i}")
            a = attention(ctx, q, k, v.set_name(f"Vcur-{i}"), scale).reshape(o.hidden, n)
            a = layer.attn_output.matmul(a)
            if layer.attn_output_bias is not None:
                a = a.add(layer.attn_output_bias)
            a.set_name(f"kqv_out-{i}")
            h = a.add(h).layer_norm(layer.attn_output_norm, layer.attn_output_norm_bias, o.eps).set_name(f"ffn_inp-{i}")
            f = layer.ffn_down.matmul(layer.ffn_gate.matmul(h).silu(layer.ffn_up.matmul(h))).set_name(f"ffn_out-{i}")
            h = f.add(h).layer_norm(layer.layer_output_norm, layer.layer_output_norm_bias, o.eps)
        h.set_name("result_embd")
        if o.pooling == Pooling.NONE:
            return h
        h = self.pool(h).set_name("result_embd_pooled")
        return h.l2_norm(1e-12) if o.normalize else h

    def qkv(self, layer: Layer, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Query, key and value (head_dim, heads, n): views of the fused projection, before RoPE."""
        o, n = self.options, h.ne[1]
        qkv = layer.attn_qkv.matmul(h)  # (3 * hidden, n)
        if layer.attn_qkv_bias is not None:
            qkv = qkv.add(layer.attn_qkv_bias)
        head = qkv.strides[0] * o.head_dim  # bytes of one head (the projection's output is F32)
        q, k, v = (qkv.view(i * o.heads * head, (o.head_dim, o.heads, n), (head, qkv.strides[1])) for i in range(3))
        return q, k, v
