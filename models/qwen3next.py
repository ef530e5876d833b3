"""Qwen3-Next: gated DeltaNet linear-attention layers interleaved with gated full attention, mixtures of
experts with a gated shared expert, on the Recurrent cache.

As llama.cpp's qwen3next graph. A layer is linear attention where attention.recurrent_layers says so, else
all but every full_attention_interval-th (default 4). Every layer: h += mix(rms_norm(h)) (attn_norm),
then h += ffn(rms_norm(h)) (post_attention_norm).

Gated DeltaNet: qkv = attn_qkv(x) and z = attn_gate(x); beta and alpha from ssm_ba(x) (per key head: beta
for its value heads, then alpha); qkv's channels are convolved over time (ggml_ssm_conv, ssm.conv_kernel
taps, the conv state the last taps' inputs), silu; q and k L2-normalised (repeated per value head where
there are fewer key heads); the gated delta rule (ggml_gated_delta_net) with beta = sigmoid(beta) and the
decay gate softplus(alpha + ssm_dt.bias) * ssm_a, from the state (value head size squared per head);
rms_norm(out) * silu(z) (ssm_norm), then ssm_out. The cache row holds the conv state, then that state.

Full attention: attn_q yields per head a query and a gate; per-head q/k RMS norms, NeoX RoPE over
rope.dimension_count dims; the attention's output times sigmoid(gate) goes through attn_output.
FFN: softmax-routed SwiGLU experts (weights normalised) plus a SwiGLU shared expert scaled by
sigmoid(ffn_gate_inp_shexp · x); a plain SwiGLU where a layer has no router. Each sequence of a batch
is convolved and scanned on its own (kvcache/recurrent.py). The MTP blocks are refused, not run. Qwen3.5
(Qwen35, below) builds the same layers as llama.cpp's qwen35 graphs do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ollama_engine.kvcache import Batch, Recurrent
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .alone import matmul_alone
from .base import Model, ModelError, bind, register, require_uint, weight
from .layers import Dense, Output, attend, ffn, head, inputs, per_sequence, pieces, side_by_side, span
from .moe import Gating, Routing, bind_experts, moe


@dataclass
class Norms:
    attn_norm: Tensor = weight("attn_norm.weight")
    post_norm: Tensor = weight("post_attention_norm.weight")


@dataclass
class LinearLayer(Norms):
    qkv: Tensor = weight("attn_qkv.weight")  # hidden -> q, k (key heads), v (value heads)
    gate: Tensor = weight("attn_gate.weight")  # hidden -> z
    ssm_ba: Tensor | None = weight("ssm_ba.weight", optional=True)  # per key head: its value heads' beta, alpha
    ssm_beta: Tensor | None = weight("ssm_beta.weight", optional=True)  # qwen35: beta and alpha apart
    ssm_alpha: Tensor | None = weight("ssm_alpha.weight", optional=True)
    conv: Tensor = weight("ssm_conv1d.weight")  # (conv_kernel, channels), F32
    dt_bias: Tensor = weight("ssm_dt.bias")
    ssm_a: Tensor = weight("ssm_a")  # (value heads,): -exp(A_log)
    ssm_norm: Tensor = weight("ssm_norm.weight")  # (value head size,)
    ssm_out: Tensor = weight("ssm_out.weight")


@dataclass
class AttentionLayer(Norms):
    attn_q: Tensor = weight("attn_q.weight")  # hidden -> per head: query, gate
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_q_norm: Tensor = weight("attn_q_norm.weight")
    attn_k_norm: Tensor = weight("attn_k_norm.weight")
    attn_output: Tensor = weight("attn_output.weight")


@dataclass
class SharedExpert:
    gate_inp: Tensor | None = weight("ffn_gate_inp_shexp.weight", optional=True)  # (hidden,)
    gate: Tensor | None = weight("ffn_gate_shexp.weight", optional=True)
    up: Tensor | None = weight("ffn_up_shexp.weight", optional=True)
    down: Tensor | None = weight("ffn_down_shexp.weight", optional=True)


@register("qwen3next")
class Qwen3Next(Model):
    reuse_graphs = True
    rope_options = RopeOptions(neox=True)

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        c = self.config
        if c.get_uint("nextn_predict_layers", 0):
            raise ModelError(f"qwen3next: nextn_predict_layers {c.get_uint('nextn_predict_layers')} (MTP blocks) "
                             "is not supported yet")
        self.blocks = require_uint(c, "block_count")
        self.hidden = require_uint(c, "embedding_length")
        self.heads = require_uint(c, "attention.head_count")
        self.kv_heads = require_uint(c, "attention.head_count_kv")
        self.head_dim = c.get_uint("attention.key_length", 0) or self.hidden // max(self.heads, 1)
        self.n_rot = c.get_uint("rope.dimension_count", self.head_dim)
        self.rope_base = c.get_float("rope.freq_base", 10000.0)
        self.eps = c.get_float("attention.layer_norm_rms_epsilon", 1e-6)
        self.d_conv = require_uint(c, "ssm.conv_kernel")
        self.d_inner = require_uint(c, "ssm.inner_size")
        self.k_dim = require_uint(c, "ssm.state_size")  # a key head's size
        self.k_heads = require_uint(c, "ssm.group_count")
        self.v_heads = require_uint(c, "ssm.time_step_rank")
        if (not self.heads or not self.kv_heads or self.heads % self.kv_heads or self.d_conv < 2 or not self.k_heads
                or not self.v_heads or self.v_heads % self.k_heads or self.d_inner != self.k_dim * self.v_heads):
            raise ModelError(f"qwen3next: head_count {self.heads} must be a multiple of head_count_kv "
                             f"{self.kv_heads}, ssm.conv_kernel {self.d_conv} at least 2, ssm.time_step_rank "
                             f"{self.v_heads} a multiple of ssm.group_count {self.k_heads}, and ssm.inner_size "
                             f"{self.d_inner} ssm.state_size {self.k_dim} times ssm.time_step_rank")
        recurrent = c.get_bools("attention.recurrent_layers")
        interval = c.get_uint("full_attention_interval", 4) or 4
        self.recurrent = recurrent if len(recurrent) >= self.blocks else [
            (i + 1) % interval != 0 for i in range(self.blocks)]
        self.weights = bind(Output, backend)
        self.layers: list[LinearLayer | AttentionLayer] = [
            bind(LinearLayer if self.recurrent[i] else AttentionLayer, backend, f"blk.{i}.")
            for i in range(self.blocks)]
        self.routing = Routing.from_config(c, Gating.SOFTMAX, True, c.get_float("expert_weights_scale", 1.0)) if (
            c.get_uint("expert_count", 0)) else None
        self.experts = {i: bind_experts(backend, i, self.routing, self.hidden) for i in range(self.blocks)
                        if self.routing is not None and backend.get(f"blk.{i}.ffn_gate_inp.weight") is not None}
        self.shared = {i: bind(SharedExpert, backend, f"blk.{i}.") for i in self.experts}
        self.dense = {i: bind(Dense, backend, f"blk.{i}.") for i in range(self.blocks) if i not in self.experts}
        self.channels = 2 * self.k_heads * self.k_dim + self.d_inner  # q, k, v: what the convolution sees
        states = ((self.d_conv - 1) * self.channels, self.k_dim * self.d_inner)
        self.cache = Recurrent(self.shift, {i: states for i in range(self.blocks) if self.recurrent[i]})

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return key.rope(delta, self.n_rot, self.rope_base, 1.0, None, self.rope_options)

    def delta_net(self, ctx: Context, layer: LinearLayer, x: Tensor, i: int) -> Tensor:
        """Gated DeltaNet mixing of x (hidden, n), each sequence of the batch from its own states."""
        kd, kh, vh, channels, d_conv = self.k_dim, self.k_heads, self.v_heads, self.channels, self.d_conv - 1
        qkv = layer.qkv.matmul(x)
        z = layer.gate.matmul(x)
        gates, betas = self.gates(layer, x)
        stride, z_stride = qkv.strides[1], z.strides[1]

        def scan(s: int, begin: int, count: int) -> Tensor:
            at, strides = begin * vh * 4, (4, vh * 4, vh * count * 4)
            beta, gate = (t.view(at, (1, vh, count, 1), strides) for t in (betas, gates))
            conv_state = self.cache.state(ctx, i, s, 0).reshape(d_conv, channels)
            conv_x = conv_state.concat(qkv.view(begin * stride, (channels, count)).transpose(), 0)
            new_conv = conv_x.view(count * 4, (d_conv, channels), (conv_x.strides[1],))
            mixed = conv_x.reshape(d_conv + count, channels, 1).ssm_conv(layer.conv).silu()  # (channels, count, 1)
            row = mixed.strides[1]
            q, k = (mixed.view(at, (kd, kh, count, 1), (kd * 4, row, row * count)) for at in (0, kh * kd * 4))
            v = mixed.view(2 * kh * kd * 4, (kd, vh, count, 1), (kd * 4, row, row * count))
            q, k = (self.for_value_heads(t.rms_norm(None, self.eps / kd).scale(1.0 / math.sqrt(kd)))
                    for t in (q, k))  # L2-normed
            state, outs, cuts = self.cache.state(ctx, i, s, 1).reshape(kd, kd, vh, 1), [], self.cache.splits(s)
            for cut, (a, n) in enumerate(pieces(count, cuts)):  # token by token: pieces give one call's numbers
                result = span(q, 2, a, n).gated_delta_net(span(k, 2, a, n), span(v, 2, a, n), span(gate, 2, a, n),
                                                          span(beta, 2, a, n), state)
                outs.append(result.view(0, (kd, vh, n), (kd * 4, kd * vh * 4)))
                state = result.view(kd * vh * n * 4, (kd, kd, vh, 1), (kd * 4, kd * kd * 4, kd * kd * vh * 4))
                if cut < len(cuts):
                    kept = conv_x.view(cuts[cut] * 4, (d_conv, channels), (conv_x.strides[1],))
                    self.cache.keep(ctx, i, s, cut, [kept, state])
            self.cache.update(ctx, i, s, [new_conv, state])
            out = side_by_side(outs, 2).rms_norm(layer.ssm_norm, self.eps)
            gated = z.view(begin * z_stride, (self.d_inner, count)).reshape(kd, vh, count).silu()
            return out.mul(gated).reshape(self.d_inner, count)

        y = per_sequence(self.cache.spans(), scan)
        return layer.ssm_out.matmul(y).set_name(f"linear_attn_out-{i}")

    def gates(self, layer: LinearLayer, x: Tensor) -> tuple[Tensor, Tensor]:
        """The delta rule's decay gate softplus(alpha + dt_bias) * A and its beta sigmoid(beta), (1, value
        heads, n) each: from ssm_ba (per key head, its value heads' betas then alphas) or ssm_beta/ssm_alpha."""
        vh, n = self.v_heads, x.ne[1]
        if layer.ssm_ba is not None:
            ba, per_k = layer.ssm_ba.matmul(x), vh // self.k_heads
            b, a = (ba.view(at, (per_k, self.k_heads, n), (2 * per_k * 4, ba.strides[1])) for at in (0, per_k * 4))
            beta, alpha = b.contiguous().sigmoid(), a.contiguous(vh, n)
        elif layer.ssm_beta is not None and layer.ssm_alpha is not None:
            beta, alpha = layer.ssm_beta.matmul(x).sigmoid(), layer.ssm_alpha.matmul(x)
        else:
            raise ModelError("a linear-attention layer needs ssm_ba.weight, or ssm_beta.weight and ssm_alpha.weight")
        gate = alpha.add(layer.dt_bias).softplus().mul(layer.ssm_a)
        return gate.reshape(1, vh, n), beta.reshape(1, vh, n)

    def for_value_heads(self, t: Tensor) -> Tensor:
        """Normed queries or keys (key size, key heads, n, 1) for the delta rule: each key head repeated for
        the value heads it serves, in turn (qwen3next's order)."""
        kd, kh, per_k, n = self.k_dim, self.k_heads, self.v_heads // self.k_heads, t.ne[2]
        if per_k == 1:
            return t
        return t.reshape(kd, 1, kh, n).repeat_to(kd, per_k, kh, n).reshape(kd, self.v_heads, n, 1)

    def rope(self, t: Tensor, positions: Tensor) -> Tensor:
        return t.rope(positions, self.n_rot, self.rope_base, 1.0, None, self.rope_options)

    def rope_positions(self, ctx: Context, batch: Batch, positions: Tensor) -> Tensor:
        """What the attention layers rotate by: the batch's positions."""
        return positions

    def self_attention(self, ctx: Context, layer: AttentionLayer, x: Tensor, positions: Tensor, i: int) -> Tensor:
        n, d, heads = x.ne[1], self.head_dim, self.heads
        full = layer.attn_q.matmul(x).reshape(2 * d, heads, n)
        q = full.view(0, (d, heads, n), full.strides[1:3]).rms_norm(layer.attn_q_norm, self.eps)
        gate = full.view(d * 4, (d, heads, n), full.strides[1:3])
        k = layer.attn_k.matmul(x).reshape(d, self.kv_heads, n).rms_norm(layer.attn_k_norm, self.eps)
        v = layer.attn_v.matmul(x).reshape(d, self.kv_heads, n)
        q, k = self.rope(q, positions), self.rope(k, positions)
        out = attend(ctx, self.cache, q, k, v, 1.0 / math.sqrt(d), i)
        out = out.mul(gate.contiguous(d * heads, n).sigmoid())
        return layer.attn_output.matmul(out).set_name(f"attn_output-{i}")

    def feed_forward(self, x: Tensor, i: int, rows: tuple[int, ...]) -> Tensor:
        """Layer i's FFN; rows: per sequence, for the router and the shared expert's gate (models/alone.py)."""
        if i in self.dense:
            dense = self.dense[i]
            return ffn(x, dense.ffn_gate, dense.ffn_up, dense.ffn_down, i)
        assert self.routing is not None
        out = moe(x, self.experts[i], self.routing, i, rows=rows)
        shared = self.shared[i]
        if shared.up is None or shared.gate is None or shared.down is None:
            return out
        expert = ffn(x, shared.gate, shared.up, shared.down, i).set_name(f"ffn_shexp-{i}")
        if shared.gate_inp is not None:
            expert = expert.mul(matmul_alone(shared.gate_inp, x, rows).sigmoid())
        return out.add(expert)

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        inp = inputs(ctx, batch, self.blocks, self.rows_alone)
        h = self.weights.token_embd.rows(inp.tokens)
        positions = self.rope_positions(ctx, batch, inp.positions)
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            x = h.rms_norm(layer.attn_norm, self.eps).set_name(f"attn_norm-{i}")
            if isinstance(layer, LinearLayer):
                x = self.delta_net(ctx, layer, x, i)
            else:
                x = self.self_attention(ctx, layer, x, positions, i)
            if inp.done(i):
                return None
            x, h = inp.rows(i, x, h)
            h = x.add(h).set_name(f"attn_residual-{i}")
            x = h.rms_norm(layer.post_norm, self.eps).set_name(f"attn_post_norm-{i}")
            x = self.feed_forward(x, i, inp.sequence_rows(i))
            h = x.add(h).set_name(f"l_out-{i}")
        return head(h, self.weights.output_norm, self.weights.output, self.eps)


def text_positions(positions: np.ndarray) -> np.ndarray:
    """A text token's 4 multimodal position components, component-major: p, p, p, 0."""
    positions = np.asarray(positions, dtype=np.int32)
    return np.concatenate([positions, positions, positions, np.zeros_like(positions)])


@register("qwen35", "qwen35moe")
class Qwen35(Qwen3Next):
    """Qwen3.5 (qwen35, dense; qwen35moe, mixtures): Qwen3-Next's layers as llama.cpp's qwen35 graphs build them.

    Three differences from Qwen3Next (above): beta and alpha come from two projections
    (ssm_beta, ssm_alpha) instead of one interleaved per key head; with fewer key heads than value heads,
    value head h reads key head h mod key heads (the fused ggml_gated_delta_net's own broadcast, where
    Qwen3-Next repeats each key head for its value heads in turn); and the attention layers rotate by
    interleaved multimodal RoPE (rope.dimension_sections; a text token's position in its first three
    components, 0 in the fourth, as llama.cpp fills them). qwen35's FFN is a SwiGLU, qwen35moe's Qwen3-Next's
    mixture with its gated shared expert.
    """

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        sections = self.config.get_ints("rope.dimension_sections")
        sections = (sections + [0] * 4)[:4]
        if not any(sections) or min(sections) < 0 or sum(sections) > self.n_rot // 2:
            raise ModelError(f"{self.config.architecture}: rope.dimension_sections {sections} must be 4 (or fewer) "
                             f"non-negative counts of rotated pairs, at most {self.n_rot // 2} in all")
        self.sections = sections

    def for_value_heads(self, t: Tensor) -> Tensor:
        return t  # ggml_gated_delta_net broadcasts key heads to value heads in qwen35's order

    def rope(self, t: Tensor, positions: Tensor) -> Tensor:
        return t.rope_multi(positions, self.n_rot, self.sections, self.rope_base)

    def rope_positions(self, ctx: Context, batch: Batch, positions: Tensor) -> Tensor:
        return ctx.input().from_numpy(text_positions(batch.positions)).set_name("mrope_positions")

    def batch_inputs(self, batch: Batch) -> dict[str, np.ndarray]:
        return {"mrope_positions": text_positions(batch.positions)}

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        raise ModelError("qwen35: keys rotated by multimodal RoPE are not shifted (the recurrent layers refuse "
                         "a shift first)")
