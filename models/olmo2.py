"""OLMo 2: Llama's layer with the norms after attention and feed-forward instead of before; OLMo 3 too.

As llama.cpp's olmo2 graph: h += post_attention_norm(attn_output(attention(q, k, v))) with q and k
RMS-normalised over their whole width (all heads at once, not per head as Qwen3's) before NeoX RoPE;
then h += post_ffw_norm(ffn_down(silu(ffn_gate(h)) * ffn_up(h))). No norm before either, and a separate
output matrix. Llama's forward does this once the layer declares post-norms and no pre-norms.

OLMo 3 files (llama.cpp converts them to this architecture; Ollama's converter names them olmo3, see
olmo3.py) add attention.sliding_window: sliding-window layers (attention.sliding_window_pattern, or
three in every four) alternate with global ones, each kind in its own cache of a Wrapper. Sliding layers
rotate with plain RoPE (scale 1, no YaRN), global ones with rope.scaling (YaRN where its type says so).
Both use rope.freq_base: llama.cpp reads rope.freq_base_swa for this architecture but its graph does not
use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.kvcache import Causal, Wrapper
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import ModelError, register, weight
from .gemma2 import GLOBAL, SWA, check_window, swa_layers
from .llama import Llama
from .rope import yarn_options


@dataclass
class Olmo2Layer:
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_q_norm: Tensor = weight("attn_q_norm.weight")  # heads * head_dim wide
    attn_k_norm: Tensor = weight("attn_k_norm.weight")  # kv_heads * head_dim wide
    attn_output: Tensor = weight("attn_output.weight")
    post_attention_norm: Tensor = weight("post_attention_norm.weight")
    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")
    post_ffw_norm: Tensor = weight("post_ffw_norm.weight")


@register("olmo2")
class Olmo2(Llama):
    layer_type = Olmo2Layer
    rope_options = RopeOptions(neox=True)
    sliding_rope = RopeOptions(neox=True)

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        o = self.options
        if o.head_dim * o.heads != o.hidden:
            raise ModelError(f"{self.config.architecture()} needs attention.head_count * head size == embedding_length")
        self.window = self.config.get_uint("attention.sliding_window", 0)
        self.swa = swa_layers(self.config, o.block_count, 4) if self.window else (False,) * o.block_count
        check_window(self.window, self.swa)
        self.rope_options = self.global_rope()
        if self.window:
            # As gemma2's: llama.cpp's n_swa counts the token itself, Causal's window the positions before
            # it; sliding layers keep a ring of n_swa + batch cells, as llama.cpp's default (swa_full off).
            sliding = Causal(self.shift, window_size=max(self.window - 1, 1))
            self.cache = Wrapper(sliding, Causal(self.shift))

    def global_rope(self) -> RopeOptions:
        """The global layers' RoPE: llama.cpp's YaRN where rope.scaling.type is yarn."""
        return yarn_options(self.config, self.options.rope_scale, neox=True)

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o = self.options
        if self.swa[layer]:
            return x.rope(positions, o.rope_dims, o.rope_base, 1.0, None, self.sliding_rope)
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, None, self.rope_options)

    def qkv(self, layer: Olmo2Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        o, n, eps = self.options, x.ne[1], self.options.eps
        q = layer.attn_q.matmul(x).rms_norm(layer.attn_q_norm, eps).reshape(o.head_dim, o.heads, n)
        k = layer.attn_k.matmul(x).rms_norm(layer.attn_k_norm, eps).reshape(o.head_dim, o.kv_heads, n)
        v = layer.attn_v.matmul(x).reshape(o.head_dim, o.kv_heads, n)
        return q, k, v

    def self_attention(self, ctx: Context, layer: Olmo2Layer, x: Tensor, positions: Tensor,  # type: ignore[override]
                       i: int) -> Tensor:
        if isinstance(self.cache, Wrapper):
            self.cache.set_layer_type(SWA if self.swa[i] else GLOBAL)
        return super().self_attention(ctx, layer, x, positions, i)
