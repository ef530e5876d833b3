"""Gemma 2 and Gemma 3 (the text model): Llama's attention and MLP with Gemma's extras.

As llama.cpp's gemma2 graph: embeddings scaled by sqrt(hidden); per layer
h += post_attention_norm(attn_output(attention(q * query_scale, k, v))) on rms_norm(h), then
h += post_ffw_norm(ffn_down(gelu_tanh(ffn_gate(x)) * ffn_up(x))) with x = rms_norm(h); NeoX RoPE; the
output tied to token_embd. Sliding-window layers (llama.cpp's `is_swa`, see sliding.swa_layers) alternate
with global ones, each kind in its own cache of a Wrapper, and may have their own RoPE base. Attention
scores and final logits are soft-capped: c * tanh(x / c).

Gemma 3 (llama.cpp's gemma3 graph) adds RMSNorm on each query and key head and drops the attention softcap:
five sliding-window layers to one global layer unless the file says otherwise
(attention.sliding_window_pattern); sliding layers use RoPE base rope.freq_base_swa (default 10000) without
scaling, global ones rope.freq_base (default 1e6, as Ollama's) with rope.scaling; final logits soft-capped
only when the file sets final_logit_softcapping. A file without attention.sliding_window is all global.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, bind, register, weight
from .layers import Output, attend, f32_reciprocal_sqrt, ffn, head, heads, inputs
from .options import Options
from .sliding import GLOBAL, SWA, check_window, sliding_cache, swa_layers
from .vision import embedded_rows, place_embeddings


@dataclass
class Gemma2Layer:
    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_output: Tensor = weight("attn_output.weight")
    post_attention_norm: Tensor = weight("post_attention_norm.weight")
    ffn_norm: Tensor = weight("ffn_norm.weight")
    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")
    post_ffw_norm: Tensor = weight("post_ffw_norm.weight")


@dataclass
class Gemma3Layer(Gemma2Layer):
    attn_q_norm: Tensor = weight("attn_q_norm.weight")
    attn_k_norm: Tensor = weight("attn_k_norm.weight")


@dataclass(frozen=True)
class GemmaOptions:
    """What Gemma adds to Llama's hyper-parameters; a softcap of 0 means none."""

    swa: tuple[bool, ...]  # per layer
    window: int  # llama.cpp's n_swa: a sliding layer sees this many positions, its own included
    rope_base: float  # of the global layers
    rope_base_swa: float
    rope_scale_swa: float
    query_scale: float
    attn_softcap: float
    final_softcap: float


