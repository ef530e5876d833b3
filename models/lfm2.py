"""LFM2 (Liquid AI): short-convolution layers with a few attention layers, on the Recurrent cache.

As llama.cpp's lfm2 graph: a layer whose attention.head_count_kv entry is 0 is a short convolution,
the others attention. Each layer: h += op(rms_norm(h)) (operator_norm), then
h += ffn_down(silu(ffn_gate(x)) * ffn_up(x)) with x = rms_norm(h). The output norm is stored as
token_embd_norm; the output matrix is tied to token_embd where the file has none.

Short convolution: b, c, x = split(in_proj(h)); the channels of b * x are convolved over time with a
kernel of shortconv.l_cache taps (ggml_ssm_conv) whose first l_cache - 1 inputs are the previous tokens'
(the state the cache keeps per sequence: the last l_cache - 1 inputs of every channel); the result times c
goes through out_proj. Attention: per-head RMS-normalised q and k (attn_q_norm, attn_k_norm), NeoX RoPE.
Each sequence of a batch is convolved on its own (kvcache/recurrent.py). Files with
attention.sliding_window make every attention layer a sliding-window one. LFM2-MoE (Lfm2Moe, below) has
mixtures of experts in place of all but the leading dense FFNs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ollama_engine.kvcache import Batch, Recurrent, attention
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, require_uint, weight
from .layers import Dense, ffn, head, inputs, per_sequence
from .moe import Experts, Gating, Routing, bind_experts, moe
from .sliding import check_window

GATING = {1: Gating.SOFTMAX, 2: Gating.SIGMOID}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*


@dataclass
class Norms:
    attn_norm: Tensor = weight("attn_norm.weight")  # llama.cpp's operator_norm, before either kind of op
    ffn_norm: Tensor = weight("ffn_norm.weight")


@dataclass
class ConvLayer(Norms):
    conv: Tensor = weight("shortconv.conv.weight")  # (l_cache, hidden), F32
    in_proj: Tensor = weight("shortconv.in_proj.weight")  # hidden -> 3 * hidden: b, c, x
    out_proj: Tensor = weight("shortconv.out_proj.weight")


@dataclass
class AttentionLayer(Norms):
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_q_norm: Tensor = weight("attn_q_norm.weight")
    attn_k_norm: Tensor = weight("attn_k_norm.weight")
    attn_output: Tensor = weight("attn_output.weight")


@dataclass
class Weights:
    token_embd: Tensor = weight("token_embd.weight")
    output_norm: Tensor = weight("token_embd_norm.weight")  # llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2
    output: Tensor = weight("output.weight")


@register("lfm2")
class Lfm2(Model):
    reuse_graphs = True
    tensor_groups = Model.tensor_groups.extended(outputs=("token_embd_norm",))  # LLM_TENSOR_OUTPUT_NORM_LFM2
    rope_options = RopeOptions(neox=True)

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        c = self.config
        self.blocks = require_uint(c, "block_count")
        self.hidden = require_uint(c, "embedding_length")
        self.heads = require_uint(c, "attention.head_count")
        kv = c.value("attention.head_count_kv")
        self.kv_heads = [int(v) for v in kv] if isinstance(kv, list) else [int(kv)] * self.blocks
        if len(self.kv_heads) != self.blocks or self.heads == 0 or any(h and self.heads % h for h in self.kv_heads):
            raise ModelError(f"lfm2: attention.head_count_kv {kv} must give each of {self.blocks} layers 0 (a short "
                             f"convolution) or a divisor of head_count {self.heads}")
        self.head_dim = self.hidden // self.heads
        self.l_cache = require_uint(c, "shortconv.l_cache")
        if self.l_cache < 2:
            raise ModelError(f"lfm2: shortconv.l_cache must be at least 2, got {self.l_cache}")
        window = c.get_uint("attention.sliding_window", 0)
        check_window(window, (bool(window),))
        self.eps = c.get_float("attention.layer_norm_rms_epsilon", 1e-5)
        self.rope_base = c.get_float("rope.freq_base", 10000.0)
        self.weights = bind(Weights, backend)
        self.layers: list[ConvLayer | AttentionLayer] = [
            bind(AttentionLayer if self.kv_heads[i] else ConvLayer, backend, f"blk.{i}.") for i in range(self.blocks)]
        self.dense = {i: bind(Dense, backend, f"blk.{i}.") for i in range(self.blocks) if self.is_dense(i)}
        self.routing: Routing | None = None
        self.experts: dict[int, Experts] = {}
        conv_state = (self.l_cache - 1) * self.hidden
        # with attention.sliding_window every attention layer slides (llama.cpp's iswa graph), in a ring of
        # n_swa + batch cells as gemma2's (llama.cpp's n_swa counts the token itself)
        sliding = {"window_size": max(window - 1, 1)} if window else {}
        self.cache = Recurrent(self.shift, {i: (conv_state,) for i in range(self.blocks) if not self.kv_heads[i]},
                               **sliding)

    def is_dense(self, layer: int) -> bool:
        """Whether the layer's FFN is a plain SwiGLU (every layer's, in lfm2)."""
        return True

    def feed_forward(self, x: Tensor, layer: int, rows: tuple[int, ...]) -> Tensor:
        """The FFN's output for the normed hidden states x of `layer` (rows: per sequence, for a router)."""
        if not self.is_dense(layer):
            assert self.routing is not None
            return moe(x, self.experts[layer], self.routing, layer, rows=rows)
        dense = self.dense[layer]
        return ffn(x, dense.ffn_gate, dense.ffn_up, dense.ffn_down, layer)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return key.rope(delta, self.head_dim, self.rope_base, 1.0, None, self.rope_options)

    def short_conv(self, ctx: Context, layer: ConvLayer, x: Tensor, i: int) -> Tensor:
        """The short convolution of x (hidden, n), each sequence of the batch with its own state."""
        h, d_conv = self.hidden, self.l_cache - 1
        bcx = layer.in_proj.matmul(x).set_name(f"model.layers.{{}}.conv.in_proj-{i}")
        stride = bcx.strides[1]
        b, x = (bcx.view(k * h * 4, (h, bcx.ne[1]), (stride,)) for k in (0, 2))
        bx = b.mul(x)

        def convolve(s: int, begin: int, count: int) -> Tensor:
            state = self.cache.state(ctx, i, s).reshape(d_conv, h)
            sx = state.concat(bx.view(begin * bx.strides[1], (h, count)).transpose(), 0)  # (d_conv + count, h)
            for cut, k in enumerate(self.cache.splits(s)):  # the state after k inputs: the d_conv before
                self.cache.keep(ctx, i, s, cut, [sx.view(k * 4, (d_conv, h), (sx.strides[1],))])
            self.cache.update(ctx, i, s, [sx.view(count * 4, (d_conv, h), (sx.strides[1],))])
            conv = sx.reshape(d_conv + count, h, 1).ssm_conv(layer.conv).reshape(h, count)
            return bcx.view(begin * stride + h * 4, (h, count), (stride,)).mul(conv)  # c's columns

        y = per_sequence(self.cache.spans(), convolve)
        return layer.out_proj.matmul(y).set_name(f"model.layers.{{}}.conv.out_proj-{i}")

    def self_attention(self, ctx: Context, layer: AttentionLayer, x: Tensor, positions: Tensor, i: int) -> Tensor:
        n, d, kv = x.ne[1], self.head_dim, self.kv_heads[i]
        q = layer.attn_q.matmul(x).reshape(d, self.heads, n).rms_norm(layer.attn_q_norm, self.eps)
        k = layer.attn_k.matmul(x).reshape(d, kv, n).rms_norm(layer.attn_k_norm, self.eps)
        v = layer.attn_v.matmul(x).reshape(d, kv, n)
        q = q.rope(positions, d, self.rope_base, 1.0, None, self.rope_options)
        k = k.rope(positions, d, self.rope_base, 1.0, None, self.rope_options)
        x = attention(ctx, q, k, v, 1.0 / math.sqrt(d), self.cache).reshape(d * self.heads, n)
        return layer.attn_output.matmul(x).set_name(f"model.layers.{{}}.self_attn.out_proj-{i}")

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        inp = inputs(ctx, batch, self.blocks, self.rows_alone)
        h = self.weights.token_embd.rows(inp.tokens)
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            x = h.rms_norm(layer.attn_norm, self.eps).set_name(f"model.layers.{{}}.operator_norm-{i}")
            if isinstance(layer, ConvLayer):
                x = self.short_conv(ctx, layer, x, i)
            else:
                x = self.self_attention(ctx, layer, x, inp.positions, i)
            if inp.done(i):
                return None
            x, h = inp.rows(i, x, h)
            h = h.add(x)
            x = self.feed_forward(h.rms_norm(layer.ffn_norm, self.eps), i, inp.sequence_rows(i))
            h = h.add(x).set_name(f"l_out-{i}")
        return head(h, self.weights.output_norm, self.weights.output, self.eps)


@register("lfm2moe")
class Lfm2Moe(Lfm2):
    """LFM2-MoE (LFM2-8B-A1B, LFM2-24B-A2B): LFM2's short convolutions and attention, with mixtures of experts.

    As llama.cpp's lfm2moe (which builds lfm2's graph): the first leading_dense_block_count layers have
    LFM2's SwiGLU FFN, the others a mixture of expert_feed_forward_length-wide SwiGLU experts routed as
    expert_gating_func says (sigmoid in LFM2-MoE's files), picked by the probabilities plus the selection bias
    exp_probs_b, their weights normalised to sum to 1 (models/moe.py).
    """

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        gating = self.config.get_uint("expert_gating_func", 1)
        if gating not in GATING:
            raise ModelError(f"lfm2moe: expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
        self.routing = Routing.from_config(self.config, GATING[gating], normalize=True)
        self.experts = {i: bind_experts(backend, i, self.routing, self.hidden)
                        for i in range(self.blocks) if not self.is_dense(i)}

    def is_dense(self, layer: int) -> bool:
        return layer < self.config.get_uint("leading_dense_block_count", 0)
