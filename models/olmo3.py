"""OLMo 3 as Ollama's converter writes it: architecture "olmo3", otherwise OLMo 2 with sliding windows.

llama.cpp converts OLMo 3 checkpoints to its olmo2 architecture (olmo2.py runs those); Ollama's
convert_olmo.go names the architecture olmo3 and writes the sliding-window pattern as one flag per layer
(from the checkpoint's layer_types), which olmo2.py already reads. Where the two differ is YaRN on the
global layers, and there this file follows Ollama's model (model/models/olmo3): YaRN whenever
rope.scaling.original_context_length is set, with rope.scaling.extrapolation_factor (default 1), betas 32
and 1, and no attention factor beyond the one ggml's RoPE derives from the scale itself.
"""

from __future__ import annotations

from ollama_engine.ml import RopeOptions

from .base import register
from .olmo2 import Olmo2


@register("olmo3")
class Olmo3(Olmo2):
    def global_rope(self) -> RopeOptions:
        original = self.config.get_uint("rope.scaling.original_context_length", 0)
        if not original:
            return RopeOptions(neox=True)
        extrapolation = self.config.get_float("rope.scaling.extrapolation_factor", 1.0)
        return RopeOptions(neox=True, original_context=original, extrapolation_factor=extrapolation)
