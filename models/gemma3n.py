"""Gemma 3n (the text model): Gemma 3's attention inside AltUp, with per-layer embeddings, Laurel, activation
sparsity and keys and values shared across the last layers.

As llama.cpp's gemma3n graph (src/models/gemma3n.cpp), in its order of operations:
- The hidden state is n_altup (4) streams (n_embd, n, 4): the scaled token embedding and three projections of
  it (altup_proj), each rescaled to the embedding's magnitude. Only stream 0, the active one, goes through
  attention and the FFN; AltUp predicts every stream from all of them before the layer (coefficients from a
  router on stream 0) and corrects them by the layer's innovation after it.
- Per-layer embeddings: a second token table (per_layer_token_embd, n_embd_altup values per layer) plus a
  projection of the embedding, RMS-normalised; layer i gates stream 0 with its slice and adds the result to
  the other streams.
- Laurel: a rank-64 residual branch (laurel_l, laurel_r, a norm) beside attention; both are averaged (1/sqrt 2).
- Activation sparsity: in the first layers (activation_sparsity_scale > 0; llama.cpp: the first 10) the FFN's
  gate keeps only what exceeds mean + k * std (sample std) of its row: a Gaussian top-k.
- Attention: q, k per-head RMS-normalised, v RMS-normalised without a weight, NeoX RoPE, scale 1. Sliding
  layers use rope.freq_base_swa (Ollama's files: rope.freq_base_local) unscaled; global ones rope.freq_base.
- KV sharing: layers from block_count - attention.shared_kv_layers on (llama.cpp: from 20) store nothing and
  attend over the keys and values of the last storing layer of their kind (sliding: the one before the last,
  global: the last), as llama.cpp's cache reuses them; their attn_k and attn_v are never read or allocated.
- Output: the streams merged (streams 1.. through altup_unembd_proj, rescaled, averaged with stream 0), the
  rows that want logits kept, output_norm, the tied output, logits soft-capped at 30 (llama.cpp's default;
  final_logit_softcapping where the file sets it).
Scalar factors are computed in float32 as llama.cpp's C computes them, so that the graphs round alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch, attention
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, require_uint, weight
from .layers import f32_reciprocal_sqrt, head, heads
from .sliding import GLOBAL, SWA, check_window, sliding_cache, swa_layers

KV_LAYERS = 20  # llama.cpp's n_layer_kv_from_start for gemma3n files without attention.shared_kv_layers
SPARSE_LAYERS = 10  # llama.cpp's n_layer_sparsity, for files without activation_sparsity_scale
SPARSITY_STD_MUL = 1.6448533535003662  # the normal distribution's 0.95 quantile, as llama.cpp's float


def f32(x: float) -> float:
    """x rounded to float32, the precision llama.cpp computes its scalar factors in."""
    return float(np.float32(x))


@dataclass
class Weights:
    token_embd: Tensor = weight("token_embd.weight")
    per_layer_token_embd: Tensor = weight("per_layer_token_embd.weight")  # (n_embd_altup * layers, vocab)
    per_layer_model_proj: Tensor = weight("per_layer_model_proj.weight")  # n_embd -> n_embd_altup * layers
    per_layer_proj_norm: Tensor = weight("per_layer_proj_norm.weight")
    altup_proj: Tensor = weight("altup_proj.weight")  # (n_embd, n_embd, n_altup - 1)
    altup_unembd_proj: Tensor = weight("altup_unembd_proj.weight")
    output_norm: Tensor = weight("output_norm.weight")
    output: Tensor = weight("output.weight")


@dataclass
class Layer:
    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor | None = weight("attn_k.weight", optional=True)  # None in layers that share keys
    attn_v: Tensor | None = weight("attn_v.weight", optional=True)
    attn_q_norm: Tensor = weight("attn_q_norm.weight")
    attn_k_norm: Tensor = weight("attn_k_norm.weight")
    attn_output: Tensor = weight("attn_output.weight")
    post_attention_norm: Tensor = weight("post_attention_norm.weight")
    ffn_norm: Tensor = weight("ffn_norm.weight")
    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")
    post_ffw_norm: Tensor = weight("post_ffw_norm.weight")
    inp_gate: Tensor = weight("inp_gate.weight")  # n_embd -> n_embd_altup
    proj: Tensor = weight("proj.weight")  # n_embd_altup -> n_embd
    post_norm: Tensor = weight("post_norm.weight")
    altup_correct_coef: Tensor = weight("altup_correct_coef.weight")  # (n_altup, n_altup)
    altup_correct_scale: Tensor = weight("altup_correct_scale.weight")
    altup_predict_coef: Tensor = weight("altup_predict_coef.weight")  # (n_altup, n_altup^2)
    altup_router: Tensor = weight("altup_router.weight")  # n_embd -> n_altup
    altup_router_norm: Tensor = weight("altup_router_norm.weight")
    laurel_l: Tensor = weight("laurel_l.weight")
    laurel_r: Tensor = weight("laurel_r.weight")
    laurel_post_norm: Tensor = weight("laurel_post_norm.weight")


@dataclass(frozen=True)
class Options:
    """Hyper-parameters, with llama.cpp's values (Ollama's keys) where a key is absent."""

    blocks: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    per_layer: int  # n_embd_altup: each layer's share of the per-layer embedding
    altup: int  # streams
    kv_layers: int  # the layers before this one store keys and values; later ones reuse them
    swa: tuple[bool, ...]
    window: int
    sparsity: tuple[float, ...]  # per layer: the std multiplier of the Gaussian top-k, 0 for none
    eps: float
    rope_base: float
    rope_scale: float
    rope_base_swa: float
    final_softcap: float
    correct_scale: bool  # Ollama's altup.correct_scale (always true in Gemma 3n; llama.cpp always scales)

    @classmethod
    def from_config(cls, config: Config) -> Options:
        blocks = require_uint(config, "block_count")
        hidden = require_uint(config, "embedding_length")
        heads = require_uint(config, "attention.head_count")
        kv_heads = config.get_uint("attention.head_count_kv", heads)
        if heads == 0 or kv_heads == 0 or heads % kv_heads:
            raise ModelError(f"gemma3n: attention.head_count {heads} must be a positive multiple of head_count_kv "
                             f"{kv_heads}")
        head_dim = config.get_uint("attention.key_length", config.get_uint("head_dim", hidden // heads))
        if head_dim == 0 or head_dim % 2:
            raise ModelError(f"gemma3n: the head size must be even and positive, got {head_dim}")
        altup = config.get_uint("altup.num_inputs", 4)
        if altup < 2:
            raise ModelError(f"gemma3n: altup.num_inputs must be at least 2, got {altup}")
        if config.get_uint("altup.active_idx", 0) != 0:  # llama.cpp's graph also assumes stream 0
            raise ModelError(f"gemma3n: altup.active_idx {config.value('altup.active_idx')} is not supported (0)")
        shared = config.get_uint("attention.shared_kv_layers", max(blocks - KV_LAYERS, 0))
        if shared > blocks:
            raise ModelError(f"gemma3n: attention.shared_kv_layers {shared} exceeds block_count {blocks}")
        window = config.get_uint("attention.sliding_window", 0)
        swa = swa_layers(config, blocks, 5) if window else (False,) * blocks  # llama.cpp's: every 5th global
        check_window(window, swa)
        kv_layers = blocks - shared
        if shared and (kv_layers < 2 or not swa[kv_layers - 2] or swa[kv_layers - 1]):
            raise ModelError(f"gemma3n: layers {kv_layers} on share the keys of layers {kv_layers - 2} (sliding) "
                             f"and {kv_layers - 1} (global), which the sliding-window pattern does not make so")
        factor = config.get_float("rope.scaling.factor", 0.0)
        return cls(
            blocks=blocks, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            per_layer=config.get_uint("embedding_length_per_layer_input", 256), altup=altup, kv_layers=kv_layers,
            swa=swa, window=window, sparsity=sparsity(config, blocks),
            eps=config.get_float("attention.layer_norm_rms_epsilon", 1e-6),
            rope_base=config.get_float("rope.freq_base", 1000000.0),
            rope_scale=1.0 / factor if factor else 1.0,
            rope_base_swa=config.get_float("rope.freq_base_swa", config.get_float("rope.freq_base_local", 10000.0)),
            final_softcap=config.get_float("final_logit_softcapping", 30.0),
            correct_scale=config.get_bool("altup.correct_scale", True),
        )


def sparsity(config: Config, blocks: int) -> tuple[float, ...]:
    """Each layer's Gaussian top-k multiplier: activation_sparsity_scale (the converters write the normal
    quantile of the sparsity, -inf for none), else llama.cpp's 0.95 quantile in the first 10 layers."""
    scales = config.value("activation_sparsity_scale")
    if scales is None:
        return tuple(SPARSITY_STD_MUL if i < SPARSE_LAYERS else 0.0 for i in range(blocks))
    if not isinstance(scales, list) or len(scales) != blocks or not all(isinstance(s, float) for s in scales):
        raise ModelError(f"gemma3n: activation_sparsity_scale must be {blocks} floats, one per layer")
    return tuple(f32(s) if math.isfinite(s) and s > 0 else 0.0 for s in scales)


