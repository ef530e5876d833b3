"""Qwen2 and Qwen2-MoE: Llama's layer with biases on the query, key and value projections, and NeoX RoPE.

Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) has Qwen2's attention and, for every FFN, a mixture of
experts plus a shared expert that a sigmoid gates per token. As llama.cpp's qwen2moe graph: the router's
softmax picks expert_used_count of expert_count experts, whose weights are not renormalised (build_moe_ffn
without norm_w); each expert is a SwiGLU of width expert_feed_forward_length. The shared expert is a SwiGLU
(ffn_*_shexp), its output multiplied by sigmoid(ffn_gate_inp_shexp · x) and added to the mixture's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.kvcache import Batch, Causal
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .alone import matmul_alone
from .base import Model, ModelError, bind, register, weight
from .layers import Output, attend, ffn, head, heads, inputs
from .moe import Experts, Gating, Routing, bind_experts, moe
from .options import Options


@dataclass
class Attention:
    """A layer's attention weights and its norms; the FFN's are Qwen2Layer's or Qwen2MoeLayer's."""

    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_q_bias: Tensor = weight("attn_q.bias")
    attn_k: Tensor = weight("attn_k.weight")
    attn_k_bias: Tensor = weight("attn_k.bias")
    attn_v: Tensor = weight("attn_v.weight")
    attn_v_bias: Tensor = weight("attn_v.bias")
    attn_output: Tensor = weight("attn_output.weight")
    rope_freqs: Tensor | None = weight("rope_freqs.weight", optional=True)
    ffn_norm: Tensor = weight("ffn_norm.weight")


@dataclass
class Qwen2Layer(Attention):
    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")


@dataclass
class Qwen2MoeLayer(Attention):
    """The shared expert's weights; the routed experts are bound apart."""

    ffn_gate_inp_shexp: Tensor = weight("ffn_gate_inp_shexp.weight")  # (n_embd,): the shared expert's gate
    ffn_gate_shexp: Tensor = weight("ffn_gate_shexp.weight")
    ffn_up_shexp: Tensor = weight("ffn_up_shexp.weight")
    ffn_down_shexp: Tensor = weight("ffn_down_shexp.weight")


@register("qwen2")
class Qwen2(Model):
    layer_type: type[Attention] = Qwen2Layer
    rope_options = RopeOptions(neox=True)
    reuse_graphs = True

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        if self.layer_type is Qwen2Layer and self.config.get_uint("expert_count", 0) > 0:
            raise ModelError(f"unknown model architecture: mixture-of-experts {self.config.architecture()}")
        self.options = o = Options.from_config(self.config)
        self.weights = bind(Output, backend)
        self.layers = [bind(self.layer_type, backend, f"blk.{i}.") for i in range(o.block_count)]
        self.cache = Causal(self.shift)

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o = self.options
        factors = self.layers[layer].rope_freqs
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, factors, self.rope_options)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def feed_forward(self, layer: Attention, x: Tensor, i: int, rows: tuple[int, ...] = ()) -> Tensor:
        """Layer i's FFN; rows: the rows per sequence, for a mixture's router (layers.Inputs.sequence_rows)."""
        assert isinstance(layer, Qwen2Layer)
        return ffn(x, layer.ffn_gate, layer.ffn_up, layer.ffn_down, i)

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        o, w = self.options, self.weights
        inp = inputs(ctx, batch, len(self.layers), self.rows_alone)
        h = w.token_embd.rows(inp.tokens).set_name("embd")
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            x = h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}")
            q = heads(x, layer.attn_q, layer.attn_q_bias, o.head_dim, o.heads)
            k = heads(x, layer.attn_k, layer.attn_k_bias, o.head_dim, o.kv_heads)
            v = heads(x, layer.attn_v, layer.attn_v_bias, o.head_dim, o.kv_heads).set_name(f"Vcur-{i}")
            q = self.rope(q, inp.positions, i).set_name(f"Qcur-{i}")
            k = self.rope(k, inp.positions, i).set_name(f"Kcur-{i}")
            x = attend(ctx, self.cache, q, k, v, o.attention_scale, i)
            if inp.done(i):
                return None
            x, h = inp.rows(i, layer.attn_output.matmul(x).set_name(f"attn_out-{i}"), h)
            h = x.add(h).set_name(f"ffn_inp-{i}")
            x = self.feed_forward(layer, h.rms_norm(layer.ffn_norm, o.eps).set_name(f"ffn_norm-{i}"), i,
                                  inp.sequence_rows(i))
            h = x.set_name(f"ffn_out-{i}").add(h).set_name(f"l_out-{i}")
        return head(h, w.output_norm, w.output, o.eps)


@register("qwen2moe")
class Qwen2Moe(Qwen2):
    layer_type = Qwen2MoeLayer

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.routing = Routing.from_config(self.config, Gating.SOFTMAX, normalize=False)
        self.experts: list[Experts] = [bind_experts(backend, i, self.routing, self.options.hidden)
                                       for i in range(self.options.block_count)]

    def feed_forward(self, layer: Attention, x: Tensor, i: int, rows: tuple[int, ...] = ()) -> Tensor:
        assert isinstance(layer, Qwen2MoeLayer)
        mixed = moe(x, self.experts[i], self.routing, i, rows=rows)
        gate = matmul_alone(layer.ffn_gate_inp_shexp, x, rows).sigmoid().set_name(f"ffn_shexp_gate-{i}")  # (1, n)
        shared = ffn(x, layer.ffn_gate_shexp, layer.ffn_up_shexp, layer.ffn_down_shexp, i).set_name(f"ffn_shexp-{i}")
        shared = shared.mul(gate).set_name(f"ffn_shexp_out-{i}")
        return mixed.add(shared)
