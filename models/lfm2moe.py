"""LFM2-MoE (LFM2-8B-A1B, LFM2-24B-A2B): LFM2's short convolutions and attention, with mixtures of experts.

As llama.cpp's lfm2moe (which builds lfm2's graph): the first leading_dense_block_count layers have
LFM2's SwiGLU FFN, the others a mixture of expert_feed_forward_length-wide SwiGLU experts routed as
expert_gating_func says (sigmoid in LFM2-MoE's files), picked by the probabilities plus the selection bias
exp_probs_b, their weights normalised to sum to 1 (models/moe.py).
"""

from __future__ import annotations

from ollama_engine.ml import Backend, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import ModelError, register
from .lfm2 import Lfm2
from .moe import Gating, Routing, bind_experts, moe

GATING = {1: Gating.SOFTMAX, 2: Gating.SIGMOID}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*


@register("lfm2moe")
class Lfm2Moe(Lfm2):
    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        gating = self.config.get_uint("expert_gating_func", 1)
        if gating not in GATING:
            raise ModelError(f"lfm2moe: expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
        self.routing = Routing.from_config(self.config, GATING[gating], normalize=True)
        self.experts = {i: bind_experts(backend, i, self.routing, self.hidden)
                        for i in range(self.blocks) if not self.is_dense(i)}

    def is_dense(self, layer: int) -> bool:
        return layer < self.config.get_uint("leading_dense_block_count", 0)

    def feed_forward(self, x: Tensor, layer: int) -> Tensor:
        return super().feed_forward(x, layer) if self.is_dense(layer) else moe(x, self.experts[layer], self.routing,
                                                                                layer)
