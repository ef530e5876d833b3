"""Nomic BERT (nomic-embed-text v1/v1.5, and v2 as nomic-bert-moe): BERT's post-norm encoder with rotary
positions.

Against BERT: no learned position table (queries and keys are NeoX-rotated by their positions, base
rope.freq_base), one fused q/k/v projection (attn_qkv, cut into views as llama.cpp's build_qkv does),
biases on the projections only where the file has them, and a SwiGLU feed-forward (ffn_gate, ffn_up,
ffn_down). Token type 0 is added when the file has a token-type table. Pooling and normalisation are
BERT's.

nomic-bert-moe (v2, XLM-RoBERTa's Unigram vocabulary) has BERT's GELU feed-forward with biases instead,
and in every layer i with i % moe_every_n_layers == 1 (llama.cpp's rule: 1, 3, 5... for 2) a mixture
of experts: a softmax router picks expert_used_count of expert_count ungated GELU experts (ffn_up_exps,
ffn_down_exps, as wide as feed_forward_length) whose outputs are summed weighted by their probabilities,
not renormalised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ollama_engine.kvcache import Batch, attention
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, bind, register, weight
from .moe import Gating, Routing, bind_experts, moe
from .pooling import Options, Pooling, pool


@dataclass
class Layer:
    attn_qkv: Tensor = weight("attn_qkv.weight")
    attn_qkv_bias: Tensor | None = weight("attn_qkv.bias", optional=True)
    attn_output: Tensor = weight("attn_output.weight")
    attn_output_bias: Tensor | None = weight("attn_output.bias", optional=True)
    attn_output_norm: Tensor = weight("attn_output_norm.weight")
    attn_output_norm_bias: Tensor = weight("attn_output_norm.bias")
    layer_output_norm: Tensor = weight("layer_output_norm.weight")
    layer_output_norm_bias: Tensor = weight("layer_output_norm.bias")


@dataclass
class SwiGLU:
    """v1's feed-forward."""

    up: Tensor = weight("ffn_up.weight")
    gate: Tensor = weight("ffn_gate.weight")
    down: Tensor = weight("ffn_down.weight")


@dataclass
class Gelu:
    """v2's dense feed-forward: BERT's."""

    up: Tensor = weight("ffn_up.weight")
    up_bias: Tensor | None = weight("ffn_up.bias", optional=True)
    down: Tensor = weight("ffn_down.weight")
    down_bias: Tensor | None = weight("ffn_down.bias", optional=True)


@dataclass
class Weights:
    token_embd: Tensor = weight("token_embd.weight")
    token_types: Tensor | None = weight("token_types.weight", optional=True)
    token_embd_norm: Tensor = weight("token_embd_norm.weight")
    token_embd_norm_bias: Tensor = weight("token_embd_norm.bias")


@register("nomic-bert", "nomic-bert_embed")
class NomicBert(Model):
    rope_options = RopeOptions(neox=True)

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.options = Options.from_config(self.config)
        self.rope_base = self.config.get_float("rope.freq_base", 10000.0)
        self.rope_dims = self.config.get_uint("rope.dimension_count", self.options.head_dim)
        self.weights = bind(Weights, backend)
        self.layers = [bind(Layer, backend, f"blk.{i}.") for i in range(self.options.block_count)]
        self.cache = None
        self.bind_ffns(backend)

    def bind_ffns(self, backend: Backend) -> None:
        self.ffns = [bind(SwiGLU, backend, f"blk.{i}.") for i in range(self.options.block_count)]

    def ffn(self, i: int, h: Tensor) -> Tensor:
        """Layer i's feed-forward of the normed hidden states h (hidden, n)."""
        f = self.ffns[i]
        return f.down.matmul(f.gate.matmul(h).silu(f.up.matmul(h))).set_name(f"ffn_out-{i}")

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
            h = self.ffn(i, h).add(h).layer_norm(layer.layer_output_norm, layer.layer_output_norm_bias, o.eps)
        h.set_name("result_embd")
        if o.pooling == Pooling.NONE:
            return h
        h = pool(h, o).set_name("result_embd_pooled")
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


@register("nomic-bert-moe", "nomic-bert-moe_embed")
class NomicBertMoe(NomicBert):
    def bind_ffns(self, backend: Backend) -> None:
        every = self.config.get_uint("moe_every_n_layers", 0)
        self.mixtures = {i for i in range(self.options.block_count) if every > 0 and i % every == 1}
        self.routing = Routing.from_config(self.config, Gating.SOFTMAX, normalize=False) if self.mixtures else None
        self.dense = {i: bind(Gelu, backend, f"blk.{i}.") for i in range(self.options.block_count)
                      if i not in self.mixtures}
        self.experts = {i: bind_experts(backend, i, self.routing, self.options.hidden, gated=False)
                        for i in self.mixtures}

    def ffn(self, i: int, h: Tensor) -> Tensor:
        if i in self.experts:
            assert self.routing is not None
            # no gate: gelu(up), as llama.cpp's build_moe_ffn with LLM_FFN_GELU and no gate_exps
            return moe(h, self.experts[i], self.routing, i,
                       activation=lambda up, _none: up.gelu().set_name(f"ffn_moe_gelu-{i}"))
        f = self.dense[i]
        up = f.up.matmul(h)
        up = (up.add(f.up_bias) if f.up_bias is not None else up).gelu().set_name(f"ffn_gelu-{i}")
        down = f.down.matmul(up)
        return (down.add(f.down_bias) if f.down_bias is not None else down).set_name(f"ffn_out-{i}")
