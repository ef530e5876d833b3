"""The pieces a decoder's forward composes, as llama.cpp's graph builders (build_inp_embd, build_norm,
build_ffn, build_attn and the output head): plain functions of tensors and weights. Results are named as
llama.cpp names its (see base.py), so that `ollama-engine diff` can compare them layer by layer.

A forward reads, in this style:

    inp = inputs(ctx, batch, len(self.layers))
    h = self.weights.token_embd.rows(inp.tokens).set_name("embd")
    for i, layer in enumerate(self.layers):
        x = attend(ctx, self.cache, q, k, v, scale, i)      # the layer's attention
        if inp.done(i):
            return None                                     # no row wants logits
        x = layer.attn_output.matmul(x)                     # every row, as llama.cpp's build_attn: a GPU
        x, h = inp.rows(i, x, h)                            # rounds a 1-row product otherwise; the last
                                                            # layer: only the rows wanting logits go on
        ...
    return head(h, self.weights.output_norm, self.weights.output, eps)

The expert mixtures are moe.py's; the sliding-window layers and their cache sliding.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ollama_engine.kvcache import Batch, Cache, attention
from ollama_engine.ml import Context, Tensor

from .alone import sequence_rows
from .base import weight


@dataclass
class Output:
    """The token embeddings and the output head; a file without output.weight gets token_embd's copy (Backend)."""

    token_embd: Tensor = weight("token_embd.weight")
    output_norm: Tensor = weight("output_norm.weight")
    output: Tensor = weight("output.weight")


@dataclass
class Dense:
    """A gated FFN's tensors (ffn() runs them), where a model binds them apart from the rest of a layer."""

    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")


@dataclass
class LlamaMoeLayer:
    """A Llama-shaped layer's tensors but its FFN's: a mixture of experts' layer, whose experts are bound apart
    (moe.bind_experts)."""

    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_output: Tensor = weight("attn_output.weight")
    rope_freqs: Tensor | None = weight("rope_freqs.weight", optional=True)
    ffn_norm: Tensor = weight("ffn_norm.weight")


@dataclass
class LlamaLayer(LlamaMoeLayer):
    """A Llama-shaped dense layer: SwiGLU."""

    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")


@dataclass(frozen=True)
class Inputs:
    """A batch's graph inputs beside the cache's: token ids, positions and the rows that want logits; and how
    many consecutive rows each sequence has, which a mixture's router needs (moe.moe's `rows`)."""

    tokens: Tensor
    positions: Tensor
    outputs: Tensor | None  # None: no row wants logits
    last: int  # the last layer's index
    batch_rows: tuple[int, ...] = ()  # rows per sequence in the batch; () where not counted (alone off)
    output_rows: tuple[int, ...] = ()  # rows per sequence among the rows that want logits

    def done(self, layer: int) -> bool:
        """Whether nothing after this layer's mixing is wanted: the last layer, and no row wants logits (the
        cache already holds the batch's keys, values and states)."""
        return layer == self.last and self.outputs is None

    def rows(self, layer: int, *xs: Tensor) -> tuple[Tensor, ...]:
        """xs as they are, or in the last layer only the rows that want logits (llama.cpp's inp_out_ids)."""
        if layer != self.last or self.outputs is None:
            return xs
        return tuple(x.rows(self.outputs) for x in xs)

    def sequence_rows(self, layer: int) -> tuple[int, ...]:
        """The rows per sequence that layer `layer` computes after rows(): the batch's, or in the last layer
        those of the rows that want logits. () where the model rounds rows by the whole batch (rows_alone)."""
        return self.output_rows if layer == self.last and self.outputs is not None else self.batch_rows


def inputs(ctx: Context, batch: Batch, layers: int, alone: bool = True) -> Inputs:
    """The batch's token ids, positions and output rows as graph inputs, named as graphs.BATCH_INPUTS.
    alone: count each sequence's rows (Model.rows_alone), so that a router rounds them as their batch alone
    would (models/alone.py); a graph is reused only for batches whose counts are the same (graphs.py)."""
    if batch.tokens is None:
        raise ValueError("a text model's batch needs token ids")
    made = ctx.input()
    positions = made.from_numpy(batch.positions).set_name("positions")
    tokens = made.from_numpy(batch.tokens).set_name("tokens")
    outputs = made.from_numpy(batch.outputs).set_name("outputs") if len(batch.outputs) else None
    if not alone:
        return Inputs(tokens, positions, outputs, layers - 1)
    return Inputs(tokens, positions, outputs, layers - 1, sequence_rows(batch.sequences),
                  sequence_rows(batch.sequences[batch.outputs]))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """weight x (+ bias)."""
    y = weight.matmul(x)
    return y if bias is None else y.add(bias)


