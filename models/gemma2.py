"""Gemma 2: Llama's attention and MLP with Gemma's extras, and the base of Gemma 3 (gemma3.py).

As llama.cpp's gemma2 graph: embeddings scaled by sqrt(hidden); per layer
h += post_attention_norm(attn_output(attention(q * query_scale, k, v))) on rms_norm(h), then
h += post_ffw_norm(ffn_down(gelu_tanh(ffn_gate(x)) * ffn_up(x))) with x = rms_norm(h); NeoX RoPE; the
output tied to token_embd. Sliding-window layers (llama.cpp's `is_swa`, see swa_layers) alternate with
global ones, each kind in its own cache of a Wrapper, and may have their own RoPE base. Attention scores
and final logits are soft-capped: c * tanh(x / c).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch, Causal, Wrapper, attention
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import ModelError, register, weight
from .llama import Layer, Llama, Options

SWA, GLOBAL = 0, 1  # the Wrapper's caches, by layer type
INT32_MAX = 2**31 - 1


@dataclass
class Gemma2Layer(Layer):
    post_attention_norm: Tensor = weight("post_attention_norm.weight")
    post_ffw_norm: Tensor = weight("post_ffw_norm.weight")


def swa_layers(config: Config, blocks: int, pattern: int) -> tuple[bool, ...]:
    """Which layers use the sliding window (llama.cpp's load_swa_pattern, not dense-first).

    attention.sliding_window_pattern is either one flag per layer, or n: every n-th layer is global
    (0: none is); `pattern` is the architecture's n when the file has neither.
    """
    flags = config.value("attention.sliding_window_pattern")
    if isinstance(flags, list):
        if len(flags) != blocks:
            raise ModelError(f"attention.sliding_window_pattern has {len(flags)} flags for {blocks} layers")
        return tuple(bool(f) for f in flags)
    n = config.get_uint("attention.sliding_window_pattern", pattern)
    return tuple(n == 0 or i % n < n - 1 for i in range(blocks))


def check_window(window: int, swa: tuple[bool, ...]) -> None:
    """A sliding window must see at least the token and one before it, and fit the cache's int32 positions."""
    if window > INT32_MAX or (any(swa) and window < 2):
        raise ModelError(f"attention.sliding_window must be in 2..{INT32_MAX}, got {window}")


def f32_reciprocal_sqrt(x: float) -> float:
    """1.0f / sqrtf(x), rounded as llama.cpp's float arithmetic rounds it."""
    return float(np.float32(1) / np.sqrt(np.float32(x)))


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
class Gemma2(Llama):
    layer_type = Gemma2Layer
    rope_options = RopeOptions(neox=True)

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.gemma = self.gemma_options(self.config, self.options)
        check_window(self.gemma.window, self.gemma.swa)
        # Causal's window counts the positions before a token; llama.cpp's n_swa includes the token. Sliding
        # layers keep a ring of n_swa + batch cells, as llama.cpp's default (swa_full off).
        sliding = Causal(self.shift, window_size=max(self.gemma.window - 1, 1))
        self.cache = Wrapper(sliding, Causal(self.shift))

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

    def embed_inputs(self, ctx: Context, batch: Batch, h: Tensor) -> Tensor:
        """The batch's rows given as embeddings (images) in place of their tokens': Gemma 2 takes none."""
        if batch.embeddings:
            raise ValueError(f"{type(self).__name__} takes no embeddings in place of tokens")
        return h

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        if batch.tokens is None:
            raise ValueError("a text model's batch needs token ids")
        o, g = self.options, self.gemma
        inputs = ctx.input()
        positions = inputs.from_numpy(batch.positions).set_name("positions")
        h = self.weights.token_embd.rows(inputs.from_numpy(batch.tokens).set_name("tokens"))
        h = h.scale(math.sqrt(o.hidden)).set_name("inp_scaled")
        h = self.embed_inputs(ctx, batch, h)
        outputs = inputs.from_numpy(batch.outputs).set_name("outputs") if len(batch.outputs) else None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            self.cache.set_layer_type(SWA if g.swa[i] else GLOBAL)
            q, k, v = self.qkv(layer, h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}"))
            q = self.rope(q, positions, i).set_name(f"Qcur-{i}")
            k = self.rope(k, positions, i).set_name(f"Kcur-{i}")
            v.set_name(f"Vcur-{i}")
            x = attention(ctx, q.scale(g.query_scale), k, v, 1.0, self.cache, softcap=g.attn_softcap)
            x = x.reshape(o.head_dim * o.heads, len(batch)).set_name(f"kqv_out-{i}")
            if i == last:  # only the rows that want logits go on (before attn_output, as in llama.py)
                if outputs is None:
                    return None  # the keys and values are stored; nothing else is wanted
                x, h = x.rows(outputs), h.rows(outputs)
            h = layer.attn_output.matmul(x).rms_norm(layer.post_attention_norm, o.eps).add(h).set_name(f"sa_out-{i}")
            x = h.rms_norm(layer.ffn_norm, o.eps).set_name(f"ffn_norm-{i}")
            x = layer.ffn_down.matmul(layer.ffn_gate.matmul(x).gelu(layer.ffn_up.matmul(x))).set_name(f"ffn_out-{i}")
            h = x.rms_norm(layer.post_ffw_norm, o.eps).add(h).set_name(f"l_out-{i}")
        logits = self.weights.output.matmul(h.rms_norm(self.weights.output_norm, o.eps).set_name("result_norm"))
        if g.final_softcap:
            logits = logits.scale(1.0 / g.final_softcap).tanh().scale(g.final_softcap)
        return logits.set_name("result_output")
