"""gpt-oss (OpenAI's gpt-oss-20b and -120b): attention with sinks, alternating sliding windows, YaRN,
and a mixture of experts with biases and a clamped SwiGLU.

As llama.cpp's openai-moe graph (architecture "gpt-oss"). Ollama's own conversions (architecture
"gptoss", what `ollama pull gpt-oss` fetches) are the same model under other names (OllamaLayer), and
without rope.scaling.type: Ollama always applies YaRN. Per layer:
- attention: q, k, v (with biases) from rms_norm(h), NeoX RoPE with YaRN (rope.scaling.*: factor,
  original context; extrapolation 1, beta 32/1), scale 1/sqrt(head_dim); each head's softmax has a
  learned sink logit (attn_sinks: probability mass that reaches no value); even layers see only the
  last attention.sliding_window positions (their own included), odd layers everything;
  h += attn_output(...) + bias.
- experts: the router (with a bias) picks expert_used_count experts by raw logit and softmaxes the
  chosen logits; each expert is (gate + b) * sigmoid(1.702 (gate + b)) * (up + b + 1), gate capped at
  7 and up clamped to ±7, then down + b (llama.cpp's swiglu_oai); post_attention_norm is the FFN's
  pre-norm. The experts are usually MXFP4.
The rows that want logits are taken after the last layer, before the output norm, as llama.cpp does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ollama_engine.kvcache import Batch
from ollama_engine.ml import Backend, Context, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, weight
from .layers import Output, attend, fused_heads, head, heads, inputs, linear
from .moe import Gating, Routing, bind_experts, moe
from .options import Options
from .rope import yarn_options
from .sliding import GLOBAL, SWA, check_window, sliding_cache, swa_layers

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


@dataclass
class Layer:
    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_q_bias: Tensor | None = weight("attn_q.bias", optional=True)
    attn_k: Tensor = weight("attn_k.weight")
    attn_k_bias: Tensor | None = weight("attn_k.bias", optional=True)
    attn_v: Tensor = weight("attn_v.weight")
    attn_v_bias: Tensor | None = weight("attn_v.bias", optional=True)
    attn_output: Tensor = weight("attn_output.weight")
    attn_output_bias: Tensor = weight("attn_output.bias")
    attn_sinks: Tensor = weight("attn_sinks.weight")
    rope_freqs: Tensor | None = weight("rope_freqs.weight", optional=True)
    post_attention_norm: Tensor = weight("post_attention_norm.weight")


@dataclass
class OllamaLayer(Layer):
    """Layer's weights as Ollama's converter names them: attn_out, attn_sinks (no .weight) and ffn_norm
    for the FFN's pre-norm; its conversions of OpenAI's original checkpoint fuse q, k and v (attn_qkv,
    rows in that order). Its experts are named as llama.cpp's; its files of August to October 2025 fuse gate
    and up in ffn_gate_up_exps (interleaved rows, see moe.py) and have BF16 expert biases (and until 26 August
    MXFP4 under type id 4), which the reader converts at load (fs.gguf_file.Conversion)."""

    attn_q: Tensor | None = weight("attn_q.weight", optional=True)
    attn_k: Tensor | None = weight("attn_k.weight", optional=True)
    attn_v: Tensor | None = weight("attn_v.weight", optional=True)
    attn_output: Tensor = weight("attn_out.weight")
    attn_output_bias: Tensor = weight("attn_out.bias")
    attn_sinks: Tensor = weight("attn_sinks")
    post_attention_norm: Tensor = weight("ffn_norm.weight")
    attn_qkv: Tensor | None = weight("attn_qkv.weight", optional=True)
    attn_qkv_bias: Tensor | None = weight("attn_qkv.bias", optional=True)


@register("gpt-oss")
class GptOss(Model):
    layer_type: type[Layer] = Layer
    rope_scaling = "linear"  # rope.scaling.type where the file has none
    reuse_graphs = True

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        c = self.config
        self.options = o = Options.from_config(c)
        self.weights = bind(Output, backend)
        self.layers = [bind(self.layer_type, backend, f"blk.{i}.") for i in range(o.block_count)]
        self.rope_options = yarn_options(c, o.rope_scale, neox=True, scaling=self.rope_scaling)
        self.routing = Routing.from_config(c, Gating.SOFTMAX_WEIGHT, normalize=False,
                                           scale=c.get_float("expert_weights_scale", 0.0))
        self.experts = [bind_experts(backend, i, self.routing, o.hidden) for i in range(o.block_count)]
        self.window = c.get_uint("attention.sliding_window", 0)
        self.swa = swa_layers(c, o.block_count, 2) if self.window else (False,) * o.block_count
        check_window(self.window, self.swa)
        self.cache = sliding_cache(self.shift, self.window)

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o = self.options
        factors = self.layers[layer].rope_freqs
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, factors, self.rope_options)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def qkv(self, layer: Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        o = self.options
        if isinstance(layer, OllamaLayer) and layer.attn_qkv is not None:
            return fused_heads(linear(x, layer.attn_qkv, layer.attn_qkv_bias), o.head_dim, o.heads, o.kv_heads)
        return (heads(x, layer.attn_q, layer.attn_q_bias, o.head_dim, o.heads),
                heads(x, layer.attn_k, layer.attn_k_bias, o.head_dim, o.kv_heads),
                heads(x, layer.attn_v, layer.attn_v_bias, o.head_dim, o.kv_heads))

    def feed_forward(self, x: Tensor, i: int, rows: tuple[int, ...]) -> Tensor:
        def swiglu_oai(gate: Tensor, up: Tensor) -> Tensor:
            return gate.swiglu_oai(up, SWIGLU_ALPHA, SWIGLU_LIMIT)

        return moe(x, self.experts[i], self.routing, i, swiglu_oai, rows=rows)

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        o, w = self.options, self.weights
        inp = inputs(ctx, batch, len(self.layers), self.rows_alone)
        h = w.token_embd.rows(inp.tokens)
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            self.cache.set_layer_type(SWA if self.swa[i] else GLOBAL)
            q, k, v = self.qkv(layer, h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}"))
            q = self.rope(q, inp.positions, i).set_name(f"Qcur-{i}")
            k = self.rope(k, inp.positions, i).set_name(f"Kcur-{i}")
            x = attend(ctx, self.cache, q, k, v.set_name(f"Vcur-{i}"), o.attention_scale, i, sinks=layer.attn_sinks)
            x = linear(x, layer.attn_output, layer.attn_output_bias).set_name(f"attn_out-{i}")
            h = x.add(h).set_name(f"ffn_inp-{i}")
            x = h.rms_norm(layer.post_attention_norm, o.eps).set_name(f"attn_post_norm-{i}")
            h = self.feed_forward(x, i, inp.batch_rows).add(h).set_name(f"l_out-{i}")  # every row: outputs come last
        if inp.outputs is None:
            return None  # the keys and values are stored; nothing else is wanted
        return head(h.rows(inp.outputs), w.output_norm, w.output, o.eps)  # llama.cpp takes the rows last here


@register("gptoss")
class OllamaGptOss(GptOss):
    layer_type = OllamaLayer
    rope_scaling = "yarn"

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        for i, layer in enumerate(self.layers):
            if layer.attn_qkv is None and None in (layer.attn_q, layer.attn_k, layer.attn_v):
                raise ModelError(f"model is missing required tensor blk.{i}.attn_qkv.weight (or attn_q/k/v)")
