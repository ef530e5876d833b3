"""Laguna (poolside's Laguna-XS.2, S.2, M.1): gated attention with q/k norms and per-layer-type RoPE, sliding
windows, and a sigmoid-routed mixture of experts with a selection bias and a shared expert.

As llama.cpp's laguna graph. Per layer, on x = rms_norm(h):
- q, k, v from x (no biases); the query's head count may differ per layer (attention.head_count is then
  an array: XS.2 has 48 heads on full layers and 64 on sliding ones), the KV heads do not; each q and k head
  is RMS-normalised (attn_q_norm, attn_k_norm) before NeoX RoPE; scores scaled by 1/sqrt(head size);
- with attention.sliding_window set, layer 0 and every 4th after it (or attention.sliding_window_pattern)
  attend to everything, the others to the last sliding_window positions, each kind in its own cache; full
  layers turn rope.dimension_count features with rope.freq_base and rope.scaling (YaRN, betas 32 and 1 as
  llama.cpp's context gives them); sliding layers turn rope.dimension_count_swa features with
  rope.freq_base_swa, unscaled. Without a sliding window (M.1) every layer is full;
- the attention output is gated by softplus(attn_gate x), one value per head (XS.2) or per element (M.1),
  chosen by attn_gate's width; then attn_output, and h += it;
- h += ffn(rms_norm(h)): SwiGLU in the first leading_dense_block_count layers, then a mixture of experts
  (sigmoid probabilities, exp_probs_b added to pick, weights normalised where expert_weights_norm says and
  scaled by expert_weights_scale) plus an always-on shared expert of expert_shared_feed_forward_length.

Ollama's conversions (convert_laguna.go; same architecture name) name the gate attn_g and the sliding layers'
RoPE keys rope.swa.* (freq_base, dimension_count, scaling.factor), write the pattern as one flag per layer
(no flags: every layer full), and are run as Ollama's model runs them (model/models/laguna): a gate per
head only, YaRN's parameters on every full layer (extrapolation 1, rope.scaling.attn_factor as the
attention factor, rope.scaling.beta_fast/beta_slow, defaults 64 and 1, original context default 4096),
theta defaults 500000 and 10000, expert weights normalised unless the file says not, dense layers from
dense_layers and leading_dense_block_count, experts every decoder_sparse_step-th layer. Like Ollama, this
refuses its files with SWA attention sinks, another gating type, no q/k norms or non-sigmoid routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch, Causal, Wrapper, attention
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .alone import sequence_rows
from .base import Model, ModelError, bind, register, require_uint, weight
from .moe import Gating, Routing, bind_experts, moe
from .rope import yarn_options

SWA, FULL = 0, 1  # the Wrapper's caches, by layer type
GATING = {0: Gating.SIGMOID, 1: Gating.SOFTMAX, 2: Gating.SIGMOID}  # expert_gating_func; 0: unset (sigmoid)


@dataclass
class Layer:
    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor = weight("attn_k.weight")
    attn_v: Tensor = weight("attn_v.weight")
    attn_q_norm: Tensor = weight("attn_q_norm.weight")
    attn_k_norm: Tensor = weight("attn_k_norm.weight")
    attn_gate: Tensor | None = weight("attn_gate.weight", optional=True)
    attn_g: Tensor | None = weight("attn_g.weight", optional=True)  # Ollama's name for it
    attn_output: Tensor = weight("attn_output.weight")
    ffn_norm: Tensor = weight("ffn_norm.weight")
    ffn_gate: Tensor | None = weight("ffn_gate.weight", optional=True)
    ffn_up: Tensor | None = weight("ffn_up.weight", optional=True)
    ffn_down: Tensor | None = weight("ffn_down.weight", optional=True)
    ffn_gate_shexp: Tensor | None = weight("ffn_gate_shexp.weight", optional=True)
    ffn_up_shexp: Tensor | None = weight("ffn_up_shexp.weight", optional=True)
    ffn_down_shexp: Tensor | None = weight("ffn_down_shexp.weight", optional=True)


@dataclass
class Weights:
    token_embd: Tensor = weight("token_embd.weight")
    output_norm: Tensor = weight("output_norm.weight")
    output: Tensor = weight("output.weight")


@dataclass(frozen=True)
class Options:
    """Hyper-parameters as llama.cpp's laguna loader reads them."""

    block_count: int
    hidden: int
    heads: tuple[int, ...]  # per layer
    kv_heads: int
    head_dim: int
    eps: float
    window: int  # attention.sliding_window; 0: every layer full
    swa: tuple[bool, ...]  # per layer
    rope_dims: int
    rope_base: float
    rope_scale: float
    rope_dims_swa: int
    rope_base_swa: float
    rope_scale_swa: float
    dense: tuple[bool, ...]  # per layer: SwiGLU (True) or experts
    n_ff: int
    n_ff_shexp: int

    @classmethod
    def from_config(cls, config: Config, ollama: bool = False) -> Options:
        """ollama: the file is Ollama's conversion (its keys and defaults, see the module's docstring)."""
        blocks = require_uint(config, "block_count")
        hidden = require_uint(config, "embedding_length")
        heads = _per_layer(config, "attention.head_count", blocks)
        if not blocks or min(heads) == 0:
            raise ModelError(f"block_count {blocks} and every layer's attention.head_count {list(heads)} must be "
                             "positive")
        kv_heads = config.get_uint("attention.head_count_kv", heads[0])
        if kv_heads == 0 or any(h % kv_heads for h in heads):
            raise ModelError(f"attention.head_count {list(heads)} must be multiples of head_count_kv {kv_heads}")
        head_dim = config.get_uint("attention.key_length", hidden // heads[0])
        if head_dim == 0 or config.get_uint("attention.value_length", head_dim) != head_dim:
            raise ModelError(f"attention.key_length {head_dim} must be positive and equal value_length")
        rope_dims = config.get_uint("rope.dimension_count", head_dim)
        swa_dims_key = "rope.swa.dimension_count" if ollama else "rope.dimension_count_swa"
        rope_dims_swa = config.get_uint(swa_dims_key, head_dim if ollama else rope_dims)
        for key, dims in (("rope.dimension_count", rope_dims), (swa_dims_key, rope_dims_swa)):
            if not 0 < dims <= head_dim or dims % 2:
                raise ModelError(f"{key} {dims} must be even and in 2..head size {head_dim}")
        window = config.get_uint("attention.sliding_window", 512 if ollama else 0)
        if ollama:
            swa = _ollama_sliding_layers(config, blocks)
        else:
            swa = _sliding_layers(config, blocks) if window else (False,) * blocks
        if window > 2**31 - 1 or (any(swa) and window < 2):
            raise ModelError(f"attention.sliding_window must be in 2..{2**31 - 1}, got {window}")
        factor = config.get_float("rope.scaling.factor", 0.0)
        rope_scale = 1.0 / factor if factor else 1.0
        if config.get_string("rope.scaling.type", "") == "none":
            rope_scale = 1.0  # llama.cpp never scales then
        rope_base = config.get_float("rope.freq_base", 500000.0 if ollama else 10000.0)
        if ollama:
            rope_base_swa = config.get_float("rope.swa.freq_base", 10000.0)
            swa_factor = config.get_float("rope.swa.scaling.factor", 1.0)
            rope_scale_swa = 1.0 / swa_factor if swa_factor else 1.0
        else:
            rope_base_swa, rope_scale_swa = config.get_float("rope.freq_base_swa", rope_base), 1.0
        dense = _ollama_dense_layers(config, blocks) if ollama else tuple(
            i < config.get_uint("leading_dense_block_count", 0) for i in range(blocks))
        n_ff_exp = config.get_uint("expert_feed_forward_length", 0)
        n_ff_shexp = config.get_uint("expert_shared_feed_forward_length", 0)
        return cls(
            block_count=blocks, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            eps=config.get_float("attention.layer_norm_rms_epsilon", 1e-6), window=window, swa=swa,
            rope_dims=rope_dims, rope_base=rope_base, rope_scale=rope_scale, rope_dims_swa=rope_dims_swa,
            rope_base_swa=rope_base_swa, rope_scale_swa=rope_scale_swa, dense=dense,
            n_ff=require_uint(config, "feed_forward_length") if any(dense) else 0,
            n_ff_shexp=n_ff_shexp or n_ff_exp * config.get_uint("expert_shared_count", 1),
        )


def _per_layer(config: Config, key: str, blocks: int) -> tuple[int, ...]:
    """A key that is one number, or one per layer (llama.cpp's get_key_or_arr)."""
    values = config.value(key)
    if isinstance(values, list):
        ints = config.get_ints(key)
        if len(ints) != blocks or min(ints, default=0) < 0:
            raise ModelError(f"{config.full_key(key)} has {len(values)} values for {blocks} layers")
        return tuple(ints)
    return (require_uint(config, key),) * blocks


def _sliding_layers(config: Config, blocks: int) -> tuple[bool, ...]:
    """Which layers slide: attention.sliding_window_pattern's flags, or its n (default 4): every n-th layer from
    layer 0 is full (llama.cpp's load_swa_pattern, dense first; 0: every layer slides)."""
    flags = config.value("attention.sliding_window_pattern")
    if isinstance(flags, list):
        if len(flags) != blocks:
            raise ModelError(f"attention.sliding_window_pattern has {len(flags)} flags for {blocks} layers")
        return tuple(bool(f) for f in flags)
    n = config.get_uint("attention.sliding_window_pattern", 4)
    return tuple(n == 0 or i % n != 0 for i in range(blocks))


def _ollama_sliding_layers(config: Config, blocks: int) -> tuple[bool, ...]:
    """Ollama's: the per-layer flags, else attention.layer_types (1: sliding), else no sliding layer."""
    for key, sliding in (("attention.sliding_window_pattern", True), ("attention.layer_types", 1)):
        values = config.value(key)
        if isinstance(values, list) and len(values) == blocks:
            return tuple(v == sliding for v in values)
    return (False,) * blocks


def _ollama_dense_layers(config: Config, blocks: int) -> tuple[bool, ...]:
    """Ollama's: the layers dense_layers lists, the leading_dense_block_count first ones, and every layer
    off the decoder_sparse_step (experts in layer i when (i + 1) % step == 0); all dense without experts."""
    listed = set(config.get_ints("dense_layers")) | set(range(config.get_uint("leading_dense_block_count", 0)))
    step = max(config.get_uint("decoder_sparse_step", 1), 1)
    experts = config.get_uint("expert_count", 0) > 0
    return tuple(not experts or i in listed or (i + 1) % step != 0 for i in range(blocks))


def _ollama_full_rope(config: Config) -> RopeOptions:
    """Ollama's RoPE for full layers: YaRN's parameters whatever rope.scaling.type, its defaults."""
    factor = config.get_float("rope.scaling.factor", 1.0) or 1.0
    attention_factor = config.get_float("rope.scaling.attn_factor", 0.0)
    if not attention_factor:  # as Ollama's lagunaAttentionFactor, in float64 then float32
        yarn = config.get_string("rope.scaling.type", "") == "yarn" and factor > 1
        attention_factor = float(np.float32(0.1 * math.log(factor) + 1)) if yarn else 1.0
    return RopeOptions(neox=True, original_context=config.get_uint("rope.scaling.original_context_length", 4096),
                       extrapolation_factor=1.0, attention_factor=attention_factor,
                       beta_fast=config.get_float("rope.scaling.beta_fast", 64.0),
                       beta_slow=config.get_float("rope.scaling.beta_slow", 1.0))


def _refuse_what_ollama_refuses(config: Config) -> None:
    """Ollama's model (and converter) support only these; a file that says otherwise is not run wrongly."""
    if config.get_bool("attention.sink_enabled", False):
        raise ModelError("laguna: SWA attention sinks are not supported")
    if config.get_uint("attention.gating_type", 1) != 1:
        raise ModelError(f"laguna: unsupported attention gating type {config.get_uint('attention.gating_type')}")
    if not config.get_bool("attention.qk_norm", True):
        raise ModelError("laguna: Q/K RMSNorm is required")
    if config.get_uint("expert_gating_func", 0) != 2:
        raise ModelError(f"laguna: unsupported expert gating function {config.get_uint('expert_gating_func', 0)}")


@register("laguna")
class Laguna(Model):
    reuse_graphs = True

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.ollama = backend.get("blk.0.attn_g.weight") is not None  # Ollama's conversion
        if self.ollama:
            _refuse_what_ollama_refuses(self.config)
        self.options = o = Options.from_config(self.config, self.ollama)
        self.weights = bind(Weights, backend)
        self.layers = [bind(Layer, backend, f"blk.{i}.") for i in range(o.block_count)]
        self.experts = {}
        self.routing = None
        self._rows: tuple[int, ...] = ()  # the batch's rows per sequence, while its graph is built
        if not all(o.dense):
            gating = self.config.get_uint("expert_gating_func", 0)
            if gating not in GATING:
                raise ModelError(f"expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
            self.routing = Routing.from_config(
                self.config, GATING[gating], normalize=self.config.get_bool("expert_weights_norm", self.ollama),
                scale=self.config.get_float("expert_weights_scale", 0.0))
            self.experts = {i: bind_experts(backend, i, self.routing, o.hidden)
                            for i in range(o.block_count) if not o.dense[i]}
        for i, layer in enumerate(self.layers):
            self._check(layer, i)
        self.full_rope = (_ollama_full_rope(self.config) if self.ollama
                          else yarn_options(self.config, o.rope_scale, neox=True))
        self.swa_rope = RopeOptions(neox=True)  # llama.cpp zeroes YaRN's parameters on sliding layers
        if any(o.swa):
            # llama.cpp's n_swa counts the token itself, Causal's window the positions before it; sliding
            # layers keep a ring of n_swa + batch cells, as llama.cpp's default (swa_full off)
            self.cache = Wrapper(Causal(self.shift, window_size=max(o.window - 1, 1)), Causal(self.shift))
        else:
            self.cache = Causal(self.shift)

    def _check(self, layer: Layer, i: int) -> None:
        """The layer has the tensors its kind needs, each of llama.cpp's shape: ggml aborts on a matrix product
        of the wrong sizes. The gate is one value per head or one per element of the attention output."""
        o = self.options
        source = self.backend.model.path if self.backend.model is not None else "the backend"
        if layer.attn_g is not None and layer.attn_gate is None:
            layer.attn_gate, layer.attn_g = layer.attn_g, None  # Ollama's name, the same tensor
        if layer.attn_gate is None:
            raise ModelError(f"{source}: model is missing required tensor blk.{i}.attn_gate.weight")
        q, kv = o.heads[i] * o.head_dim, o.kv_heads * o.head_dim
        gate = layer.attn_gate.shape[1] if len(layer.attn_gate.shape) == 2 else -1
        if self.ollama and gate != o.heads[i]:
            gate = -1  # Ollama's model gates per head only
        shapes = {
            "attn_q": (o.hidden, q), "attn_k": (o.hidden, kv), "attn_v": (o.hidden, kv),
            "attn_q_norm": (o.head_dim,), "attn_k_norm": (o.head_dim,), "attn_output": (q, o.hidden),
            "attn_gate": (o.hidden, gate if gate in (o.heads[i], q) else o.heads[i]),
            "attn_norm": (o.hidden,), "ffn_norm": (o.hidden,),
            "ffn_gate": (o.hidden, o.n_ff), "ffn_up": (o.hidden, o.n_ff), "ffn_down": (o.n_ff, o.hidden),
            "ffn_gate_shexp": (o.hidden, o.n_ff_shexp), "ffn_up_shexp": (o.hidden, o.n_ff_shexp),
            "ffn_down_shexp": (o.n_ff_shexp, o.hidden),
        }
        ffn = ["ffn_gate", "ffn_up", "ffn_down"]
        required = list(shapes)[:9] + (ffn if o.dense[i] else [f"{name}_shexp" for name in ffn])
        for name in required:
            tensor = getattr(layer, name)
            if tensor is None:
                raise ModelError(f"{source}: model is missing required tensor blk.{i}.{name}.weight")
            if tensor.shape != shapes[name]:
                raise ModelError(f"{source}: tensor blk.{i}.{name}.weight has shape {list(tensor.shape)}, expected "
                                 f"{list(shapes[name])} (from the file's hyper-parameters)")
        if not o.dense[i] and not self.ollama and self.experts[i].selection_bias is None:
            raise ModelError(f"{source}: model is missing required tensor blk.{i}.exp_probs_b.bias")

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o = self.options
        if o.swa[layer]:
            return x.rope(positions, o.rope_dims_swa, o.rope_base_swa, o.rope_scale_swa, None, self.swa_rope)
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, None, self.full_rope)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def self_attention(self, ctx: Context, layer: Layer, x: Tensor, positions: Tensor, i: int) -> Tensor:
        """Gated attention over the cache for the normed hidden states x: (head_dim * heads, n), before
        attn_output."""
        o, n, heads = self.options, x.ne[1], self.options.heads[i]
        q = layer.attn_q.matmul(x).reshape(o.head_dim, heads, n).set_name(f"Qcur-{i}")
        k = layer.attn_k.matmul(x).reshape(o.head_dim, o.kv_heads, n).set_name(f"Kcur-{i}")
        v = layer.attn_v.matmul(x).reshape(o.head_dim, o.kv_heads, n).set_name(f"Vcur-{i}")
        gate = layer.attn_gate.matmul(x).set_name(f"attn_gate_proj-{i}")
        q = q.rms_norm(layer.attn_q_norm, o.eps).set_name(f"Qcur_normed-{i}")
        k = k.rms_norm(layer.attn_k_norm, o.eps).set_name(f"Kcur_normed-{i}")
        q = self.rope(q, positions, i).set_name(f"Qcur_rope-{i}")
        k = self.rope(k, positions, i).set_name(f"Kcur_rope-{i}")
        if isinstance(self.cache, Wrapper):
            self.cache.set_layer_type(SWA if o.swa[i] else FULL)
        out = attention(ctx, q, k, v, 1.0 / math.sqrt(o.head_dim), self.cache)
        out = out.reshape(o.head_dim * heads, n).set_name(f"attn_out-{i}")
        gate = gate.softplus().set_name(f"attn_gate_softplus-{i}")
        if gate.ne[0] == heads:  # one value per head, broadcast over its features
            out = out.reshape(o.head_dim, heads, n).mul(gate.reshape(1, heads, n)).reshape(o.head_dim * heads, n)
        else:
            out = out.mul(gate)
        return out.set_name(f"attn_gated-{i}")

    def feed_forward(self, layer: Layer, x: Tensor, i: int) -> Tensor:
        if self.options.dense[i]:
            return _swiglu(x, layer.ffn_gate, layer.ffn_up, layer.ffn_down, i)
        out = moe(x, self.experts[i], self.routing, i, rows=self._rows if self.rows_alone else ())
        shared = _swiglu(x, layer.ffn_gate_shexp, layer.ffn_up_shexp, layer.ffn_down_shexp, i)
        return out.add(shared.set_name(f"ffn_shexp-{i}"))

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        if batch.tokens is None:
            raise ValueError("a text model's batch needs token ids")
        o = self.options
        self._rows = sequence_rows(batch.sequences)  # the graph is reused only for batches of this layout
        inputs = ctx.input()
        positions = inputs.from_numpy(batch.positions).set_name("positions")
        h = self.weights.token_embd.rows(inputs.from_numpy(batch.tokens).set_name("tokens")).set_name("embd")
        outputs = inputs.from_numpy(batch.outputs).set_name("outputs") if len(batch.outputs) else None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            x = self.self_attention(ctx, layer, h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}"),
                                    positions, i)
            x = layer.attn_output.matmul(x).set_name(f"attn_o_proj-{i}")
            if i == last:
                if outputs is None:
                    return None  # the cache holds the keys and values; nothing else is wanted
                x, h = x.rows(outputs), h.rows(outputs)
                self._rows = sequence_rows(batch.sequences[batch.outputs])
            h = x.add(h).set_name(f"ffn_inp-{i}")
            x = self.feed_forward(layer, h.rms_norm(layer.ffn_norm, o.eps).set_name(f"ffn_norm-{i}"), i)
            h = x.set_name(f"ffn_out-{i}").add(h).set_name(f"l_out-{i}")
        h = h.rms_norm(self.weights.output_norm, o.eps).set_name("result_norm")
        return self.weights.output.matmul(h).set_name("result_output")


def _swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, i: int) -> Tensor:
    """down(silu(gate x) * up x), named as llama.cpp's build_ffn names it (the shared expert too)."""
    u = up.matmul(x).set_name(f"ffn_up-{i}")
    g = gate.matmul(x).set_name(f"ffn_gate-{i}")
    return down.matmul(g.silu(u).set_name(f"ffn_swiglu-{i}"))
