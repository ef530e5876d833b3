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

from ollama_engine.kvcache import Batch, Causal, Wrapper, attention
from ollama_engine.ml import Backend, Context, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import ModelError, register, weight
from .gemma2 import check_window, swa_layers
from .llama import Llama
from .moe import Gating, Routing, bind_experts, moe
from .rope import yarn_options

SWA, GLOBAL = 0, 1  # the Wrapper's caches, by layer type
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
class GptOss(Llama):
    layer_type = Layer  # type: ignore[assignment]  # its own: biases, sinks, no dense FFN
    rope_scaling = "linear"  # rope.scaling.type where the file has none

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        o = self.options
        self.rope_options = yarn_options(self.config, o.rope_scale, neox=True, scaling=self.rope_scaling)
        self.routing = Routing.from_config(self.config, Gating.SOFTMAX_WEIGHT, normalize=False,
                                           scale=self.config.get_float("expert_weights_scale", 0.0))
        self.experts = [bind_experts(backend, i, self.routing, o.hidden) for i in range(o.block_count)]
        self.window = self.config.get_uint("attention.sliding_window", 0)
        self.swa = swa_layers(self.config, o.block_count, 2) if self.window else (False,) * o.block_count
        check_window(self.window, self.swa)
        # Causal's window counts the positions before a token; llama.cpp's n_swa includes the token. Sliding
        # layers keep a ring of n_swa + batch cells, as llama.cpp's default (swa_full off).
        sliding = Causal(self.shift, window_size=max(self.window - 1, 1))
        self.cache = Wrapper(sliding, Causal(self.shift))

    def qkv(self, layer: Layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        o, n = self.options, x.ne[1]
        if isinstance(layer, OllamaLayer) and layer.attn_qkv is not None:
            qkv = _biased(layer.attn_qkv.matmul(x), layer.attn_qkv_bias)
            head, row = qkv.strides[0] * o.head_dim, qkv.strides[1]

            def heads(first: int, count: int) -> Tensor:  # views of the fused rows, as phi3's
                return qkv.view(first * head, (o.head_dim, count, n), (head, row))

            return heads(0, o.heads), heads(o.heads, o.kv_heads), heads(o.heads + o.kv_heads, o.kv_heads).contiguous()
        q = _biased(layer.attn_q.matmul(x), layer.attn_q_bias).reshape(o.head_dim, o.heads, n)
        k = _biased(layer.attn_k.matmul(x), layer.attn_k_bias).reshape(o.head_dim, o.kv_heads, n)
        v = _biased(layer.attn_v.matmul(x), layer.attn_v_bias).reshape(o.head_dim, o.kv_heads, n)
        return q, k, v

    def feed_forward(self, layer: Layer, x: Tensor, index: int) -> Tensor:
        def swiglu_oai(gate: Tensor, up: Tensor) -> Tensor:
            return gate.swiglu_oai(up, SWIGLU_ALPHA, SWIGLU_LIMIT)

        return moe(x, self.experts[index], self.routing, index, swiglu_oai)

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        if batch.tokens is None:
            raise ValueError("a text model's batch needs token ids")
        o = self.options
        inputs = ctx.input()
        positions = inputs.from_numpy(batch.positions).set_name("positions")
        h = self.weights.token_embd.rows(inputs.from_numpy(batch.tokens).set_name("tokens"))
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            self.cache.set_layer_type(SWA if self.swa[i] else GLOBAL)
            q, k, v = self.qkv(layer, h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}"))
            q = self.rope(q, positions, i).set_name(f"Qcur-{i}")
            k = self.rope(k, positions, i).set_name(f"Kcur-{i}")
            x = attention(ctx, q, k, v.set_name(f"Vcur-{i}"), o.attention_scale, self.cache, sinks=layer.attn_sinks)
            x = x.reshape(o.head_dim * o.heads, len(batch)).set_name(f"kqv_out-{i}")
            x = layer.attn_output.matmul(x).add(layer.attn_output_bias).set_name(f"attn_out-{i}")
            h = x.add(h).set_name(f"ffn_inp-{i}")
            x = h.rms_norm(layer.post_attention_norm, o.eps).set_name(f"attn_post_norm-{i}")
            x = self.feed_forward(layer, x, i)
            h = x.add(h).set_name(f"l_out-{i}")
        if not len(batch.outputs):
            return None  # the keys and values are stored; nothing else is wanted
        h = h.rows(inputs.from_numpy(batch.outputs).set_name("outputs"))
        h = h.rms_norm(self.weights.output_norm, o.eps).set_name("result_norm")
        return self.weights.output.matmul(h).set_name("result_output")


@register("gptoss")
class OllamaGptOss(GptOss):
    layer_type = OllamaLayer
    rope_scaling = "yarn"

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        for i, layer in enumerate(self.layers):
            if layer.attn_qkv is None and None in (layer.attn_q, layer.attn_k, layer.attn_v):
                raise ModelError(f"model is missing required tensor blk.{i}.attn_qkv.weight (or attn_q/k/v)")


def _biased(x: Tensor, bias: Tensor | None) -> Tensor:
    return x if bias is None else x.add(bias)
