"""Nemotron-H MoE (Nemotron 3 Nano, Super): Nemotron-H's Mamba-2 and attention layers, with its MLP
layers replaced by mixtures of experts.

As llama.cpp's nemotron_h_moe (which builds nemotron_h's graph): every layer that is neither Mamba-2 nor
attention routes each token to expert_used_count of expert_count ungated ReLU² experts
(expert_feed_forward_length wide) by sigmoid probabilities plus the selection bias exp_probs_b, their
weights normalised where expert_weights_norm says and scaled by expert_weights_scale (models/moe.py), and
adds a shared ReLU² expert (expert_shared_feed_forward_length wide). The latent projections of Nemotron 3
Super (moe_latent_size), per-layer expert counts and the multi-token-prediction blocks are refused, not run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.ml import Backend, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import ModelError, register, weight
from .moe import Gating, Routing, bind_experts, moe
from .nemotron_h import MlpLayer, NemotronH


@dataclass
class MoeLayer:
    attn_norm: Tensor = weight("attn_norm.weight")
    up_shexp: Tensor = weight("ffn_up_shexp.weight")
    down_shexp: Tensor = weight("ffn_down_shexp.weight")


def relu_squared(up: Tensor, gate: Tensor | None) -> Tensor:
    return up.relu().sqr()


@register("nemotron_h_moe")
class NemotronHMoe(NemotronH):
    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        c = backend.model.config if backend.model is not None else None
        for key in ("moe_latent_size", "nextn_predict_layers"):
            if c is not None and c.get_uint(key, 0):
                raise ModelError(f"nemotron_h_moe: {key} {c.get_uint(key)} is not supported yet")
        super().__init__(backend, tokenizer)
        self.routing = Routing.from_config(self.config, Gating.SIGMOID, self.config.get_bool("expert_weights_norm"),
                                           self.config.get_float("expert_weights_scale", 1.0))
        self.experts = {i: bind_experts(backend, i, self.routing, self.hidden, gated=False)
                        for i, layer in enumerate(self.layers) if isinstance(layer, MoeLayer)}

    def layer_class(self, layer: int) -> type:
        cls = super().layer_class(layer)
        return MoeLayer if cls is MlpLayer else cls

    def mlp(self, layer: MoeLayer, x: Tensor, i: int) -> Tensor:  # type: ignore[override]
        routed = moe(x, self.experts[i], self.routing, i, relu_squared)
        shared = layer.down_shexp.matmul(layer.up_shexp.matmul(x).relu().sqr()).set_name(f"ffn_shexp-{i}")
        return routed.add(shared).set_name(f"l_out-{i}")
