"""Llama 4 (Scout, Maverick): the text model. Chunked attention with RoPE in three layers of four, global
attention without RoPE in the fourth, and a mixture of experts with a shared expert.

As llama.cpp's llama4 graph (its iswa branch, taken unless attention.sliding_window is 0):
- layers i % 4 < 3 (attention.sliding_window_pattern) attend only within their 8192-token chunk
  (llama.cpp fixes the chunk at 8192 whatever the file says); they rotate q and k (normal RoPE with
  Llama 3 frequency factors), then RMS-normalise them without a weight unless there are 128 experts
  (Maverick). Layers (i + 1) % 4 == 0 skip RoPE and scale the query by
  1 + 0.1 ln(floor((position + 1) / 8192) + 1) (temperature tuning), computed in the graph from the
  positions.
- layers (i + 1) % interleave_moe_layer_step == 0 are mixtures: sigmoid of the router's logit for the
  top experts (picked by raw logit), that weight multiplies each expert's input (not its output), plus a
  shared SwiGLU expert (ffn_*_shexp); the other layers have a dense SwiGLU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.kvcache import Batch, Causal, Wrapper
from ollama_engine.ml import Backend, Context, DType, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, weight
from .layers import Output, attend, ffn, head, heads, inputs
from .moe import Experts, Gating, Routing, bind_experts, moe
from .options import Options
from .sliding import swa_layers
from .vision import place_embeddings

CHUNKED, GLOBAL = 0, 1  # the Wrapper's caches, by layer type
CHUNK = 8192  # llama.cpp's n_swa for llama4, also the temperature's floor scale
TEMPERATURE_SCALE, TEMPERATURE_OFFSET = 0.1, 1.0


@dataclass
class Layer:
    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_output: Tensor = weight("attn_output.weight")
    rope_freqs: Tensor | None = weight("rope_freqs.weight", optional=True)
    ffn_norm: Tensor = weight("ffn_norm.weight")
    ffn_gate: Tensor | None = weight("ffn_gate.weight", optional=True)  # dense layers
    ffn_up: Tensor | None = weight("ffn_up.weight", optional=True)
    ffn_down: Tensor | None = weight("ffn_down.weight", optional=True)
    ffn_gate_shexp: Tensor | None = weight("ffn_gate_shexp.weight", optional=True)  # mixture layers
    ffn_up_shexp: Tensor | None = weight("ffn_up_shexp.weight", optional=True)
    ffn_down_shexp: Tensor | None = weight("ffn_down_shexp.weight", optional=True)


@register("llama4")
class Llama4(Model):
    rope_options = RopeOptions(neox=False)
    reuse_graphs = True

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        c = self.config
        self.options = o = Options.from_config(c)
        if c.get_uint("attention.sliding_window", CHUNK) == 0:
            raise ModelError("llama4 without chunked attention (attention.sliding_window 0) is not supported")
        self.weights = bind(Output, backend)
        self.layers = [bind(Layer, backend, f"blk.{i}.") for i in range(o.block_count)]
        step = c.get_uint("interleave_moe_layer_step", 0)
        self.routing = Routing.from_config(c, Gating.SIGMOID, normalize=False,
                                           scale=c.get_float("expert_weights_scale", 0.0), weight_before_ffn=True)
        self.chunked = swa_layers(c, o.block_count, 4)
        self.roped = tuple((i + 1) % 4 != 0 for i in range(o.block_count))  # n_no_rope_layer_step 4
        self.kq_norm = self.routing.n_expert != 128
        self.rope_base_chunked = c.get_float("rope.freq_base_swa", o.rope_base)
        self.experts: list[Experts | None] = []
        for i, layer in enumerate(self.layers):
            mixture = step > 0 and (i + 1) % step == 0
            self.experts.append(bind_experts(backend, i, self.routing, o.hidden) if mixture else None)
            ffn_names = [f"ffn_{part}{'_shexp' if mixture else ''}" for part in ("gate", "up", "down")]
            missing = [name for name in ffn_names if getattr(layer, name) is None]
            if missing:
                raise ModelError(f"model is missing required tensor blk.{i}.{missing[0]}.weight")
        self.cache = Wrapper(Causal(self.shift, chunk_size=CHUNK), Causal(self.shift))

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o = self.options
        base = self.rope_base_chunked if self.chunked[layer] else o.rope_base
        factors = self.layers[layer].rope_freqs
        return x.rope(positions, o.rope_dims, base, o.rope_scale, factors, self.rope_options)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def feed_forward(self, layer: Layer, x: Tensor, i: int, rows: tuple[int, ...]) -> Tensor:
        """A dense SwiGLU, or the mixture plus the shared expert."""
        experts = self.experts[i]
        if experts is None:
            return ffn(x, layer.ffn_gate, layer.ffn_up, layer.ffn_down, i)
        mixed = moe(x, experts, self.routing, i, rows=rows)
        shared = ffn(x, layer.ffn_gate_shexp, layer.ffn_up_shexp, layer.ffn_down_shexp, i)
        return mixed.add(shared.set_name(f"ffn_moe_shexp-{i}")).set_name(f"ffn_moe_out_merged-{i}")

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        o, w = self.options, self.weights
        inp = inputs(ctx, batch, len(self.layers), self.rows_alone)
        h = place_embeddings(ctx.input(), batch, w.token_embd.rows(inp.tokens))  # an image's rows: its tower's
        # computed before the layers, where its few small nodes do not crowd a layer's buffers
        temperature = self.temperature(inp.positions) if not all(self.roped) else None
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            self.cache.set_layer_type(CHUNKED if self.chunked[i] else GLOBAL)
            x = h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}")
            q = heads(x, layer.attn_q, None, o.head_dim, o.heads)
            k, v = (heads(x, proj, None, o.head_dim, o.kv_heads) for proj in (layer.attn_k, layer.attn_v))
            if self.roped[i]:
                q, k = self.rope(q, inp.positions, i), self.rope(k, inp.positions, i)
            else:
                q = q.mul(temperature)
            q, k, v = q.set_name(f"Qcur-{i}"), k.set_name(f"Kcur-{i}"), v.set_name(f"Vcur-{i}")
            if self.roped[i] and self.kq_norm:  # Llama4TextL2Norm
                q, k = q.rms_norm(None, o.eps), k.rms_norm(None, o.eps)
            x = attend(ctx, self.cache, q, k, v, o.attention_scale, i)
            x = layer.attn_output.matmul(x).set_name(f"attn_out-{i}")
            if inp.done(i):
                return None
            x, h = inp.rows(i, x, h)
            h = x.add(h).set_name(f"ffn_inp-{i}")
            x = self.feed_forward(layer, h.rms_norm(layer.ffn_norm, o.eps), i, inp.sequence_rows(i))
            h = x.add(h).set_name(f"l_out-{i}")
        return head(h, w.output_norm, w.output, o.eps)

    @staticmethod
    def temperature(positions: Tensor) -> Tensor:
        """The query scale of the layers without RoPE, one per token (1, 1, n), from the positions."""
        p = positions.cast(DType.F32)
        scale = p.scale(1.0 / CHUNK, TEMPERATURE_OFFSET / CHUNK).floor()  # exact: powers of two
        scale = scale.scale(1.0, 1.0).log().scale(TEMPERATURE_SCALE, 1.0)
        return scale.reshape(1, 1, positions.ne[0]).set_name("attn_scale")
