"""Gemma 3 (the text model): Gemma 2 with RMSNorm on each query and key head, and no attention softcap.

As llama.cpp's gemma3 graph: five sliding-window layers to one global layer unless the file says
otherwise (attention.sliding_window_pattern); sliding layers use RoPE base rope.freq_base_swa (default
10000) without scaling, global ones rope.freq_base (default 1e6, as Ollama's) with rope.scaling; final
logits soft-capped only when the file sets final_logit_softcapping. A file without
attention.sliding_window is all global.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch
from ollama_engine.ml import Context, Tensor

from .base import register, weight
from .gemma2 import Gemma2, Gemma2Layer, GemmaOptions, query_scale, swa_layers
from .llama import Options
from .vision import embedded_rows, place_embeddings


@dataclass
class Gemma3Layer(Gemma2Layer):
    attn_q_norm: Tensor = weight("attn_q_norm.weight")
    attn_k_norm: Tensor = weight("attn_k_norm.weight")


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

    def qkv(self, layer: Gemma3Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
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
