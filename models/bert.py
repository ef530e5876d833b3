"""BERT sentence embeddings: learned positions, post-norm encoder layers, pooling, L2 normalisation.

The input is token + token-type (always type 0, "sentence A") + position embeddings, layer-normed.
Each layer: h = norm(h + attn_output(attention(q, k, v))), then h = norm(h + ffn_down(gelu(ffn_up(h)))),
with biases everywhere and every token attending to every other. There is no KV cache: the runner sends
the whole input as one batch, and the model pools it into one vector (mean of the tokens, the first
token [CLS], or the last) that is L2-normalised unless `bert.normalize_embeddings` is false.

A reranker (pooling type 4, llama.cpp's RANK) is the same encoder with a classification head on the [CLS]
token: `cls` (dense, then tanh) and `cls.output` (to n_cls_out scores, one per
`bert.classifier.output_labels`, 1 without them), each optional as in llama.cpp; its scores are not normalised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ollama_engine.kvcache import Batch, attention
from ollama_engine.ml import Backend, Context, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, bind, register, weight
from .pooling import Options, Pooling, pool

__all__ = ["Bert", "Options", "Pooling"]


@dataclass
class Layer:
    attn_q: Tensor = weight("attn_q.weight")
    attn_q_bias: Tensor = weight("attn_q.bias")
    attn_k: Tensor = weight("attn_k.weight")
    attn_k_bias: Tensor = weight("attn_k.bias")
    attn_v: Tensor = weight("attn_v.weight")
    attn_v_bias: Tensor = weight("attn_v.bias")
    attn_output: Tensor = weight("attn_output.weight")
    attn_output_bias: Tensor = weight("attn_output.bias")
    attn_output_norm: Tensor = weight("attn_output_norm.weight")
    attn_output_norm_bias: Tensor = weight("attn_output_norm.bias")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_up_bias: Tensor = weight("ffn_up.bias")
    ffn_down: Tensor = weight("ffn_down.weight")
    ffn_down_bias: Tensor = weight("ffn_down.bias")
    layer_output_norm: Tensor = weight("layer_output_norm.weight")
    layer_output_norm_bias: Tensor = weight("layer_output_norm.bias")


@dataclass
class Weights:
    token_embd: Tensor = weight("token_embd.weight")
    token_types: Tensor = weight("token_types.weight")
    position_embd: Tensor = weight("position_embd.weight")
    token_embd_norm: Tensor = weight("token_embd_norm.weight")
    token_embd_norm_bias: Tensor = weight("token_embd_norm.bias")
    # a reranker's classification head (llama.cpp's LLM_TENSOR_CLS and LLM_TENSOR_CLS_OUT)
    cls: Tensor | None = weight("cls.weight", optional=True)
    cls_bias: Tensor | None = weight("cls.bias", optional=True)
    cls_output: Tensor | None = weight("cls.output.weight", optional=True, matrix=True)  # (hidden, n_cls_out)
    cls_output_bias: Tensor | None = weight("cls.output.bias", optional=True)


@register("bert", "bert_embed")
class Bert(Model):
    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.options = Options.from_config(self.config)
        self.weights = bind(Weights, backend)
        self.layers = [bind(Layer, backend, f"blk.{i}.") for i in range(self.options.block_count)]
        self.cache = None  # an encoder: every batch is a whole input

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        """The pooled embedding (hidden,) of the batch, or every token's hidden state without pooling."""
        if batch.tokens is None:
            raise ValueError("a text model's batch needs token ids")
        o, w, n = self.options, self.weights, len(batch)
        inputs = ctx.input()
        tokens = inputs.from_numpy(batch.tokens).set_name("tokens")
        positions = inputs.from_numpy(batch.positions).set_name("positions")
        sentence_a = w.token_types.rows(inputs.from_numpy(np.zeros(1, dtype=np.int32)).set_name("token_type"))
        h = w.token_embd.rows(tokens).set_name("embd").add(sentence_a).add(w.position_embd.rows(positions))
        h.set_name("inp_embd")
        h = h.layer_norm(w.token_embd_norm, w.token_embd_norm_bias, o.eps).set_name("inp_norm-0")
        scale = 1.0 / math.sqrt(o.head_dim)
        for i, layer in enumerate(self.layers):
            q = layer.attn_q.matmul(h).add(layer.attn_q_bias).reshape(o.head_dim, o.heads, n).set_name(f"Qcur-{i}")
            k = layer.attn_k.matmul(h).add(layer.attn_k_bias).reshape(o.head_dim, o.heads, n).set_name(f"Kcur-{i}")
            v = layer.attn_v.matmul(h).add(layer.attn_v_bias).reshape(o.head_dim, o.heads, n).set_name(f"Vcur-{i}")
            a = attention(ctx, q, k, v, scale).reshape(o.hidden, n)
            # llama.cpp's name for the attention's output projection (bias included) in BERT
            a = layer.attn_output.matmul(a).add(layer.attn_output_bias).set_name(f"kqv_out-{i}")
            h = a.add(h).layer_norm(layer.attn_output_norm, layer.attn_output_norm_bias, o.eps).set_name(f"ffn_inp-{i}")
            f = layer.ffn_up.matmul(h).add(layer.ffn_up_bias).gelu().set_name(f"ffn_gelu-{i}")
            f = layer.ffn_down.matmul(f).add(layer.ffn_down_bias).set_name(f"ffn_out-{i}")
            h = f.add(h).layer_norm(layer.layer_output_norm, layer.layer_output_norm_bias, o.eps)
        h.set_name("result_embd")
        if o.pooling == Pooling.NONE:
            return h
        if o.pooling == Pooling.RANK:
            return self.classify(pool(h, o)).set_name("result_embd_pooled")
        h = pool(h, o).set_name("result_embd_pooled")
        return h.l2_norm(1e-12) if o.normalize else h

    def classify(self, h: Tensor) -> Tensor:
        """A reranker's scores from the [CLS] state: tanh(cls h + b), then cls.output (llama.cpp's build_pooling)."""
        w = self.weights
        if w.cls is not None:
            h = w.cls.matmul(h)
            h = (h.add(w.cls_bias) if w.cls_bias is not None else h).tanh()
        if w.cls_output is not None:
            h = w.cls_output.matmul(h)
            h = h.add(w.cls_output_bias) if w.cls_output_bias is not None else h
        return h
