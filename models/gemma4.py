"""Gemma 4 (the text model; its vision and audio towers are skipped as gemma3's are), as llama.cpp's gemma4.

What it adds to Gemma 3, per llama.cpp's src/models/gemma4.cpp:
- sliding and global layers by one flag per layer (attention.sliding_window_pattern, an array), each kind
  with its own head size (attention.key_length_swa / key_length), KV heads (head_count_kv may be an array),
  rotary dims (rope.dimension_count_swa / dimension_count) and RoPE base (rope.freq_base_swa / freq_base);
  the global layers' RoPE is "proportional": rope_freqs.weight holds 1 for the rotated pairs and 1e30 for
  the others, so that a quarter of the head turns;
- no query scaling (attention scale 1: the query and key RMS norms do it), and the value RMS-normalised
  without a weight; a layer without attn_v uses its key projection as value (before the key's norm);
- KV sharing: the last attention.shared_kv_layers layers store no keys or values and attend to those of
  the last storing layer of their kind (llama.cpp: n - 2 for sliding, n - 1 for global, n being the first
  shared layer; the same layers in every Gemma 4, whose storing layers end sliding, global);
- per-layer embeddings when embedding_length_per_layer_input > 0: each token has its own small vector per
  layer (per_layer_token_embd), mixed with a projection of its embedding, that gates a GELU bottleneck
  added after every layer's FFN;
- a learned scalar per layer output (layer_output_scale), and final logits soft-capped when the file says;
- mixture-of-experts layers (ffn_gate_inp: the 26B-A4B model) beside the dense FFN: GELU experts (2 of
  expert_count, softmax routing, weights normalised) on their own pre-norm, routed on the residual's
  unweighted RMS norm scaled by 1/sqrt(hidden) and a learned vector (ffn_gate_inp.scale), each expert's
  output scaled by its own factor (ffn_down_exps.scale); the dense FFN and the experts each post-normed,
  added, then post-normed again. gate and up may be one stack (ffn_gate_up_exps, gate in each row's
  first half), as llama.cpp and Ollama's converter write it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch, Causal, Wrapper, attention
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor
from ollama_engine.tokenizer import Tokenizer

from .alone import sequence_rows
from .base import Model, ModelError, bind, register, require_uint, weight
from .moe import Experts, Gating, Routing, bind_experts, moe

SWA, GLOBAL = 0, 1  # the Wrapper's caches, by layer type
NEOX = RopeOptions(neox=True)


@dataclass
class Weights:
    token_embd: Tensor = weight("token_embd.weight")
    output_norm: Tensor = weight("output_norm.weight")
    output: Tensor = weight("output.weight")
    per_layer_token_embd: Tensor | None = weight("per_layer_token_embd.weight", optional=True)
    per_layer_model_proj: Tensor | None = weight("per_layer_model_proj.weight", optional=True)
    per_layer_proj_norm: Tensor | None = weight("per_layer_proj_norm.weight", optional=True)


@dataclass
class Layer:
    attn_norm: Tensor = weight("attn_norm.weight")
    attn_q: Tensor = weight("attn_q.weight")
    attn_k: Tensor | None = weight("attn_k.weight", optional=True)  # absent in shared-KV layers
    attn_v: Tensor | None = weight("attn_v.weight", optional=True)  # absent: the key projection is the value
    attn_output: Tensor = weight("attn_output.weight")
    attn_q_norm: Tensor = weight("attn_q_norm.weight")
    attn_k_norm: Tensor | None = weight("attn_k_norm.weight", optional=True)
    post_attention_norm: Tensor = weight("post_attention_norm.weight")
    rope_freqs: Tensor | None = weight("rope_freqs.weight", optional=True)  # the global layers' proportional RoPE
    ffn_norm: Tensor = weight("ffn_norm.weight")
    ffn_gate: Tensor = weight("ffn_gate.weight")
    ffn_up: Tensor = weight("ffn_up.weight")
    ffn_down: Tensor = weight("ffn_down.weight")
    post_ffw_norm: Tensor = weight("post_ffw_norm.weight")
    layer_output_scale: Tensor | None = weight("layer_output_scale.weight", optional=True)
    inp_gate: Tensor | None = weight("inp_gate.weight", optional=True)  # per-layer embeddings
    proj: Tensor | None = weight("proj.weight", optional=True)
    post_norm: Tensor | None = weight("post_norm.weight", optional=True)
    ffn_gate_inp: Tensor | None = weight("ffn_gate_inp.weight", optional=True)  # a mixture beside the FFN
    ffn_gate_inp_scale: Tensor | None = weight("ffn_gate_inp.scale", optional=True)
    pre_ffw_norm_2: Tensor | None = weight("pre_ffw_norm_2.weight", optional=True)
    post_ffw_norm_1: Tensor | None = weight("post_ffw_norm_1.weight", optional=True)
    post_ffw_norm_2: Tensor | None = weight("post_ffw_norm_2.weight", optional=True)


def per_layer(config: Config, key: str, blocks: int, default: int) -> list[int]:
    """llama.cpp's get_key_or_arr: one number for every layer, or an array of one entry per layer."""
    value = config.value(key)
    if isinstance(value, list):
        if len(value) != blocks or not all(isinstance(v, int) and v >= 0 for v in value):
            raise ModelError(f"{config.full_key(key)} must hold {blocks} non-negative integers, got {value!r}")
        return list(value)
    return [config.get_uint(key, default)] * blocks


