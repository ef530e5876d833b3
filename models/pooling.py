"""What the encoders (BERT, Nomic BERT) share: their hyper-parameters and how a batch's hidden states become
one vector (pooling)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ollama_engine.fs import Config
from ollama_engine.ml import Tensor

from .base import ModelError, require_uint


class Pooling(IntEnum):
    """`<arch>.pooling_type`, llama.cpp's enum llama_pooling_type."""

    NONE = 0
    MEAN = 1
    CLS = 2
    LAST = 3
    RANK = 4


@dataclass(frozen=True)
class Options:
    block_count: int
    hidden: int
    heads: int
    head_dim: int
    eps: float
    pooling: Pooling
    normalize: bool

    @classmethod
    def from_config(cls, config: Config) -> Options:
        hidden = require_uint(config, "embedding_length")
        heads = require_uint(config, "attention.head_count")
        if heads == 0 or hidden == 0 or hidden % heads:
            raise ModelError(f"embedding_length {hidden} must be a positive multiple of attention.head_count {heads}")
        pooling = config.get_uint("pooling_type", 0)
        if pooling not in set(Pooling):
            raise ModelError(f"{config.full_key('pooling_type')} {pooling} is not one of "
                             f"{', '.join(f'{p.value} ({p.name.lower()})' for p in Pooling)}")
        return cls(
            block_count=require_uint(config, "block_count"),
            hidden=hidden,
            heads=heads,
            head_dim=hidden // heads,
            eps=config.get_float("attention.layer_norm_epsilon", 1e-12),
            pooling=Pooling(pooling),
            normalize=config.get_bool("normalize_embeddings", True),
        )


def pool(h: Tensor, o: Options) -> Tensor:
    """One (hidden,) vector from the hidden states (hidden, n) of the batch's tokens."""
    n = h.ne[1]
    if o.pooling == Pooling.MEAN:
        return h.transpose().contiguous().mean().reshape(o.hidden)
    row = n - 1 if o.pooling == Pooling.LAST else 0  # CLS and RANK (non-causal): the first token
    return h.view(row * h.strides[1], [o.hidden]).contiguous()
