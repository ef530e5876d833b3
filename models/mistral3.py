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

from __future__ import annotations

import numpy as np

from ollama_engine.kvcache import Batch
from ollama_engine.ml import Backend, Context, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import ModelError, register
from .llama import Llama
from .rope import yarn_options


@register("mistral3")
class Mistral3(Llama):
    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        c, o = self.config, self.options
        self.original_context = c.get_uint("rope.scaling.original_context_length", c.get_uint("context_length", 0))
        self.rope_options = yarn_options(c, o.rope_scale, neox=False, tuned=True)
        self.temperature = c.get_float("attention.temperature_scale", c.get_float("rope.scaling_beta", 0.0))
        if self.temperature and self.original_context == 0:
            raise ModelError("mistral3: attention temperature scaling needs rope.scaling.original_context_length")
        self._query_scales: Tensor | None = None

    def batch_inputs(self, batch: Batch) -> dict[str, np.ndarray]:
        if not self.temperature:
            return {}
        intervals = np.floor(np.asarray(batch.positions, dtype=np.float64) / self.original_context)
        scales = np.log(intervals + 1.0) * self.temperature + 1.0
        return {"attn_scale": scales.astype(np.float32).reshape(-1, 1, 1)}

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        self._query_scales = None
        for name, values in self.batch_inputs(batch).items():
            self._query_scales = ctx.input().from_numpy(values).set_name(name)
        return super().forward(ctx, batch)

    def query(self, q: Tensor, layer: int) -> tuple[Tensor, float]:
        if self._query_scales is not None:
            q = q.mul(self._query_scales).set_name(f"Qcur_attn_temp_scaled-{layer}")
        return q, self.options.attention_scale
