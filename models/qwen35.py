"""Qwen3.5 (qwen35, dense; qwen35moe, mixtures): Qwen3-Next's layers as llama.cpp's qwen35 graphs build them.

Three differences from qwen3next (models/qwen3next.py): beta and alpha come from two projections
(ssm_beta, ssm_alpha) instead of one interleaved per key head; with fewer key heads than value heads,
value head h reads key head h mod key heads (the fused ggml_gated_delta_net's own broadcast, where
Qwen3-Next repeats each key head for its value heads in turn); and the attention layers rotate by
interleaved multimodal RoPE (rope.dimension_sections; a text token's position in its first three
components, 0 in the fourth, as llama.cpp fills them). qwen35's FFN is a SwiGLU, qwen35moe's Qwen3-Next's
mixture with its gated shared expert.
"""

from __future__ import annotations

import numpy as np

from ollama_engine.kvcache import Batch
from ollama_engine.ml import Backend, Context, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import ModelError, register
from .qwen3next import Qwen3Next


def text_positions(positions: np.ndarray) -> np.ndarray:
    """A text token's 4 multimodal position components, component-major: p, p, p, 0."""
    positions = np.asarray(positions, dtype=np.int32)
    return np.concatenate([positions, positions, positions, np.zeros_like(positions)])


@register("qwen35", "qwen35moe")
class Qwen35(Qwen3Next):
    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        sections = self.config.get_ints("rope.dimension_sections")
        sections = (sections + [0] * 4)[:4]
        if not any(sections) or min(sections) < 0 or sum(sections) > self.n_rot // 2:
            raise ModelError(f"{self.config.architecture}: rope.dimension_sections {sections} must be 4 (or fewer) "
                             f"non-negative counts of rotated pairs, at most {self.n_rot // 2} in all")
        self.sections = sections

    def for_value_heads(self, t: Tensor) -> Tensor:
        return t  # ggml_gated_delta_net broadcasts key heads to value heads in qwen35's order

    def rope(self, t: Tensor, positions: Tensor) -> Tensor:
        return t.rope_multi(positions, self.n_rot, self.sections, self.rope_base)

    def rope_positions(self, ctx: Context, batch: Batch, positions: Tensor) -> Tensor:
        return ctx.input().from_numpy(text_positions(batch.positions)).set_name("mrope_positions")

    def batch_inputs(self, batch: Batch) -> dict[str, np.ndarray]:
        return {"mrope_positions": text_positions(batch.positions)}

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        raise ModelError("qwen35: keys rotated by multimodal RoPE are not shifted (the recurrent layers refuse "
                         "a shift first)")
