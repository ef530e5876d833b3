"""Qwen3 and Qwen3-MoE: Llama's layer with RMSNorm on each query and key head before NeoX RoPE.

Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B) has a mixture of experts for every FFN: the router's softmax picks
expert_used_count of expert_count experts per token; their weights are renormalised to sum to 1 (llama.cpp's
build_moe_ffn with norm_w, as qwen3moe.cpp calls it). Each expert is a SwiGLU of width
expert_feed_forward_length. There are no shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.kvcache import Batch, Causal
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, weight
from .layers import Output, attend, ffn, head, heads, inputs
from .moe import Experts, Gating, Routing, bind_experts, moe
from .options import Options


@dataclass
class Qwen3MoeLayer:
    """Qwen3's attention weights; a mixture's FFN weights are bound apart as Experts."""

    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_q_norm: Tensor = weight("attn_q_norm.weight")
    attn_k_norm: Tensor = weight("attn_k_norm.weight")
    attn_output: Tensor = weight("attn_output.weight")
    rope_freqs: Tensor | None = weight("rope_freqs.weight", optional=True)
    ffn_norm: Tensor = weight("ffn_norm.weight")


@dataclass
class Qwen3Layer(Qwen3MoeLayer):
    """A dense layer: SwiGLU."""

    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")


@register("qwen3")
class Qwen3(Model):
    layer_type: type[Qwen3MoeLayer] = Qwen3Layer
    rope_options = RopeOptions(neox=True)
    reuse_graphs = True

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        if self.layer_type is Qwen3Layer and self.config.get_uint("expert_count", 0) > 0:
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

    def feed_forward(self, layer: Qwen3MoeLayer, x: Tensor, i: int, rows: tuple[int, ...] = ()) -> Tensor:
        """Layer i's FFN; rows: the rows per sequence, for a mixture's router (layers.Inputs.sequence_rows)."""
        assert isinstance(layer, Qwen3Layer)
        return ffn(x, layer.ffn_gate, layer.ffn_up, layer.ffn_down, i)

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        o, w = self.options, self.weights
        inp = inputs(ctx, batch, len(self.layers), self.rows_alone)
        h = w.token_embd.rows(inp.tokens).set_name("embd")
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            x = h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}")
            q = heads(x, layer.attn_q, None, o.head_dim, o.heads).rms_norm(layer.attn_q_norm, o.eps)
            k = heads(x, layer.attn_k, None, o.head_dim, o.kv_heads).rms_norm(layer.attn_k_norm, o.eps)
            v = heads(x, layer.attn_v, None, o.head_dim, o.kv_heads).set_name(f"Vcur-{i}")
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


@register("qwen3moe")
class Qwen3Moe(Qwen3):
    layer_type = Qwen3MoeLayer

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.routing = Routing.from_config(self.config, Gating.SOFTMAX, normalize=True)
        self.experts: list[Experts] = [bind_experts(backend, i, self.routing, self.options.hidden)
                                       for i in range(self.options.block_count)]

    def feed_forward(self, layer: Qwen3MoeLayer, x: Tensor, i: int, rows: tuple[int, ...] = ()) -> Tensor:
        return moe(x, self.experts[i], self.routing, i, rows=rows)
