"""Qwen2-VL and Qwen2.5-VL's text model (llama.cpp's qwen2vl, Ollama's qwen25vl): Qwen2's layers rotated by
multimodal RoPE (M-RoPE).

Each token has 4 position components, time, height, width and a spare one; rope.dimension_sections says
how many of the head's rotated pairs each drives, in consecutive runs (ggml's MROPE, where Qwen3-VL's
IMROPE interleaves them). A text token's components are p, p, p, 0 (llama.cpp's llm_graph_input_pos); an
image's tokens get theirs from the runner (Batch.rope_positions, laid out as llama.cpp's mtmd lays them
out), so the same graph serves text and images. As llama.cpp's graph: attention scale 1/sqrt(head size),
biases on q, k, v, a SwiGLU FFN, no RoPE scaling.

Keys rotated by M-RoPE are not shifted, as llama.cpp does not (seq_add asserts n_pos_per_embd == 1): a full
context is re-evaluated from the kept inputs instead (the cache has no shift function).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ollama_engine.kvcache import Batch, Causal
from ollama_engine.ml import Backend, Context, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, weight
from .layers import LlamaLayer, Output, attend, f32_reciprocal_sqrt, ffn, head, heads, inputs
from .options import Options
from .rope import mrope_sections, mrope_text_positions
from .vision import place_embeddings


@dataclass
class Qwen2VLLayer(LlamaLayer):
    """A Llama layer with biases on the query, key and value projections."""

    attn_q_bias: Tensor = weight("attn_q.bias")
    attn_k_bias: Tensor = weight("attn_k.bias")
    attn_v_bias: Tensor = weight("attn_v.bias")


@register("qwen2vl", "qwen25vl")
class Qwen2VL(Model):
    reuse_graphs = True
    position_components = 4

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.options = o = Options.from_config(self.config)
        arch = self.config.architecture()
        if o.rope_dims != o.head_dim:  # llama.cpp asserts it
            raise ModelError(f"{arch}: rope.dimension_count {o.rope_dims} must equal the head size {o.head_dim}")
        if o.rope_scale != 1.0:
            raise ModelError(f"{arch}: rope.scaling.factor is not supported with multimodal RoPE")
        self.sections = mrope_sections(self.config, o.rope_dims)
        self.scale = f32_reciprocal_sqrt(o.head_dim)  # llama.cpp's 1.0f/sqrtf(n_embd_head)
        self.weights = bind(Output, backend)
        self.layers = [bind(Qwen2VLLayer, backend, f"blk.{i}.") for i in range(o.block_count)]
        self.cache = Causal(None)

    def rope(self, x: Tensor, positions: Tensor) -> Tensor:
        o = self.options
        return x.rope_multi(positions, o.rope_dims, self.sections, o.rope_base, interleaved=False)

    def batch_inputs(self, batch: Batch) -> dict[str, np.ndarray]:
        return {"mrope_positions": self.positions(batch)}

    @staticmethod
    def positions(batch: Batch) -> np.ndarray:
        """The batch's 4 position components, component-major: the runner's, or a text token's p, p, p, 0."""
        if batch.rope_positions is not None:
            return batch.rope_positions.reshape(-1)
        return mrope_text_positions(batch.positions)

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        o, w = self.options, self.weights
        inp = inputs(ctx, batch, len(self.layers))
        positions = ctx.input().from_numpy(self.positions(batch)).set_name("mrope_positions")
        h = w.token_embd.rows(inp.tokens).set_name("embd")
        h = place_embeddings(ctx.input(), batch, h)
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            x = h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}")
            q = heads(x, layer.attn_q, layer.attn_q_bias, o.head_dim, o.heads)
            k = heads(x, layer.attn_k, layer.attn_k_bias, o.head_dim, o.kv_heads)
            v = heads(x, layer.attn_v, layer.attn_v_bias, o.head_dim, o.kv_heads).set_name(f"Vcur-{i}")
            q = self.rope(q, positions).set_name(f"Qcur-{i}")
            k = self.rope(k, positions).set_name(f"Kcur-{i}")
            x = attend(ctx, self.cache, q, k, v, self.scale, i)
            if inp.done(i):
                return None
            x, h = inp.rows(i, layer.attn_output.matmul(x).set_name(f"attn_out-{i}"), h)
            h = x.add(h).set_name(f"ffn_inp-{i}")
            x = ffn(h.rms_norm(layer.ffn_norm, o.eps).set_name(f"ffn_norm-{i}"), layer.ffn_gate, layer.ffn_up,
                    layer.ffn_down, i)
            h = x.set_name(f"ffn_out-{i}").add(h).set_name(f"l_out-{i}")
        return head(h, w.output_norm, w.output, o.eps)
