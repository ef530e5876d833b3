"""OLMo 2: Llama's layer with the norms after attention and feed-forward instead of before; OLMo 3 too.

As llama.cpp's olmo2 graph: h += post_attention_norm(attn_output(attention(q, k, v))) with q and k
RMS-normalised over their whole width (all heads at once, not per head as Qwen3's) before NeoX RoPE;
then h += post_ffw_norm(ffn_down(silu(ffn_gate(h)) * ffn_up(h))). No norm before either, and a separate
output matrix.

OLMo 3 files (llama.cpp converts them to this architecture; Ollama's converter names them olmo3, see
the Olmo3 class below) add attention.sliding_window: sliding-window layers (attention.sliding_window_pattern, or
three in every four) alternate with global ones, each kind in its own cache of a Wrapper. Sliding layers
rotate with plain RoPE (scale 1, no YaRN), global ones with rope.scaling (YaRN where its type says so).
Both use rope.freq_base: llama.cpp reads rope.freq_base_swa for this architecture but its graph does not
use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.kvcache import Batch, Causal, Wrapper
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, weight
from .layers import Output, attend, ffn, head, inputs
from .options import Options
from .rope import yarn_options
from .sliding import GLOBAL, SWA, check_window, sliding_cache, swa_layers


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
class Olmo2(Model):
    reuse_graphs = True
    sliding_rope = RopeOptions(neox=True)

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        if self.config.get_uint("expert_count", 0) > 0:
            raise ModelError(f"unknown model architecture: mixture-of-experts {self.config.architecture()}")
        self.options = o = Options.from_config(self.config)
        if o.head_dim * o.heads != o.hidden:
            raise ModelError(f"{self.config.architecture()} needs attention.head_count * head size == embedding_length")
        self.weights = bind(Output, backend)
        self.layers = [bind(Olmo2Layer, backend, f"blk.{i}.") for i in range(o.block_count)]
        self.window = self.config.get_uint("attention.sliding_window", 0)
        self.swa = swa_layers(self.config, o.block_count, 4) if self.window else (False,) * o.block_count
        check_window(self.window, self.swa)
        self.rope_options = self.global_rope()
        self.cache: Causal | Wrapper = sliding_cache(self.shift, self.window) if self.window else Causal(self.shift)

    def global_rope(self) -> RopeOptions:
        """The global layers' RoPE: llama.cpp's YaRN where rope.scaling.type is yarn."""
        return yarn_options(self.config, self.options.rope_scale, neox=True)

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o = self.options
        if self.swa[layer]:
            return x.rope(positions, o.rope_dims, o.rope_base, 1.0, None, self.sliding_rope)
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, None, self.rope_options)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        o, w, eps = self.options, self.weights, self.options.eps
        inp = inputs(ctx, batch, len(self.layers))
        h = w.token_embd.rows(inp.tokens).set_name("embd")
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            if isinstance(self.cache, Wrapper):
                self.cache.set_layer_type(SWA if self.swa[i] else GLOBAL)
            n = h.ne[1]
            q = layer.attn_q.matmul(h).rms_norm(layer.attn_q_norm, eps).reshape(o.head_dim, o.heads, n)
            k = layer.attn_k.matmul(h).rms_norm(layer.attn_k_norm, eps).reshape(o.head_dim, o.kv_heads, n)
            v = layer.attn_v.matmul(h).reshape(o.head_dim, o.kv_heads, n).set_name(f"Vcur-{i}")
            q = self.rope(q, inp.positions, i).set_name(f"Qcur-{i}")
            k = self.rope(k, inp.positions, i).set_name(f"Kcur-{i}")
            x = attend(ctx, self.cache, q, k, v, o.attention_scale, i)
            if inp.done(i):
                return None
            x = layer.attn_output.matmul(x).set_name(f"attn_out-{i}")
            x = x.rms_norm(layer.post_attention_norm, eps).set_name(f"attn_post_norm-{i}")
            x, h = inp.rows(i, x, h)
            h = x.add(h)
            h = h.set_name(f"ffn_inp-{i}")
            x = ffn(h, layer.ffn_gate, layer.ffn_up, layer.ffn_down, i).set_name(f"ffn_out-{i}")
            h = x.rms_norm(layer.post_ffw_norm, eps).set_name(f"ffn_post_norm-{i}").add(h).set_name(f"l_out-{i}")
        return head(h, w.output_norm, w.output, eps)


@register("olmo3")
class Olmo3(Olmo2):
    """OLMo 3 as Ollama's converter writes it: architecture "olmo3", otherwise OLMo 2 with sliding windows.

    llama.cpp converts OLMo 3 checkpoints to its olmo2 architecture; Ollama's convert_olmo.go names the
    architecture olmo3 and writes the sliding-window pattern as one flag per layer (from the checkpoint's
    layer_types), which Olmo2 already reads. Where the two differ is YaRN on the global layers, and there this
    follows Ollama's model (model/models/olmo3): YaRN whenever rope.scaling.original_context_length is set,
    with rope.scaling.extrapolation_factor (default 1), betas 32 and 1, and no attention factor beyond the one
    ggml's RoPE derives from the scale itself.
    """

    def global_rope(self) -> RopeOptions:
        original = self.config.get_uint("rope.scaling.original_context_length", 0)
        if not original:
            return RopeOptions(neox=True)
        extrapolation = self.config.get_float("rope.scaling.extrapolation_factor", 1.0)
        return RopeOptions(neox=True, original_context=original, extrapolation_factor=extrapolation)
