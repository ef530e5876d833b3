"""Llama (Llama 2 and 3, Mistral-style, Mixtral): RMSNorm, rotary attention with grouped KV heads, SwiGLU.

Per layer: h += attn_output(attention(rope(q), rope(k), v)) on rms_norm(h); then
h += ffn_down(silu(ffn_gate(x)) * ffn_up(x)) with x = rms_norm(h). Llama 3.1+ files carry rope
frequency factors (rope_freqs.weight); files without output.weight tie it to token_embd (the backend
makes that copy). Only the rows whose logits are needed leave the last layer's attention.

A file with experts (expert_count > 0: Mixtral; mistral3 files alike) has a mixture of experts in
place of every FFN, as llama.cpp's llama graph routes it (build_moe_ffn with a softmax router and the
chosen experts' weights renormalised to sum to 1; expert_weights_scale is not read, as llama.cpp does
not read it for llama): its layers are `LlamaMoeLayer`s and their experts are bound apart (moe.bind_experts).

The layers' tensors are layers.LlamaLayer's (LlamaMoeLayer's with experts), which other Llama-shaped
architectures share. Mistral 3 (Mistral3, below) is this model with YaRN and a query temperature.
"""

from __future__ import annotations

import numpy as np

from ollama_engine.kvcache import Batch, Causal
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register
from .layers import LlamaLayer, LlamaMoeLayer, Output, attend, ffn, head, heads, inputs, query_temperature
from .moe import Experts, Gating, Routing, bind_experts, moe
from .options import Options
from .rope import yarn_options
from .vision import place_embeddings

__all__ = ["Llama", "Mistral3"]


@register("llama")
class Llama(Model):
    rope_options = RopeOptions(neox=False)
    reuse_graphs = True

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.options = o = Options.from_config(self.config)
        self.weights = bind(Output, backend)
        self.routing: Routing | None = None
        self.experts: list[Experts | None] = [None] * o.block_count  # each layer's, None for a dense FFN
        mixture = self.config.get_uint("expert_count", 0) > 0
        if mixture:
            self.routing = Routing.from_config(self.config, Gating.SOFTMAX, normalize=True)
            self.experts = [bind_experts(backend, i, self.routing, o.hidden) for i in range(o.block_count)]
        layer = LlamaMoeLayer if mixture else LlamaLayer
        self.layers = [bind(layer, backend, f"blk.{i}.") for i in range(o.block_count)]
        self.cache = Causal(self.shift)

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o = self.options
        factors = self.layers[layer].rope_freqs
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, factors, self.rope_options)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def qkv(self, layer: LlamaMoeLayer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Query (head_dim, heads, n), key and value (head_dim, kv_heads, n), before RoPE."""
        o = self.options
        return (heads(x, layer.attn_q, None, o.head_dim, o.heads), heads(x, layer.attn_k, None, o.head_dim, o.kv_heads),
                heads(x, layer.attn_v, None, o.head_dim, o.kv_heads))

    def feed_forward(self, layer: LlamaMoeLayer, x: Tensor, i: int, rows: tuple[int, ...]) -> Tensor:
        """Layer i's FFN of the normed hidden states x: its mixture of experts (routing each sequence's `rows` as
        alone), or SwiGLU."""
        experts = self.experts[i]
        if experts is not None and self.routing is not None:
            return moe(x, experts, self.routing, i, rows=rows)
        assert isinstance(layer, LlamaLayer)
        return ffn(x, layer.ffn_gate, layer.ffn_up, layer.ffn_down, i)

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        o, w = self.options, self.weights
        inp = inputs(ctx, batch, len(self.layers), self.rows_alone)
        h = place_embeddings(ctx.input(), batch, w.token_embd.rows(inp.tokens).set_name("embd"))  # images' rows
        temperature = {name: ctx.input().from_numpy(values).set_name(name)
                       for name, values in self.batch_inputs(batch).items()}.get("attn_scale")
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            q, k, v = self.qkv(layer, h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}"))
            q = self.rope(q, inp.positions, i).set_name(f"Qcur-{i}")
            if temperature is not None:  # Mistral 3's
                q = q.mul(temperature).set_name(f"Qcur_attn_temp_scaled-{i}")
            k = self.rope(k, inp.positions, i).set_name(f"Kcur-{i}")
            x = attend(ctx, self.cache, q, k, v.set_name(f"Vcur-{i}"), o.attention_scale, i)
            if inp.done(i):
                return None
            x, h = inp.rows(i, layer.attn_output.matmul(x).set_name(f"attn_out-{i}"), h)
            h = x.add(h).set_name(f"ffn_inp-{i}")
            x = self.feed_forward(layer, h.rms_norm(layer.ffn_norm, o.eps).set_name(f"ffn_norm-{i}"), i,
                                  inp.sequence_rows(i))
            h = x.set_name(f"ffn_out-{i}").add(h).set_name(f"l_out-{i}")
        return head(h, w.output_norm, w.output, o.eps)


@register("mistral3")
class Mistral3(Llama):
    """Mistral 3: the text model of Mistral Small 3.1/3.2 and Ministral 3, Llama's layer plus YaRN and
    Llama 4's attention temperature.

    llama.cpp converts Mistral3ForConditionalGeneration and Ministral3ForCausalLM to this architecture
    (older conversions of Mistral Small 3.x say "llama" and load as Llama). As llama.cpp's mistral3 graph:
    normal (not NeoX) RoPE, with YaRN where rope.scaling.type is "yarn" (Ministral 3): extrapolation 1,
    beta_fast/beta_slow, and the cos/sin multiplier llama.cpp derives from the factor and
    rope.scaling.yarn_log_multiplier. Where attention.temperature_scale (beta) is set, each query is
    multiplied by 1 + beta * ln(1 + floor(position / original_context)) before attention.

    Ollama's own conversions (arch "mistral3" with the vision tower in the same file) name two keys
    differently: rope.scaling.beta_fast/beta_slow and the temperature rope.scaling_beta (Ollama's
    model_text.go); both spellings are read. Their vision tower is this text model's unused tensors (not
    allocated, not counted).
    """

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        c, o = self.config, self.options
        self.original_context = c.get_uint("rope.scaling.original_context_length", c.get_uint("context_length", 0))
        self.rope_options = yarn_options(c, o.rope_scale, neox=False, tuned=True)
        self.temperature = c.get_float("attention.temperature_scale", c.get_float("rope.scaling_beta", 0.0))
        if self.temperature and self.original_context == 0:
            raise ModelError("mistral3: attention temperature scaling needs rope.scaling.original_context_length")

    def batch_inputs(self, batch: Batch) -> dict[str, np.ndarray]:
        """The query temperature per position, where the file sets one."""
        if not self.temperature:
            return {}
        return {"attn_scale": query_temperature(batch.positions, self.temperature, self.original_context)}