def heads(x: Tensor, weight: Tensor, bias: Tensor | None, head_dim: int, count: int) -> Tensor:
    """x projected (weight x + bias) into `count` heads: (head_dim, count, n)."""
    return linear(x, weight, bias).reshape(head_dim, count, x.ne[1])


def fused_heads(qkv: Tensor, head_dim: int, count: int, kv_count: int) -> tuple[Tensor, Tensor, Tensor]:
    """Query, key and value heads as views of one fused projection's rows (q, then k, then v), as llama.cpp's
    build_qkv cuts them; the value made contiguous for the cache."""
    head, row, n = qkv.strides[0] * head_dim, qkv.strides[1], qkv.ne[1]

    def part(first: int, heads: int) -> Tensor:
        return qkv.view(first * head, (head_dim, heads, n), (head, row))

    return part(0, count), part(count, kv_count), part(count + kv_count, kv_count).contiguous()


Activation = Callable[[Tensor, Tensor], Tensor]
"""gate, up -> activation(gate) * up, fused: Tensor.silu (SwiGLU) or Tensor.gelu (GeGLU)."""


def ffn(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, layer: int, activation: Activation = Tensor.silu) -> Tensor:
    """The gated feed-forward down(activation(gate x) * up x) (llama.cpp's build_ffn, LLM_FFN_PAR)."""
    g = gate.matmul(x).set_name(f"ffn_gate-{layer}")
    u = up.matmul(x).set_name(f"ffn_up-{layer}")
    return down.matmul(activation(g, u).set_name(f"ffn_swiglu-{layer}"))


def attend(ctx: Context, cache: Cache | None, q: Tensor, k: Tensor, v: Tensor, scale: float, layer: int,
           **options) -> Tensor:
    """Attention of the heads q over the cache holding k and v (kvcache.attention, with its options: softcap,
    sinks, value_projection), as (head size * heads, n) before the output projection."""
    x = attention(ctx, q, k, v, scale, cache, **options)
    return x.reshape(x.ne[0] * x.ne[1], x.ne[2]).set_name(f"kqv_out-{layer}")


def softcap(x: Tensor, cap: float) -> Tensor:
    """cap * tanh(x / cap); 0 means none."""
    return x.scale(1.0 / cap).tanh().scale(cap) if cap else x


def head(h: Tensor, norm: Tensor, output: Tensor, eps: float, cap: float = 0.0) -> Tensor:
    """The logits (vocab, n): RMS-normed hidden states through the output matrix, soft-capped where cap > 0."""
    h = h.rms_norm(norm, eps).set_name("result_norm")
    return softcap(output.matmul(h), cap).set_name("result_output")


def per_sequence(spans: list[tuple[int, int]], mix: Callable[[int, int, int], Tensor]) -> Tensor:
    """mix(s, begin, count) for each sequence s of a batch (its columns begin..begin + count), side by side:
    how a recurrent layer runs each sequence from its own state."""
    return side_by_side([mix(s, begin, count) for s, (begin, count) in enumerate(spans)], 1)


def side_by_side(parts: list[Tensor], dim: int) -> Tensor:
    """parts concatenated along dim."""
    y = parts[0]
    for more in parts[1:]:
        y = y.concat(more, dim)
    return y


def pieces(count: int, cuts: tuple[int, ...]) -> list[tuple[int, int]]:
    """(first, rows) of the pieces that cuts (ascending offsets inside count rows) make of a sequence's rows:
    a recurrent op runs on each in turn from the state the one before left (kvcache.Recurrent.splits)."""
    edges = [0, *cuts, count]
    return [(a, b - a) for a, b in zip(edges, edges[1:], strict=False)]


def span(t: Tensor, dim: int, first: int, count: int) -> Tensor:
    """Elements first..first + count of t along dimension dim (a view with t's strides)."""
    shape = list(t.ne)
    shape[dim] = count
    return t.view(first * t.strides[dim], shape, t.strides[1:])


def query_temperature(positions: np.ndarray, beta: float, length: int) -> np.ndarray:
    """Llama 4's attention temperature as Mistral 3 and DeepSeek (Mistral Large 3) apply it to each query:
    1 + beta ln(1 + floor(position / length)), shaped (n, 1, 1) for a graph input (llama.cpp's attn_temp)."""
    intervals = np.floor(np.asarray(positions, dtype=np.float64) / length)
    return (np.log(intervals + 1.0) * beta + 1.0).astype(np.float32).reshape(-1, 1, 1)


def f32_reciprocal_sqrt(x: float) -> float:
    """1.0f / sqrtf(x), rounded as llama.cpp's float arithmetic rounds it."""
    return float(np.float32(1) / np.sqrt(np.float32(x)))
