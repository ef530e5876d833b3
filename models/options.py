"""The hyper-parameters of a Llama-like decoder's attention, read once from the GGUF config."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ollama_engine.fs import Config

from .base import ModelError, require_uint


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