@register("gemma3n")
class Gemma3n(Model):
    reuse_graphs = True
    rope_options = RopeOptions(neox=True)
    tensor_groups = Model.tensor_groups.extended(  # AltUp's and the per-layer embeddings' (as Ollama places them)
        outputs=("altup_proj", "altup_unembd_proj", "per_layer_token_embd", "per_layer_model_proj",
                 "per_layer_proj_norm"),
        by_row=("per_layer_token_embd.weight",))

    @classmethod
    def unused_tensors(cls, config: Config) -> Callable[[str], bool]:
        """Also the keys' and values' projections of the layers that share an earlier layer's."""
        towers = super().unused_tensors(config)
        o = Options.from_config(config)
        shared = {f"blk.{i}.attn_{kv}.weight" for i in range(o.kv_layers, o.blocks) for kv in "kv"}
        return lambda name: towers(name) or name in shared

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.options = o = Options.from_config(self.config)
        self.weights = w = bind(Weights, backend)
        self.layers = [bind(Layer, backend, f"blk.{i}.") for i in range(o.blocks)]
        self._check_shapes(w)
        self.cache = sliding_cache(self.shift, o.window)

    def _check_shapes(self, w: Weights) -> None:
        """The shapes the graph's reshapes and views rely on, named in a clear error where a file has others."""
        o = self.options
        expected = {
            "per_layer_token_embd.weight": (w.per_layer_token_embd, (o.per_layer * o.blocks,)),
            "per_layer_model_proj.weight": (w.per_layer_model_proj, (o.hidden, o.per_layer * o.blocks)),
            "altup_proj.weight": (w.altup_proj, (o.hidden, o.hidden, o.altup - 1)),
            "altup_unembd_proj.weight": (w.altup_unembd_proj, (o.hidden, o.hidden, o.altup - 1)),
        }
        for i, layer in enumerate(self.layers):
            expected[f"blk.{i}.altup_predict_coef.weight"] = (layer.altup_predict_coef, (o.altup, o.altup * o.altup))
            expected[f"blk.{i}.altup_correct_coef.weight"] = (layer.altup_correct_coef, (o.altup, o.altup))
            expected[f"blk.{i}.inp_gate.weight"] = (layer.inp_gate, (o.hidden, o.per_layer))
            if i < o.kv_layers and (layer.attn_k is None or layer.attn_v is None):
                raise ModelError(f"{self.backend.model.path}: model is missing required tensor blk.{i}.attn_k/v")
        for name, (tensor, shape) in expected.items():
            if tuple(tensor.shape[:len(shape)]) != shape:
                raise ModelError(f"{self.backend.model.path}: tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {shape}")

    # ------------------------------------------------------------ attention

    def rope(self, x: Tensor, positions: Tensor, layer: int) -> Tensor:
        o = self.options
        base, scale = (o.rope_base_swa, 1.0) if o.swa[layer] else (o.rope_base, o.rope_scale)
        return x.rope(positions, o.head_dim, base, scale, None, self.rope_options)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def self_attention(self, ctx: Context, layer: Layer, x: Tensor, positions: Tensor, i: int) -> Tensor:
        """Attention of layer i over its cache (or over the layer's it shares), after attn_output."""
        o, n = self.options, x.ne[1]
        self.cache.set_layer_type(SWA if o.swa[i] else GLOBAL)
        q = heads(x, layer.attn_q, None, o.head_dim, o.heads).rms_norm(layer.attn_q_norm, o.eps)
        q = self.rope(q.set_name(f"Qcur_normed-{i}"), positions, i).set_name(f"Qcur_pos-{i}")
        k = v = None
        if i < o.kv_layers:
            self.cache.set_layer(i)
            k = heads(x, layer.attn_k, None, o.head_dim, o.kv_heads).rms_norm(layer.attn_k_norm, o.eps)
            v = heads(x, layer.attn_v, None, o.head_dim, o.kv_heads).rms_norm(None, o.eps)
            k = self.rope(k.set_name(f"Kcur_normed-{i}"), positions, i).set_name(f"Kcur_pos-{i}")
            v.set_name(f"Vcur_normed-{i}")
        else:  # the last storing layer of its kind: the one before the last is sliding, the last global
            self.cache.set_layer(o.kv_layers - (2 if o.swa[i] else 1))
        x = attention(ctx, q, k, v, 1.0, self.cache)
        x = x.reshape(o.head_dim * o.heads, n).set_name(f"kqv_out-{i}")
        return layer.attn_output.matmul(x)

    # ------------------------------------------------------------ AltUp, Laurel, sparsity

    @staticmethod
    def magnitude(x: Tensor) -> Tensor:
        """Each row's L2 norm."""
        return x.sqr().sum_rows().sqrt()

    @staticmethod
    def stream(x: Tensor, index: int) -> Tensor:
        """Stream `index` (n_embd, n) of the streams x (n_embd, n, n_altup)."""
        return x.view(index * x.strides[2], (x.ne[0], x.ne[1]))

    @staticmethod
    def later_streams(x: Tensor) -> Tensor:
        """Streams 1.. (n_embd, n, n_altup - 1) of x."""
        return x.view(x.strides[2], (x.ne[0], x.ne[1], x.ne[2] - 1))

    def rescaled(self, x: Tensor, target: Tensor) -> Tensor:
        """x with each row scaled to the magnitude `target` has: x * target / |x|."""
        return x.mul(target).div(self.magnitude(x))

    def modalities(self, layer: Layer, x: Tensor) -> Tensor:
        """AltUp's router: tanh(altup_router(rms_norm(x) / n_embd)), (n_altup, n)."""
        o = self.options
        x = x.rms_norm(layer.altup_router_norm, o.eps).scale(f32(1.0 / f32(o.hidden)))
        return layer.altup_router.matmul(x).tanh()

    def predict(self, layer: Layer, streams: Tensor, i: int) -> Tensor:
        """Every stream predicted as a mix of all of them, coefficients from the active stream."""
        a, n = self.options.altup, streams.ne[1]
        coefficients = layer.altup_predict_coef.matmul(self.modalities(layer, self.stream(streams, 0)))
        coefficients = coefficients.reshape(a, a, n)
        mixed = streams.permute(1, 2, 0, 3).contiguous().matmul(coefficients)  # (n_embd, n_altup, n)
        return mixed.permute(0, 2, 1, 3).contiguous().add(streams).set_name(f"predictions-{i}")

    def correct(self, layer: Layer, predictions: Tensor, activated: Tensor, i: int) -> Tensor:
        """Every prediction moved by the active stream's innovation, weighted per stream from the router."""
        e, n, a = predictions.ne[0], predictions.ne[1], self.options.altup
        coefficients = layer.altup_correct_coef.matmul(self.modalities(layer, activated)).scale(1.0, 1.0)
        coefficients = coefficients.transpose().contiguous(1, n, a)
        innovation = activated.sub(self.stream(predictions, 0)).set_name(f"innovation-{i}")
        corrected = innovation.repeat_to(e, n, a).mul(coefficients).add(predictions)
        return corrected.set_name(f"corrected-{i}")

    def laurel(self, layer: Layer, x: Tensor, i: int) -> Tensor:
        """The low-rank residual branch beside attention."""
        y = layer.laurel_r.matmul(layer.laurel_l.matmul(x)).rms_norm(layer.laurel_post_norm, self.options.eps)
        return y.add(x).set_name(f"laurel_out-{i}")

    @staticmethod
    def gaussian_top_k(x: Tensor, multiplier: float) -> Tensor:
        """x minus (its row's mean + multiplier * sample std), negatives cut to 0."""
        mean = x.mean()
        std = x.sub(mean).sqr().sum_rows().scale(f32(1.0 / f32(x.ne[0] - 1))).sqrt()
        return x.sub(mean.add(std.scale(multiplier))).relu()

    def feed_forward(self, layer: Layer, x: Tensor, i: int) -> Tensor:
        up = layer.ffn_up.matmul(x)
        gate = layer.ffn_gate.matmul(x)
        if self.options.sparsity[i]:
            gate = self.gaussian_top_k(gate, self.options.sparsity[i])
        return layer.ffn_down.matmul(up.mul(gate.gelu()))

    def per_layer_inputs(self, h: Tensor, tokens: Tensor) -> Tensor:
        """Each layer's per-layer input (n_embd_altup, n, layers): its token embedding slice plus the projected
        embedding h, RMS-normalised, averaged (1/sqrt 2)."""
        o, w, n = self.options, self.weights, h.ne[1]
        embedded = w.per_layer_token_embd.rows(tokens).reshape(o.per_layer, o.blocks, n)
        embedded = embedded.scale(f32(np.sqrt(np.float32(o.per_layer)))).set_name("inp_per_layer_selected")
        projected = w.per_layer_model_proj.matmul(h).scale(f32_reciprocal_sqrt(o.hidden))
        projected = projected.reshape(o.per_layer, o.blocks, n).rms_norm(w.per_layer_proj_norm, o.eps)
        inputs = projected.set_name("per_layer_proj").add(embedded).scale(f32_reciprocal_sqrt(2.0))
        return inputs.set_name("inp_per_layer").permute(0, 2, 1, 3).contiguous()

    def stacked(self, h: Tensor) -> Tensor:
        """The n_altup streams (n_embd, n, n_altup): h, then its projections rescaled to h's magnitude."""
        o = self.options
        added = self.weights.altup_proj.matmul(h.repeat_to(o.hidden, h.ne[1], o.altup - 1))
        return h.concat(self.rescaled(added, self.magnitude(h)), 2).set_name("inp_stacked")

    def merged(self, streams: Tensor) -> Tensor:
        """The streams back to one (n_embd, n): streams 1.. unembedded and rescaled, averaged with stream 0."""
        o = self.options
        target = self.magnitude(self.stream(streams, 0))
        unembedded = self.weights.altup_unembd_proj.matmul(self.later_streams(streams))
        unembedded = self.rescaled(unembedded, target).set_name("altup_unembd")
        h = self.stream(streams, 0)
        for s in range(o.altup - 1):
            h = h.add(self.stream(unembedded, s))
        return h.scale(f32(1.0 / f32(o.altup))).set_name("unembd_merged")

    # ------------------------------------------------------------ the layers

    def layer(self, ctx: Context, i: int, streams: Tensor, per_layer: Tensor, positions: Tensor) -> Tensor:
        o, layer = self.options, self.layers[i]
        predictions = self.predict(layer, streams, i)
        active = self.stream(predictions, 0)
        x = active.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}")
        laurel = self.laurel(layer, x, i)
        x = self.self_attention(ctx, layer, x, positions, i)
        x = x.rms_norm(layer.post_attention_norm, o.eps).set_name(f"attn_post_norm-{i}")
        x = x.add(active).set_name(f"attn_gated-{i}")
        attn_laurel = x.add(laurel).scale(f32_reciprocal_sqrt(2.0)).set_name(f"attn_laurel-{i}")
        x = attn_laurel.rms_norm(layer.ffn_norm, o.eps).set_name(f"ffn_norm-{i}")
        x = self.feed_forward(layer, x, i).set_name(f"ffn_out-{i}")
        x = x.rms_norm(layer.post_ffw_norm, o.eps).set_name(f"ffn_post_norm-{i}")
        x = x.add(attn_laurel).set_name(f"attn_ffw_laurel_gated-{i}")
        corrected = self.correct(layer, predictions, x, i)

        first = self.stream(corrected, 0)
        if o.correct_scale:
            first = first.mul(layer.altup_correct_scale)
        first = layer.inp_gate.matmul(first).gelu().set_name(f"first_prediction_gated-{i}")
        first = first.mul(self.stream(per_layer, i)).set_name(f"first_prediction_scaled-{i}")
        first = layer.proj.matmul(first).rms_norm(layer.post_norm, o.eps).set_name(f"first_prediction_out-{i}")
        rest = self.later_streams(corrected).add(first)
        return self.stream(corrected, 0).concat(rest, 2).set_name(f"l_out-{i}")

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        if batch.tokens is None:
            raise ValueError("a text model's batch needs token ids")
        o, w = self.options, self.weights
        inputs = ctx.input()
        positions = inputs.from_numpy(batch.positions).set_name("positions")
        tokens = inputs.from_numpy(batch.tokens).set_name("tokens")
        h = w.token_embd.rows(tokens).scale(f32(np.sqrt(np.float32(o.hidden)))).set_name("inp_scaled")
        per_layer = self.per_layer_inputs(h, tokens)
        streams = self.stacked(h)
        # a batch without outputs only stores keys and values: the layers that share them have nothing to do
        last = o.blocks if len(batch.outputs) else o.kv_layers
        for i in range(last):
            streams = self.layer(ctx, i, streams, per_layer, positions)
        if not len(batch.outputs):
            return None
        h = self.merged(streams).rows(inputs.from_numpy(batch.outputs).set_name("outputs"))
        return head(h, w.output_norm, w.output, o.eps, o.final_softcap)
