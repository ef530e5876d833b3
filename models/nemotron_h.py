"""Nemotron-H (NVIDIA): Mamba-2 layers, attention layers and MLP layers by a per-layer pattern, on the
Recurrent cache.

As llama.cpp's nemotron_h graph: a layer whose attention.head_count_kv and feed_forward_length entries are
both 0 is Mamba-2, one with only feed_forward_length 0 is attention, the others an MLP. Every layer is
h += op(rms_norm(h)) (attn_norm). Attention has no positional encoding (no RoPE) and optional biases; the
MLP is ffn_down(relu(ffn_up(x))^2).

Mamba-2: z, xBC, dt = split(ssm_in(x)); xBC's channels (x, then B and C of ssm.group_count groups of
ssm.state_size) are convolved over time with ssm.conv_kernel taps (ggml_ssm_conv, the first taps reading
the previous tokens' inputs: the conv state), plus ssm_conv1d.bias, then silu; the selective scan
(ggml_ssm_scan) runs per head with dt + ssm_dt.bias and ssm_a from the SSM state (state_size x inner_size
per sequence); y + x * ssm_d is gated by silu(z), RMS-normed per group (ssm_norm) and projected (ssm_out).
Each Mamba-2 layer keeps two states per sequence in the cache's row: the conv state, then the SSM state.
Each sequence of a batch is scanned on its own (kvcache/recurrent.py). Nemotron-H MoE (NemotronHMoe, below)
replaces the MLP layers by mixtures of experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch, Recurrent, attention
from ollama_engine.ml import Backend, Context, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, require_uint, weight
from .layers import Output, head, inputs, linear, per_sequence, pieces, side_by_side, span
from .moe import Gating, Routing, bind_experts, moe


@dataclass
class MambaLayer:
    attn_norm: Tensor = weight("attn_norm.weight")
    ssm_in: Tensor = weight("ssm_in.weight")  # hidden -> z, xBC, dt
    ssm_conv1d: Tensor = weight("ssm_conv1d.weight")  # (conv_kernel, xBC channels), F32
    ssm_conv1d_b: Tensor | None = weight("ssm_conv1d.bias", optional=True)
    ssm_dt_b: Tensor = weight("ssm_dt.bias")
    ssm_a: Tensor = weight("ssm_a")  # (1, heads): -exp(A_log)
    ssm_d: Tensor = weight("ssm_d")  # (1, heads)
    ssm_norm: Tensor = weight("ssm_norm.weight")  # (inner / groups, groups)
    ssm_out: Tensor = weight("ssm_out.weight")


@dataclass
class AttentionLayer:
    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_output: Tensor = weight("attn_output.weight")
    q_bias: Tensor | None = weight("attn_q.bias", optional=True)
    k_bias: Tensor | None = weight("attn_k.bias", optional=True)
    v_bias: Tensor | None = weight("attn_v.bias", optional=True)
    output_bias: Tensor | None = weight("attn_output.bias", optional=True)


@dataclass
class MlpLayer:
    attn_norm: Tensor = weight("attn_norm.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")
    up_bias: Tensor | None = weight("ffn_up.bias", optional=True)
    down_bias: Tensor | None = weight("ffn_down.bias", optional=True)


def per_layer(config: Config, key: str, blocks: int) -> list[int]:
    """A per-layer count: an array of one entry per layer, or one number for all."""
    value = config.value(key)
    values = [int(v) for v in value] if isinstance(value, list) else [require_uint(config, key)] * blocks
    if len(values) != blocks:
        raise ModelError(f"nemotron_h: {key} has {len(values)} entries for {blocks} layers")
    return values


@register("nemotron_h")
class NemotronH(Model):
    reuse_graphs = True

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        c = self.config
        self.blocks = require_uint(c, "block_count")
        self.hidden = require_uint(c, "embedding_length")
        self.heads = per_layer(c, "attention.head_count", self.blocks)
        self.kv_heads = per_layer(c, "attention.head_count_kv", self.blocks)
        self.ff = per_layer(c, "feed_forward_length", self.blocks)
        attention_heads = [h for h, kv, ff in zip(self.heads, self.kv_heads, self.ff, strict=True) if kv and not ff]
        if any(not h or h % kv for h, kv, ff in zip(self.heads, self.kv_heads, self.ff, strict=True) if kv and not ff):
            raise ModelError(f"nemotron_h: every attention layer's head_count {self.heads} must be a positive "
                             f"multiple of its head_count_kv {self.kv_heads}")
        self.head_dim = c.get_uint("attention.key_length", 0) or (
            self.hidden // attention_heads[0] if attention_heads else 0)
        self.d_conv = require_uint(c, "ssm.conv_kernel")
        self.d_inner = require_uint(c, "ssm.inner_size")
        self.d_state = require_uint(c, "ssm.state_size")
        self.ssm_heads = require_uint(c, "ssm.time_step_rank")
        self.groups = require_uint(c, "ssm.group_count")
        if (self.d_conv < 2 or not self.ssm_heads or self.d_inner % self.ssm_heads or not self.groups
                or self.d_inner % self.groups or self.ssm_heads % self.groups):
            raise ModelError(f"nemotron_h: ssm.conv_kernel {self.d_conv} must be at least 2, and ssm.inner_size "
                             f"{self.d_inner} a multiple of ssm.time_step_rank {self.ssm_heads} and of "
                             f"ssm.group_count {self.groups}, which divides the heads")
        eps = c.get_float("attention.layer_norm_epsilon", 1e-5)
        self.eps = c.get_float("attention.layer_norm_rms_epsilon", eps)
        self.kq_scale = c.get_float("attention.scale", 0.0) or (1.0 / math.sqrt(self.head_dim or 1))
        self.weights = bind(Output, backend)
        self.layers: list[MambaLayer | AttentionLayer | MlpLayer] = [
            bind(self.layer_class(i), backend, f"blk.{i}.") for i in range(self.blocks)]
        self.channels = self.d_inner + 2 * self.groups * self.d_state  # xBC
        states = ((self.d_conv - 1) * self.channels, self.d_state * self.d_inner)
        self.cache = Recurrent(self.shift, {i: states for i in range(self.blocks) if self.is_mamba(i)})

    def is_mamba(self, layer: int) -> bool:
        return self.kv_heads[layer] == 0 and self.ff[layer] == 0

    def layer_class(self, layer: int) -> type:
        if self.is_mamba(layer):
            return MambaLayer
        return AttentionLayer if self.ff[layer] == 0 else MlpLayer

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return key  # no positional encoding in the keys (the Recurrent cache refuses shifts anyway)

    def mamba2(self, ctx: Context, layer: MambaLayer, x: Tensor, i: int, ids: Tensor) -> Tensor:
        """Mamba-2 mixing of x (hidden, n), each sequence of the batch from its own states."""
        d_inner, channels, d_state, groups = self.d_inner, self.channels, self.d_state, self.groups
        heads, d_conv = self.ssm_heads, self.d_conv - 1
        head_dim = d_inner // heads
        zxbcdt = layer.ssm_in.matmul(x)
        stride = zxbcdt.strides[1]

        def scan(s: int, begin: int, count: int) -> Tensor:
            at = begin * stride
            z = zxbcdt.view(at, (head_dim, heads, count, 1), (head_dim * 4, stride, stride * count))
            xbc = zxbcdt.view(at + d_inner * 4, (channels, count), (stride,))
            dt = zxbcdt.view(at + (d_inner + channels) * 4, (heads, count, 1), (stride, stride * count))
            conv_state = self.cache.state(ctx, i, s, 0).reshape(d_conv, channels)
            conv_x = conv_state.concat(xbc.transpose(), 0)  # (d_conv + count, channels)
            new_conv = conv_x.view(count * 4, (d_conv, channels), (conv_x.strides[1],))
            xbc = conv_x.reshape(d_conv + count, channels, 1).ssm_conv(layer.ssm_conv1d)
            if layer.ssm_conv1d_b is not None:
                xbc = xbc.add(layer.ssm_conv1d_b)
            xbc = xbc.silu()  # (channels, count, 1)
            row = xbc.strides[1]
            xs = xbc.view(0, (head_dim, heads, count, 1), (head_dim * 4, row, row * count))
            b = xbc.view(d_inner * 4, (d_state, groups, count, 1), (d_state * 4, row, row * count))
            c = xbc.view((d_inner + groups * d_state) * 4, (d_state, groups, count, 1), (d_state * 4, row, row * count))
            dt = dt.contiguous().add(layer.ssm_dt_b)
            ys, cuts = [], self.cache.splits(s)
            state = self.cache.state(ctx, i, s, 1).reshape(d_state, head_dim, heads, 1)
            for cut, (a, n) in enumerate(pieces(count, cuts)):  # token by token: pieces give one call's numbers
                scanned = state.ssm_scan(span(xs, 2, a, n), span(dt, 1, a, n), layer.ssm_a, span(b, 2, a, n),
                                         span(c, 2, a, n), ids)
                ys.append(scanned.view(0, (head_dim, heads, n, 1), (head_dim * 4, d_inner * 4, d_inner * n * 4)))
                state = scanned.view(d_inner * n * 4, (d_state, head_dim, heads, 1),
                                     (d_state * 4, d_state * head_dim * 4, d_state * d_inner * 4))
                if cut < len(cuts):
                    kept = conv_x.view(cuts[cut] * 4, (d_conv, channels), (conv_x.strides[1],))
                    self.cache.keep(ctx, i, s, cut, [kept, state])
            self.cache.update(ctx, i, s, [new_conv, state])
            y = side_by_side(ys, 2)
            y = y.add(xs.mul(layer.ssm_d)).set_name(f"mamba2_y_add_d-{i}")
            y = z.contiguous().silu(y)
            y = y.reshape(d_inner // groups, groups, count).rms_norm(layer.ssm_norm, self.eps)
            return y.reshape(d_inner, count)

        y = per_sequence(self.cache.spans(), scan)
        return layer.ssm_out.matmul(y)

    def self_attention(self, ctx: Context, layer: AttentionLayer, x: Tensor, i: int) -> Tensor:
        n, d, heads, kv = x.ne[1], self.head_dim, self.heads[i], self.kv_heads[i]
        q = linear(x, layer.attn_q, layer.q_bias).reshape(d, heads, n).set_name(f"Qcur-{i}")
        k = linear(x, layer.attn_k, layer.k_bias).reshape(d, kv, n).set_name(f"Kcur-{i}")
        v = linear(x, layer.attn_v, layer.v_bias).reshape(d, kv, n).set_name(f"Vcur-{i}")
        x = attention(ctx, q, k, v, self.kq_scale, self.cache).reshape(d * heads, n)
        return linear(x, layer.attn_output, layer.output_bias).set_name(f"attn_out-{i}")

    def mlp(self, layer: MlpLayer, x: Tensor, i: int, rows: tuple[int, ...]) -> Tensor:
        """The MLP layer's output; rows: per sequence, for a mixture's router (NemotronHMoe)."""
        up = linear(x, layer.ffn_up, layer.up_bias).relu().sqr()
        # llama.cpp names this ffn_out, then (its control vector applied) l_out
        return linear(up, layer.ffn_down, layer.down_bias).set_name(f"l_out-{i}")

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        # positions unused (no RoPE), but a reused graph sets them
        inp = inputs(ctx, batch, self.blocks, self.rows_alone)
        ids = ctx.input().from_numpy(np.zeros(1, dtype=np.int32)).set_name("ssm_ids")  # the one state slot scanned
        h = self.weights.token_embd.rows(inp.tokens)
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            x = h.rms_norm(layer.attn_norm, self.eps).set_name(f"attn_norm-{i}")
            if isinstance(layer, MambaLayer):
                x = self.mamba2(ctx, layer, x, i, ids)
            elif isinstance(layer, AttentionLayer):
                x = self.self_attention(ctx, layer, x, i)
            else:
                x = self.mlp(layer, x, i, inp.batch_rows)  # every row: the outputs are taken after
            if inp.done(i):
                return None
            x, h = inp.rows(i, x, h)
            h = x.add(h).set_name(f"nemotron_h_block_out-{i}")
        return head(h, self.weights.output_norm, self.weights.output, self.eps)


@dataclass
class MoeLayer:
    attn_norm: Tensor = weight("attn_norm.weight")
    up_shexp: Tensor = weight("ffn_up_shexp.weight")
    down_shexp: Tensor = weight("ffn_down_shexp.weight")


def relu_squared(up: Tensor, gate: Tensor | None) -> Tensor:
    return up.relu().sqr()


@register("nemotron_h_moe")
class NemotronHMoe(NemotronH):
    """Nemotron-H MoE (Nemotron 3 Nano, Super): Nemotron-H's Mamba-2 and attention layers, with its MLP
    layers replaced by mixtures of experts.

    As llama.cpp's nemotron_h_moe (which builds nemotron_h's graph): every layer that is neither Mamba-2 nor
    attention routes each token to expert_used_count of expert_count ungated ReLU² experts
    (expert_feed_forward_length wide) by sigmoid probabilities plus the selection bias exp_probs_b, their
    weights normalised where expert_weights_norm says and scaled by expert_weights_scale (models/moe.py), and
    adds a shared ReLU² expert (expert_shared_feed_forward_length wide). The latent projections of Nemotron 3
    Super (moe_latent_size), per-layer expert counts and the multi-token-prediction blocks are refused, not run.
    """

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        c = backend.model.config if backend.model is not None else None
        for key in ("moe_latent_size", "nextn_predict_layers"):
            if c is not None and c.get_uint(key, 0):
                raise ModelError(f"nemotron_h_moe: {key} {c.get_uint(key)} is not supported yet")
        super().__init__(backend, tokenizer)
        self.routing = Routing.from_config(self.config, Gating.SIGMOID, self.config.get_bool("expert_weights_norm"),
                                           self.config.get_float("expert_weights_scale", 1.0))
        self.experts = {i: bind_experts(backend, i, self.routing, self.hidden, gated=False)
                        for i, layer in enumerate(self.layers) if isinstance(layer, MoeLayer)}

    def layer_class(self, layer: int) -> type:
        cls = super().layer_class(layer)
        return MoeLayer if cls is MlpLayer else cls

    def mlp(self, layer: MoeLayer, x: Tensor, i: int, rows: tuple[int, ...]) -> Tensor:  # type: ignore[override]
        routed = moe(x, self.experts[i], self.routing, i, relu_squared, rows=rows)
        shared = layer.down_shexp.matmul(layer.up_shexp.matmul(x).relu().sqr()).set_name(f"ffn_shexp-{i}")
        return routed.add(shared).set_name(f"l_out-{i}")