def f32_sqrt(x: float) -> float:
    """sqrtf(x), as llama.cpp computes its scale factors."""
    return float(np.sqrt(np.float32(x)))


def f32_reciprocal(x: float) -> float:
    """1.0f / x in float32 arithmetic."""
    return float(np.float32(1) / np.float32(x))


@dataclass(frozen=True)
class Options:
    """Hyper-parameters, read as llama.cpp's gemma4 loader reads them (its defaults where a key is absent)."""

    blocks: int
    hidden: int
    heads: list[int]
    kv_heads: list[int]
    head_dim: list[int]  # per layer: key_length_swa for sliding layers, key_length for global ones
    rope_dims: list[int]
    rope_base: list[float]
    rope_scale: list[float]
    swa: tuple[bool, ...]
    window: int  # llama.cpp's n_swa: a sliding layer sees this many positions, its own included
    donors: dict[int, int]  # shared-KV layer -> the layer whose keys and values it reads
    per_layer_dim: int  # embedding_length_per_layer_input; 0: no per-layer embeddings
    eps: float
    final_softcap: float

    @classmethod
    def from_config(cls, c: Config) -> Options:
        blocks = require_uint(c, "block_count")
        hidden = require_uint(c, "embedding_length")
        flags = c.value("attention.sliding_window_pattern")
        if not isinstance(flags, list) or len(flags) != blocks:
            raise ModelError(f"gemma4: attention.sliding_window_pattern must be one flag per layer ({blocks}), "
                             f"got {flags!r}")
        swa = tuple(bool(f) for f in flags)
        window = require_uint(c, "attention.sliding_window")
        if any(swa) and not 2 <= window <= 2**31 - 1:
            raise ModelError(f"attention.sliding_window must be in 2..{2**31 - 1}, got {window}")
        heads = per_layer(c, "attention.head_count", blocks, 0)
        kv_heads = per_layer(c, "attention.head_count_kv", blocks, 0) if "attention.head_count_kv" in c else heads
        full_dim = c.get_uint("attention.key_length", hidden // heads[0] if heads[0] else 0)
        swa_dim = c.get_uint("attention.key_length_swa", full_dim)
        for key, (k, v) in {"": (full_dim, c.get_uint("attention.value_length", full_dim)),
                            "_swa": (swa_dim, c.get_uint("attention.value_length_swa", swa_dim))}.items():
            if k != v:
                raise ModelError(f"gemma4: attention.key_length{key} {k} must equal value_length{key} {v}")
        full_rot = c.get_uint("rope.dimension_count", full_dim)
        swa_rot = c.get_uint("rope.dimension_count_swa", full_rot)
        head_dim = [swa_dim if s else full_dim for s in swa]
        rope_dims = [swa_rot if s else full_rot for s in swa]
        for i in range(blocks):
            if not heads[i] or not kv_heads[i] or heads[i] % kv_heads[i] or not head_dim[i]:
                raise ModelError(f"gemma4: layer {i} has {heads[i]} heads of {head_dim[i]} and {kv_heads[i]} KV "
                                 "heads: heads must be a positive multiple of KV heads, of a positive size")
            if not 0 < rope_dims[i] <= head_dim[i] or rope_dims[i] % 2:
                raise ModelError(f"gemma4: layer {i} rotates {rope_dims[i]} dims of a head of {head_dim[i]}: "
                                 "they must be even and in 2..head size")
        factor = c.get_float("rope.scaling.factor", 0.0)
        base, base_swa = c.get_float("rope.freq_base", 10000.0), c.get_float("rope.freq_base_swa", 10000.0)
        return cls(
            blocks=blocks,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            rope_dims=rope_dims,
            rope_base=[base_swa if s else base for s in swa],
            rope_scale=[1.0 if s or not factor else 1.0 / factor for s in swa],
            swa=swa,
            window=window,
            donors=kv_donors(swa, c.get_uint("attention.shared_kv_layers", 0)),
            per_layer_dim=c.get_uint("embedding_length_per_layer_input", 0),
            eps=c.get_float("attention.layer_norm_rms_epsilon", 1e-6),
            final_softcap=c.get_float("final_logit_softcapping", 0.0),
        )


def kv_donors(swa: tuple[bool, ...], shared: int) -> dict[int, int]:
    """Each shared layer's donor: the last layer before the shared ones of its kind (sliding or global), as
    Ollama's gemma4 picks it. llama.cpp's reuse callback takes n - 2 for a sliding layer and n - 1 for a
    global one (n: the first shared layer), the same layers wherever its choice has the right head size."""
    first = len(swa) - shared
    if shared > len(swa):
        raise ModelError(f"gemma4: attention.shared_kv_layers {shared} exceeds the {len(swa)} layers")
    donors = {}
    for layer in range(first, len(swa)):
        kind = [i for i in range(first) if swa[i] == swa[layer]]
        if not kind:
            raise ModelError(f"gemma4: shared layer {layer} ({'sliding' if swa[layer] else 'global'}) has no "
                             "earlier layer of its kind to read keys and values from")
        donors[layer] = kind[-1]
    return donors


@register("gemma4")
class Gemma4(Model):
    reuse_graphs = True
    tensor_groups = Model.tensor_groups.extended(  # the per-layer embeddings' (as Ollama places them)
        outputs=("per_layer_token_embd", "per_layer_model_proj", "per_layer_proj_norm"),
        by_row=("per_layer_token_embd.weight",))

    @classmethod
    def unused_tensors(cls, config: Config) -> Callable[[str], bool]:
        """The vision (v., mm.) and audio (a.) towers Ollama stores beside the text model."""
        return lambda name: name.startswith(("v.", "mm.", "a."))

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.options = o = Options.from_config(self.config)
        self.weights = w = bind(Weights, backend)
        self.layers = [bind(Layer, backend, f"blk.{i}.") for i in range(o.blocks)]
        mixture = any(layer.ffn_gate_inp is not None for layer in self.layers)
        self.routing = Routing.from_config(self.config, Gating.SOFTMAX, normalize=True) if mixture else None
        self.experts: list[Experts | None] = [None] * o.blocks
        for i, layer in enumerate(self.layers):
            if layer.ffn_gate_inp is not None:
                self.experts[i] = bind_experts(backend, i, self.routing, o.hidden)
                for name in ("ffn_gate_inp_scale", "pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                    if getattr(layer, name) is None:
                        tensor = name.replace("_scale", ".scale") if name.endswith("_scale") else f"{name}.weight"
                        raise ModelError(f"model is missing required tensor blk.{i}.{tensor} (a mixture layer)")
            if i not in o.donors and (layer.attn_k is None or layer.attn_k_norm is None):
                raise ModelError(f"model is missing required tensor blk.{i}.attn_k.weight or attn_k_norm.weight")
            if not o.swa[i] and layer.rope_freqs is None:
                raise ModelError("model is missing required tensor rope_freqs.weight (the global layers' RoPE)")
        if o.per_layer_dim:
            missing = [name for name, t in (("per_layer_token_embd", w.per_layer_token_embd),
                                            ("per_layer_model_proj", w.per_layer_model_proj),
                                            ("per_layer_proj_norm", w.per_layer_proj_norm)) if t is None]
            missing += [f"blk.{i}.{name}" for i, layer in enumerate(self.layers)
                        for name in ("inp_gate", "proj", "post_norm") if getattr(layer, name) is None]
            if missing:
                raise ModelError(f"model is missing required tensor {missing[0]}.weight (per-layer embeddings)")
        # Causal's window counts the positions before a token; llama.cpp's n_swa includes the token
        self.cache = Wrapper(Causal(self.shift, window_size=max(o.window - 1, 1)), Causal(self.shift))

    def rope(self, x: Tensor, positions: Tensor, i: int) -> Tensor:
        o = self.options
        factors = None if o.swa[i] else self.layers[i].rope_freqs
        return x.rope(positions, o.rope_dims[i], o.rope_base[i], o.rope_scale[i], factors, NEOX)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        return self.rope(key, delta, layer)

    def per_layer_inputs(self, tokens: Tensor, embedded: Tensor) -> Tensor:
        """Every layer's per-layer input (per_layer_dim, n, blocks): the tokens' own per-layer embeddings
        plus a normed projection of their (scaled) embeddings, over sqrt(2)."""
        o, w = self.options, self.weights
        d, n = o.per_layer_dim, embedded.ne[1]
        own = w.per_layer_token_embd.rows(tokens).reshape(d, o.blocks, n).scale(f32_sqrt(d))
        projected = w.per_layer_model_proj.matmul(embedded).scale(f32_reciprocal(f32_sqrt(o.hidden)))
        projected = projected.reshape(d, o.blocks, n).rms_norm(w.per_layer_proj_norm, o.eps).set_name("per_layer_proj")
        mixed = projected.add(own).scale(f32_reciprocal(f32_sqrt(2.0))).set_name("inp_per_layer")
        return mixed.permute(0, 2, 1, 3).contiguous()

    def self_attention(self, ctx: Context, layer: Layer, x: Tensor, positions: Tensor, i: int) -> Tensor:
        """Attention for the normed hidden states x: (head_dim * heads, n), before attn_output. A shared
        layer reads its donor's cache and stores nothing."""
        o, n = self.options, x.ne[1]
        hd, heads, kv_heads = o.head_dim[i], o.heads[i], o.kv_heads[i]
        q = layer.attn_q.matmul(x).reshape(hd, heads, n).rms_norm(layer.attn_q_norm, o.eps)
        q = self.rope(q, positions, i).set_name(f"Qcur_pos-{i}")
        if i in o.donors:
            self.cache.set_layer(o.donors[i])
            out = attention(ctx, q, None, None, 1.0, self.cache)
        else:
            k = layer.attn_k.matmul(x)
            v = layer.attn_v.matmul(x) if layer.attn_v is not None else k
            k = k.reshape(hd, kv_heads, n).rms_norm(layer.attn_k_norm, o.eps)
            v = v.reshape(hd, kv_heads, n).rms_norm(None, o.eps).set_name(f"Vcur_normed-{i}")
            k = self.rope(k, positions, i).set_name(f"Kcur_pos-{i}")
            out = attention(ctx, q, k, v, 1.0, self.cache)
        return out.reshape(hd * heads, n).set_name(f"kqv_out-{i}")

    def per_layer_embedding(self, layer: Layer, h: Tensor, inputs: Tensor) -> Tensor:
        """The per-layer embedding's contribution to h: a GELU bottleneck gated by this layer's inputs."""
        x = layer.inp_gate.matmul(h).gelu().mul(inputs)
        return layer.proj.matmul(x).rms_norm(layer.post_norm, self.options.eps)

    def feed_forward(self, layer: Layer, h: Tensor, i: int, rows: tuple[int, ...]) -> Tensor:
        """The FFN's output for the residual h, before its post-norm: the dense GELU FFN, and in a mixture
        layer the experts beside it (routing each sequence's `rows` as alone, models/alone.py)."""
        eps = self.options.eps
        x = h.rms_norm(layer.ffn_norm, eps).set_name(f"ffn_norm-{i}")
        dense = layer.ffn_down.matmul(layer.ffn_gate.matmul(x).gelu(layer.ffn_up.matmul(x)))
        experts = self.experts[i]
        if experts is None or self.routing is None:
            return dense.set_name(f"ffn_out-{i}")
        dense = dense.rms_norm(layer.post_ffw_norm_1, eps).set_name(f"ffn_mlp-{i}")
        routed = h.rms_norm(None, eps).scale(f32_reciprocal(f32_sqrt(self.options.hidden)))
        x = h.rms_norm(layer.pre_ffw_norm_2, eps).set_name(f"ffn_norm_2-{i}")
        mixed = moe(x, experts, self.routing, i, Tensor.gelu, router_input=routed.mul(layer.ffn_gate_inp_scale),
                    gate_up_halves=True, rows=rows)
        mixed = mixed.rms_norm(layer.post_ffw_norm_2, eps).set_name(f"ffn_moe-{i}")
        return dense.add(mixed).set_name(f"ffn_moe_combined-{i}")

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        if batch.tokens is None:
            raise ValueError("a text model's batch needs token ids")
        o, w = self.options, self.weights
        inputs = ctx.input()
        positions = inputs.from_numpy(batch.positions).set_name("positions")
        tokens = inputs.from_numpy(batch.tokens).set_name("tokens")
        h = w.token_embd.rows(tokens).scale(f32_sqrt(o.hidden)).set_name("inp_scaled")
        per_layer = self.per_layer_inputs(tokens, h) if o.per_layer_dim else None
        outputs = inputs.from_numpy(batch.outputs).set_name("outputs") if len(batch.outputs) else None
        last = o.blocks - 1
        rows = sequence_rows(batch.sequences) if self.rows_alone else ()  # per sequence, for the router
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            self.cache.set_layer_type(SWA if o.swa[i] else GLOBAL)
            x = self.self_attention(ctx, layer, h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}"),
                                    positions, i)
            x = layer.attn_output.matmul(x)  # every row, then the rows wanted, as llama.cpp (a GPU rounds by rows)
            mine = None
            if per_layer is not None:  # this layer's slice (per_layer_dim, n) of (per_layer_dim, n, blocks)
                mine = per_layer.view(i * per_layer.strides[2], (o.per_layer_dim, len(batch)),
                                      (per_layer.strides[1],))
            if i == last:  # only the rows that want logits go on
                if outputs is None:
                    return None  # the keys and values are stored; nothing else is wanted
                x, h = x.rows(outputs), h.rows(outputs)
                mine = mine.rows(outputs) if mine is not None else None
                rows = sequence_rows(batch.sequences[batch.outputs]) if self.rows_alone else ()
            x = x.rms_norm(layer.post_attention_norm, o.eps).set_name(f"attn_post_norm-{i}")
            h = x.add(h).set_name(f"attn_out-{i}")
            h = self.feed_forward(layer, h, i, rows).rms_norm(layer.post_ffw_norm, o.eps).add(h)
            if mine is not None:
                h = h.add(self.per_layer_embedding(layer, h, mine))
            if layer.layer_output_scale is not None:
                h = h.mul(layer.layer_output_scale)
            h.set_name(f"l_out-{i}")
        logits = w.output.matmul(h.rms_norm(w.output_norm, o.eps).set_name("result_norm"))
        if o.final_softcap:
            logits = logits.scale(f32_reciprocal(o.final_softcap)).tanh().scale(o.final_softcap)
        return logits.set_name("result_output")