def query_scale(o: Options, large_block_count: int) -> float:
    """1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B models (llama.cpp tells them by depth)."""
    return f32_reciprocal_sqrt(o.hidden // o.heads if o.block_count == large_block_count else o.head_dim)


@register("gemma2")
class Gemma2(Model):
    layer_type: type[Gemma2Layer] = Gemma2Layer
    rope_options = RopeOptions(neox=True)
    reuse_graphs = True

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.options = o = Options.from_config(self.config)
        self.gemma = self.gemma_options(self.config, o)
        check_window(self.gemma.window, self.gemma.swa)
        self.weights = bind(Output, backend)
        self.layers = [bind(self.layer_type, backend, f"blk.{i}.") for i in range(o.block_count)]
        self.cache = sliding_cache(self.shift, self.gemma.window)

    @classmethod
    def gemma_options(cls, config: Config, o: Options) -> GemmaOptions:
        """llama.cpp's gemma2 defaults: window 4096, every other layer sliding, both softcaps on."""
        return GemmaOptions(
            swa=swa_layers(config, o.block_count, 2),
            window=config.get_uint("attention.sliding_window", 4096),
            rope_base=o.rope_base,
            rope_base_swa=config.get_float("rope.freq_base_swa", o.rope_base),
            rope_scale_swa=o.rope_scale,
            query_scale=query_scale(o, 46),
            attn_softcap=config.get_float("attn_logit_softcapping", 50.0),
            final_softcap=config.get_float("final_logit_softcapping", 30.0),
        )

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o, g = self.options, self.gemma
        base, scale = (g.rope_base_swa, g.rope_scale_swa) if g.swa[layer] else (g.rope_base, o.rope_scale)
        return x.rope(positions, o.rope_dims, base, scale, None, self.rope_options)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def qkv(self, layer: Gemma2Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Query (head_dim, heads, n), key and value (head_dim, kv_heads, n), before RoPE."""
        o = self.options
        return (heads(x, layer.attn_q, None, o.head_dim, o.heads), heads(x, layer.attn_k, None, o.head_dim, o.kv_heads),
                heads(x, layer.attn_v, None, o.head_dim, o.kv_heads))

    def embed_inputs(self, ctx: Context, batch: Batch, h: Tensor) -> Tensor:
        """The batch's rows given as embeddings (images) in place of their tokens': Gemma 2 takes none."""
        if batch.embeddings:
            raise ValueError(f"{type(self).__name__} takes no embeddings in place of tokens")
        return h

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        o, g, w = self.options, self.gemma, self.weights
        inp = inputs(ctx, batch, len(self.layers))
        h = w.token_embd.rows(inp.tokens).scale(math.sqrt(o.hidden)).set_name("inp_scaled")
        h = self.embed_inputs(ctx, batch, h)
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            self.cache.set_layer_type(SWA if g.swa[i] else GLOBAL)
            q, k, v = self.qkv(layer, h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}"))
            q = self.rope(q, inp.positions, i).set_name(f"Qcur-{i}")
            k = self.rope(k, inp.positions, i).set_name(f"Kcur-{i}")
            v = v.set_name(f"Vcur-{i}")
            x = attend(ctx, self.cache, q.scale(g.query_scale), k, v, 1.0, i, softcap=g.attn_softcap)
            if inp.done(i):
                return None
            x, h = inp.rows(i, layer.attn_output.matmul(x).rms_norm(layer.post_attention_norm, o.eps), h)
            h = x.add(h).set_name(f"sa_out-{i}")
            x = h.rms_norm(layer.ffn_norm, o.eps).set_name(f"ffn_norm-{i}")
            x = ffn(x, layer.ffn_gate, layer.ffn_up, layer.ffn_down, i, Tensor.gelu).set_name(f"ffn_out-{i}")
            h = x.rms_norm(layer.post_ffw_norm, o.eps).add(h).set_name(f"l_out-{i}")
        return head(h, w.output_norm, w.output, o.eps, g.final_softcap)


@register("gemma3")
class Gemma3(Gemma2):
    layer_type = Gemma3Layer

    @classmethod
    def gemma_options(cls, config: Config, o: Options) -> GemmaOptions:
        window = config.get_uint("attention.sliding_window", 0)
        swa = swa_layers(config, o.block_count, 6) if window else (False,) * o.block_count
        return GemmaOptions(
            swa=swa,
            window=window,
            # Ollama's own conversions name the bases rope.global/local.freq_base (or leave them out)
            rope_base=config.get_float("rope.freq_base", config.get_float("rope.global.freq_base", 1000000.0)),
            rope_base_swa=config.get_float("rope.freq_base_swa", config.get_float("rope.local.freq_base", 10000.0)),
            rope_scale_swa=1.0,
            query_scale=query_scale(o, 62),
            attn_softcap=0.0,
            final_softcap=config.get_float("final_logit_softcapping", 0.0),
        )

    def qkv(self, layer: Gemma2Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        assert isinstance(layer, Gemma3Layer)
        q, k, v = super().qkv(layer, x)
        eps = self.options.eps
        return q.rms_norm(layer.attn_q_norm, eps), k.rms_norm(layer.attn_k_norm, eps), v

    def embed_inputs(self, ctx: Context, batch: Batch, h: Tensor) -> Tensor:
        """Image embeddings, unscaled, in place of their placeholder tokens'; an image's rows attend to each other
        both ways (llama.cpp's mtmd_decode_use_non_causal for Gemma 3; Ollama's SetCausal with Except)."""
        if not batch.embeddings:
            return h
        rows = embedded_rows(batch)
        for cache in self.cache.caches:
            cache.set_causal(ctx, rows)
        return place_embeddings(ctx.input(), batch, h)
