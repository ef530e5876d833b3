"""Llama (Llama 2 and 3, Mistral-style): RMSNorm, rotary attention with grouped KV heads, SwiGLU.

Per layer: h += attn_output(attention(rope(q), rope(k), v)) on rms_norm(h); then
h += ffn_down(silu(ffn_gate(x)) * ffn_up(x)) with x = rms_norm(h). Llama 3.1+ files carry rope
frequency factors (rope_freqs.weight); files without output.weight tie it to token_embd (the backend
makes that copy). Only the rows whose logits are needed leave the last layer's attention.

A file with experts (expert_count > 0: Mixtral; mistral3 files alike) has a mixture of experts in
place of every FFN, as llama.cpp's llama graph routes it (build_moe_ffn with a softmax router and the
chosen experts' weights renormalised to sum to 1; expert_weights_scale is not read, as llama.cpp does
not read it for llama): its layers are `MoeLayer`s and their experts are bound apart (moe.bind_experts).

Qwen2 and Qwen3 differ only in how q, k and v are made and in the RoPE variant, so they subclass this
one and override `qkv` and `rope_options`; Qwen3-MoE and Qwen2-MoE also override `feed_forward`. Other hooks:
`query` (phi3 scales the query itself, mistral3 by position) and `self_attention`. Norms are found by
name on the layer: `attn_norm` and `ffn_norm` before attention and feed-forward, `post_attention_norm`
and `post_ffw_norm` after them; a layer type that does not declare one skips it (llama has no
post-norms, olmo2 no pre-norms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch, Causal, attention
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, require_uint, weight
from .moe import Experts, Gating, Routing, bind_experts, moe


@dataclass
class MoeLayer:
    """A layer's weights but its FFN's: a mixture of experts' layer (Mixtral), whose experts are bound apart."""

    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_output: Tensor = weight("attn_output.weight")
    rope_freqs: Tensor | None = weight("rope_freqs.weight", optional=True)
    ffn_norm: Tensor = weight("ffn_norm.weight")


@dataclass
class Layer(MoeLayer):
    """A dense layer: SwiGLU."""

    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")


@dataclass
class Weights:
    token_embd: Tensor = weight("token_embd.weight")
    output_norm: Tensor = weight("output_norm.weight")
    output: Tensor = weight("output.weight")


@dataclass(frozen=True)
class Options:
    """Hyper-parameters, with llama.cpp's defaults where a key is absent."""

    block_count: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_dims: int
    rope_base: float
    rope_scale: float  # ggml's freq_scale: 1 / rope.scaling.factor
    eps: float
    attention_scale: float

    @classmethod
    def from_config(cls, config: Config) -> Options:
        hidden = require_uint(config, "embedding_length")
        heads = require_uint(config, "attention.head_count")
        kv_heads = config.get_uint("attention.head_count_kv", heads)
        if heads == 0 or kv_heads == 0 or heads % kv_heads:
            raise ModelError(f"attention.head_count {heads} must be a positive multiple of head_count_kv {kv_heads}")
        head_dim = config.get_uint("attention.key_length", hidden // heads)
        if head_dim == 0:
            raise ModelError(f"head size is 0 (embedding_length {hidden}, head_count {heads})")
        rope_dims = config.get_uint("rope.dimension_count", head_dim)
        if not 0 < rope_dims <= head_dim or rope_dims % 2:  # ggml rotates pairs; 0 made RoPE spin for minutes
            raise ModelError(f"rope.dimension_count {rope_dims} must be even and in 2..head size {head_dim}")
        factor = config.get_float("rope.scaling.factor", 0.0)
        scale = config.get_float("attention.scale", 0.0)
        return cls(
            block_count=require_uint(config, "block_count"),
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            rope_dims=rope_dims,
            rope_base=config.get_float("rope.freq_base", 10000.0),
            rope_scale=1.0 / factor if factor else 1.0,
            eps=config.get_float("attention.layer_norm_rms_epsilon", 1e-5),
            attention_scale=scale or 1.0 / math.sqrt(head_dim),
        )


@register("llama")
class Llama(Model):
    layer_type: type[Layer] = Layer
    rope_options = RopeOptions(neox=False)
    reuse_graphs = True

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        mixture = self.config.get_uint("expert_count", 0) > 0 and type(self).feed_forward is Llama.feed_forward
        if mixture and self.layer_type is not Layer:  # subclasses with their own layers route their own experts
            raise ModelError(f"unknown model architecture: mixture-of-experts {self.config.architecture()}")
        self.options = o = Options.from_config(self.config)
        self.weights = bind(Weights, backend)
        layer_type = MoeLayer if mixture else self.layer_type
        self.layers = [bind(layer_type, backend, f"blk.{i}.") for i in range(o.block_count)]
        self.routing: Routing | None = None
        self.experts: list[Experts | None] = [None] * o.block_count  # each layer's, None for a dense FFN
        if mixture:
            self.routing = Routing.from_config(self.config, Gating.SOFTMAX, normalize=True)
            self.experts = [bind_experts(backend, i, self.routing, o.hidden) for i in range(o.block_count)]
        self.cache = Causal(self.shift)

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o = self.options
        factors = self.layers[layer].rope_freqs
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, factors, self.rope_options)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def qkv(self, layer: Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Query (head_dim, heads, n), key and value (head_dim, kv_heads, n), before RoPE."""
        o, n = self.options, x.ne[1]
        q = layer.attn_q.matmul(x).reshape(o.head_dim, o.heads, n)
        k = layer.attn_k.matmul(x).reshape(o.head_dim, o.kv_heads, n)
        v = layer.attn_v.matmul(x).reshape(o.head_dim, o.kv_heads, n)
        return q, k, v

    def feed_forward(self, layer: Layer, x: Tensor, index: int) -> Tensor:
        """The FFN's output for the normed hidden states x of layer `index` (before the residual): the
        layer's mixture of experts where it has one, else SwiGLU."""
        experts = self.experts[index]
        if experts is not None and self.routing is not None:
            return moe(x, experts, self.routing, index)
        gate = layer.ffn_gate.matmul(x).set_name(f"ffn_gate-{index}")
        up = layer.ffn_up.matmul(x).set_name(f"ffn_up-{index}")
        return layer.ffn_down.matmul(gate.silu(up).set_name(f"ffn_swiglu-{index}"))

    def query(self, q: Tensor, layer: int) -> tuple[Tensor, float]:
        """The roped query as attention takes it, and the scale attention applies to its scores."""
        return q, self.options.attention_scale

    def norm(self, x: Tensor, layer: object, name: str, index: int, label: str = "") -> Tensor:
        """x RMS-normalised by the layer's norm `name` (named `label` or `name`), or x where there is none."""
        weight = getattr(layer, name, None)
        return x if weight is None else x.rms_norm(weight, self.options.eps).set_name(f"{label or name}-{index}")

    def self_attention(self, ctx: Context, layer: Layer, x: Tensor, positions: Tensor, i: int) -> Tensor:
        """Attention over the cache for the hidden states x: (head_dim * heads, n), before attn_output."""
        o = self.options
        q, k, v = self.qkv(layer, x)
        q, scale = self.query(self.rope(q, positions, i).set_name(f"Qcur-{i}"), i)
        k = self.rope(k, positions, i).set_name(f"Kcur-{i}")
        x = attention(ctx, q, k, v.set_name(f"Vcur-{i}"), scale, self.cache)
        return x.reshape(o.head_dim * o.heads, x.ne[2]).set_name(f"kqv_out-{i}")

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        if batch.tokens is None:
            raise ValueError("a text model's batch needs token ids")
        inputs = ctx.input()
        positions = inputs.from_numpy(batch.positions).set_name("positions")
        h = self.weights.token_embd.rows(inputs.from_numpy(batch.tokens).set_name("tokens")).set_name("embd")
        outputs = inputs.from_numpy(batch.outputs).set_name("outputs") if len(batch.outputs) else None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            x = self.self_attention(ctx, layer, self.norm(h, layer, "attn_norm", i), positions, i)
            if i == last:
                if outputs is None:
                    return None  # the keys and values are stored; nothing else is wanted
                x, h = x.rows(outputs), h.rows(outputs)
            x = layer.attn_output.matmul(x).set_name(f"attn_out-{i}")
            x = self.norm(x, layer, "post_attention_norm", i, "attn_post_norm")
            h = x.add(h).set_name(f"ffn_inp-{i}")
            x = self.feed_forward(layer, self.norm(h, layer, "ffn_norm", i), i).set_name(f"ffn_out-{i}")
            h = self.norm(x, layer, "post_ffw_norm", i, "ffn_post_norm").add(h).set_name(f"l_out-{i}")
        h = h.rms_norm(self.weights.output_norm, self.options.eps).set_name("result_norm")
        return self.weights.output.matmul(h).set_name("result_output")
