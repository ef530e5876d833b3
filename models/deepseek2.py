"""DeepSeek-V2/V3 (architecture deepseek2: V2, V2-Lite, V3, R1, Kimi K2): multi-head latent attention
and a mixture of experts with shared experts, as llama.cpp's deepseek2 graph.

Attention (MLA). From the normed hidden state a layer makes
- the query, directly (attn_q, V2-Lite) or low-rank (attn_q_a, RMSNorm attn_q_a_norm, attn_q_b): per head
  a "nope" part and a rotary part of rope.dimension_count features (key_length_mla in all);
- with attn_kv_a_mqa, one compressed latent kv_cmpr (attention.kv_lora_rank wide, RMSNorm attn_kv_a_norm)
  and one rotary key part k_pe shared by all heads; RoPE is plain (not NeoX) and only on the rotary parts.
Files converted by today's llama.cpp carry attn_k_b and attn_v_b (key_length_mla and value_length_mla set):
each head's nope query is absorbed through attn_k_b into the latent space, so attention is MQA over one
head per token: key [kv_cmpr, k_pe], value kv_cmpr, which is all the cache stores (its value is a view of
its key, Causal(value_in_key=...)); each head's output goes back out through attn_v_b. Older files carry
one attn_kv_b instead: keys and values are decompressed per head and cached as ordinary multi-head ones.
The scores are scaled by mscale^2 / sqrt(key_length_mla), mscale following YaRN and
rope.scaling.yarn_log_multiplier as llama.cpp computes it. Mistral Large 3 (also deepseek2) multiplies each
query by Llama 4's temperature, 1 + attention.temperature_scale * ln(1 + floor(position /
attention.temperature_length)).

Feed-forward: the first leading_dense_block_count layers are SwiGLU; the rest a mixture of experts
(softmax or sigmoid router, DeepSeek V3's selection bias exp_probs_b and expert groups, see moe.py)
plus the shared experts (ffn_*_shexp), a SwiGLU added to the mixture's output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch, Causal, attention
from ollama_engine.ml import Backend, Context, Tensor
from ollama_engine.tokenizer import Tokenizer

from .base import Model, ModelError, bind, register, require_uint, weight
from .layers import Output, ffn, head, inputs, query_temperature
from .moe import Gating, Routing, bind_experts, moe
from .rope import yarn_options

GATING = {0: Gating.SOFTMAX, 1: Gating.SOFTMAX, 2: Gating.SIGMOID}  # expert_gating_func; 0: unset (V2, V2.5)


@dataclass
class Layer:
    """Every tensor a layer may have; which are required depends on the file (Options), see check()."""

    attn_norm: Tensor | None = weight("attn_norm.weight", optional=True)
    attn_q: Tensor | None = weight("attn_q.weight", optional=True)
    attn_q_a: Tensor | None = weight("attn_q_a.weight", optional=True)
    attn_q_a_norm: Tensor | None = weight("attn_q_a_norm.weight", optional=True)
    attn_q_b: Tensor | None = weight("attn_q_b.weight", optional=True)
    attn_kv_a_mqa: Tensor | None = weight("attn_kv_a_mqa.weight", optional=True)
    attn_kv_a_norm: Tensor | None = weight("attn_kv_a_norm.weight", optional=True)
    attn_k_b: Tensor | None = weight("attn_k_b.weight", optional=True)
    attn_v_b: Tensor | None = weight("attn_v_b.weight", optional=True)
    attn_kv_b: Tensor | None = weight("attn_kv_b.weight", optional=True)
    attn_output: Tensor | None = weight("attn_output.weight", optional=True)
    ffn_norm: Tensor | None = weight("ffn_norm.weight", optional=True)
    ffn_gate: Tensor | None = weight("ffn_gate.weight", optional=True)
    ffn_up: Tensor | None = weight("ffn_up.weight", optional=True)
    ffn_down: Tensor | None = weight("ffn_down.weight", optional=True)
    ffn_gate_shexp: Tensor | None = weight("ffn_gate_shexp.weight", optional=True)
    ffn_up_shexp: Tensor | None = weight("ffn_up_shexp.weight", optional=True)
    ffn_down_shexp: Tensor | None = weight("ffn_down_shexp.weight", optional=True)


@dataclass(frozen=True)
class Options:
    """Hyper-parameters as llama.cpp's deepseek2 loader reads them."""

    block_count: int  # the trunk's: nextn_predict_layers (multi-token prediction) blocks are not run
    hidden: int
    heads: int
    eps: float
    q_lora_rank: int  # 0: the query is made directly (attn_q)
    kv_lora_rank: int
    rope_dims: int
    k_head: int  # a head's query/key size before absorption (nope + rope)
    v_head: int  # a head's value size after attn_v_b
    mla: bool  # attn_k_b/attn_v_b and the latent cache; False: attn_kv_b and a multi-head cache
    leading_dense: int
    n_ff: int  # the dense layers' width
    n_ff_exp: int  # an expert's width (and a shared expert's)
    n_shared: int
    rope_base: float
    rope_scale: float
    kq_scale: float
    temperature: float  # attention.temperature_scale; 0: none
    temperature_length: int

    @property
    def nope(self) -> int:
        return self.k_head - self.rope_dims

    @classmethod
    def from_config(cls, config: Config) -> Options:
        hidden = require_uint(config, "embedding_length")
        heads = require_uint(config, "attention.head_count")
        if heads == 0:
            raise ModelError("attention.head_count must be positive")
        blocks = require_uint(config, "block_count") - config.get_uint("nextn_predict_layers", 0)
        if blocks < 1:
            raise ModelError("block_count leaves no layers beside the multi-token prediction ones")
        kv_lora = require_uint(config, "attention.kv_lora_rank")
        rope_dims = require_uint(config, "rope.dimension_count")
        if kv_lora == 0 or rope_dims == 0 or rope_dims % 2:
            raise ModelError(f"attention.kv_lora_rank {kv_lora} must be positive and rope.dimension_count "
                             f"{rope_dims} positive and even")
        k_mla, v_mla = (config.get_uint(f"attention.{key}_length_mla", 0) for key in ("key", "value"))
        if bool(k_mla) != bool(v_mla):
            raise ModelError("attention.key_length_mla and value_length_mla must be set together")
        mla = bool(k_mla)
        key_length = config.get_uint("attention.key_length", hidden // heads)
        kv_heads = config.get_uint("attention.head_count_kv", heads)
        if mla and (key_length != kv_lora + rope_dims or kv_heads != 1):
            raise ModelError(f"MLA needs attention.key_length {kv_lora + rope_dims} (kv_lora_rank + rope dims) "
                             f"and head_count_kv 1, got {key_length} and {kv_heads}")
        if not mla and kv_heads != heads:
            raise ModelError(f"attention.head_count_kv {kv_heads} must equal head_count {heads} without MLA")
        k_head = k_mla if mla else key_length
        v_head = v_mla if mla else config.get_uint("attention.value_length", hidden // heads)
        if k_head <= rope_dims or v_head == 0:
            raise ModelError(f"key length {k_head} must exceed rope.dimension_count {rope_dims}; value length "
                             f"{v_head} must be positive")
        leading = config.get_uint("leading_dense_block_count", 0)
        temperature = config.get_float("attention.temperature_scale", 0.0)
        temperature_length = config.get_uint("attention.temperature_length", 0)
        if temperature and not temperature_length:
            raise ModelError("attention.temperature_scale needs a positive attention.temperature_length")
        factor = config.get_float("rope.scaling.factor", 0.0)
        rope_scale = 1.0 / factor if factor else 1.0
        if config.get_string("rope.scaling.type", "") == "none":
            rope_scale = 1.0  # llama.cpp never scales then
        return cls(
            block_count=blocks, hidden=hidden, heads=heads,
            eps=config.get_float("attention.layer_norm_rms_epsilon", 1e-6),
            q_lora_rank=config.get_uint("attention.q_lora_rank", 0), kv_lora_rank=kv_lora, rope_dims=rope_dims,
            k_head=k_head, v_head=v_head, mla=mla, leading_dense=min(leading, blocks),
            n_ff=require_uint(config, "feed_forward_length") if leading else 0,
            n_ff_exp=require_uint(config, "expert_feed_forward_length") if leading < blocks else 0,
            n_shared=config.get_uint("expert_shared_count", 0),
            rope_base=config.get_float("rope.freq_base", 10000.0), rope_scale=rope_scale,
            kq_scale=_kq_scale(config, rope_scale, k_head), temperature=temperature,
            temperature_length=temperature_length,
        )


def _yarn_log_mul(config: Config) -> np.float32:
    """rope.scaling.yarn_log_multiplier as llama.cpp uses it: the converter wrote 0.1 * mscale_all_dim."""
    return np.float32(config.get_float("rope.scaling.yarn_log_multiplier", 0.0)) / np.float32(0.1)


def _attention_factor(config: Config, rope_scale: float) -> np.float32:
    """llama_context's yarn_attn_factor for deepseek2: what RoPE multiplies its output by (before the
    1 + 0.1 ln(factor) ggml applies again inside YaRN), in float32 as llama.cpp computes it."""
    one, tenth = np.float32(1.0), np.float32(0.1)
    factor = one / np.float32(rope_scale)
    attn = one
    if config.get_string("rope.scaling.type", "") == "yarn":
        log_mul = _yarn_log_mul(config)
        # llama.cpp's get_mscale(factor, m) / get_mscale(factor, log_mul) is 1 for deepseek2 (m = log_mul)
        if not log_mul and factor > one:
            attn = tenth * np.log(factor) + one
        attn = attn * (one / (one + tenth * np.log(factor)))
    return attn * np.float32(config.get_float("rope.scaling.attn_factor", 1.0))


def _kq_scale(config: Config, rope_scale: float, k_head: int) -> float:
    """mscale^2 / sqrt(key_length_mla), mscale undoing RoPE's attention factor and applying
    yarn_log_multiplier, as llama.cpp's deepseek2 graph pre-scales it."""
    one, tenth = np.float32(1.0), np.float32(0.1)
    log_factor = np.log(one / np.float32(rope_scale))
    original = _attention_factor(config, rope_scale) * (one + tenth * log_factor)
    mscale = original * (one + tenth * _yarn_log_mul(config) * log_factor)
    return float(mscale * mscale / np.sqrt(np.float32(k_head)))


@register("deepseek2")
class DeepSeek2(Model):
    reuse_graphs = True

    @classmethod
    def unused_tensors(cls, config: Config) -> Callable[[str], bool]:
        """The multi-token prediction blocks (the last nextn_predict_layers) too: llama.cpp skips them."""
        trunk = config.get_uint("block_count", 0) - config.get_uint("nextn_predict_layers", 0)
        mtp = tuple(f"blk.{i}." for i in range(max(trunk, 0), config.get_uint("block_count", 0)))
        vision = super().unused_tensors(config)
        return lambda name: vision(name) or name.startswith(mtp)

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None):
        super().__init__(backend, tokenizer)
        self.config = self.hyperparameters(self.config)
        self.options = o = Options.from_config(self.config)
        self.weights = bind(Output, backend)
        self.layers = [bind(Layer, backend, f"blk.{i}.") for i in range(o.block_count)]
        for i, layer in enumerate(self.layers):
            self._check(layer, i)
        self.routing = None
        self.experts = {}
        if o.leading_dense < o.block_count:
            gating = self.config.get_uint("expert_gating_func", 0)
            vocab = self.config.get_uint("vocab_size", tokenizer.vocab_size if tokenizer is not None else 0)
            if gating == 0 and o.block_count in (47, 48) and vocab == 154880:
                gating = 2  # llama.cpp's default for GLM 4.7 Lite files, which do not say
            if gating not in GATING:
                raise ModelError(f"expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
            self.routing = Routing.from_config(self.config, GATING[gating],
                                               normalize=self.config.get_bool("expert_weights_norm", False),
                                               scale=self.config.get_float("expert_weights_scale", 0.0))
            self.experts = {i: bind_experts(backend, i, self.routing, o.hidden)
                            for i in range(o.leading_dense, o.block_count)}
        base = yarn_options(self.config, o.rope_scale, neox=False)
        self.rope_options = dataclasses.replace(
            base, attention_factor=float(_attention_factor(self.config, o.rope_scale)))
        self.cache = Causal(self.shift, value_in_key=o.kv_lora_rank) if o.mla else Causal(self.shift)

    def hyperparameters(self, config: Config) -> Config:
        """The file's hyper-parameters as llama.cpp's deepseek2 names them (a converter that names them
        otherwise, as Ollama's glm4moelite, translates them here)."""
        return config

    def _check(self, layer: Layer, i: int) -> None:
        """The layer has the tensors its file's kind needs, each of llama.cpp's shape: ggml aborts on a
        matrix product of the wrong sizes."""
        o = self.options
        shared = o.n_ff_exp * o.n_shared
        shapes = {
            "attn_norm": (o.hidden,), "attn_q": (o.hidden, o.heads * o.k_head), "attn_q_a": (o.hidden, o.q_lora_rank),
            "attn_q_a_norm": (o.q_lora_rank,), "attn_q_b": (o.q_lora_rank, o.heads * o.k_head),
            "attn_kv_a_mqa": (o.hidden, o.kv_lora_rank + o.rope_dims), "attn_kv_a_norm": (o.kv_lora_rank,),
            "attn_k_b": (o.nope, o.kv_lora_rank, o.heads), "attn_v_b": (o.kv_lora_rank, o.v_head, o.heads),
            "attn_kv_b": (o.kv_lora_rank, o.heads * (o.nope + o.v_head)), "attn_output": (o.heads * o.v_head, o.hidden),
            "ffn_norm": (o.hidden,), "ffn_gate": (o.hidden, o.n_ff), "ffn_up": (o.hidden, o.n_ff),
            "ffn_down": (o.n_ff, o.hidden), "ffn_gate_shexp": (o.hidden, shared), "ffn_up_shexp": (o.hidden, shared),
            "ffn_down_shexp": (shared, o.hidden),
        }
        required = ["attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", "ffn_norm"]
        required += ["attn_q_a", "attn_q_a_norm", "attn_q_b"] if o.q_lora_rank else ["attn_q"]
        required += ["attn_k_b", "attn_v_b"] if o.mla else ["attn_kv_b"]
        ffn = ["ffn_gate", "ffn_up", "ffn_down"]
        required += ffn if i < o.leading_dense else [f"{name}_shexp" for name in ffn]
        source = self.backend.model.path if self.backend.model is not None else "the backend"
        for name in required:
            tensor = getattr(layer, name)
            if tensor is None:
                raise ModelError(f"{source}: model is missing required tensor blk.{i}.{name}.weight")
            if tensor.shape != shapes[name]:
                raise ModelError(f"{source}: tensor blk.{i}.{name}.weight has shape {list(tensor.shape)}, expected "
                                 f"{list(shapes[name])} (from the file's hyper-parameters)")

    def batch_inputs(self, batch: Batch) -> dict[str, np.ndarray]:
        """The query temperature per position, where the file sets one (as llama.cpp's attn_temp input)."""
        o = self.options
        if not o.temperature:
            return {}
        return {"attn_scale": query_temperature(batch.positions, o.temperature, o.temperature_length)}

    def rope(self, x: Tensor, positions: Tensor) -> Tensor:
        o = self.options
        return x.rope(positions, o.rope_dims, o.rope_base, o.rope_scale, None, self.rope_options)

    def shift(self, ctx: Context, layer: int, key: Tensor, delta: Tensor) -> Tensor:
        """RoPE by delta on each stored key's rotary part, its last rope_dims features."""
        d, heads, cells = key.ne[0], key.ne[1], key.ne[2]
        nope = d - self.options.rope_dims
        strides = key.strides[1:3]
        rotary = key.view(nope * key.strides[0], (d - nope, heads, cells), strides)
        return key.view(0, (nope, heads, cells), strides).concat(self.rope(rotary, delta), 0)

    def self_attention(
        self, ctx: Context, layer: Layer, x: Tensor, positions: Tensor, temperature: Tensor | None, i: int,
    ) -> Tensor:
        """Attention for the normed hidden states x (hidden, n): (v_head * heads, n), before attn_output."""
        o, n = self.options, x.ne[1]
        if o.q_lora_rank:
            q = layer.attn_q_a.matmul(x).rms_norm(layer.attn_q_a_norm, o.eps)
            q = layer.attn_q_b.matmul(q)
        else:
            q = layer.attn_q.matmul(x)
        q = q.reshape(o.k_head, o.heads, n)
        kv_pe = layer.attn_kv_a_mqa.matmul(x).set_name(f"kv_cmpr_pe-{i}")  # (kv_lora_rank + rope_dims, n)
        row, size = kv_pe.strides[1], kv_pe.strides[0]
        k_pe = kv_pe.view(o.kv_lora_rank * size, (o.rope_dims, 1, n), (row, row))
        k_pe = self.rope(k_pe, positions).set_name(f"k_pe-{i}")
        kv = kv_pe.view(0, (o.kv_lora_rank, n), (row,)).rms_norm(layer.attn_kv_a_norm, o.eps).set_name(f"kv_cmpr-{i}")
        q_nope = q.view(0, (o.nope, o.heads, n))
        q_pe = self.rope(q.view(o.nope * q.strides[0], (o.rope_dims, o.heads, n)), positions).set_name(f"q_pe-{i}")
        if o.mla:
            absorbed = layer.attn_k_b.matmul(q_nope.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)  # (kv_lora, heads, n)
            q = self._temper(absorbed.concat(q_pe, 0).set_name(f"Qcur-{i}"), temperature, i)
            kv = kv.reshape(o.kv_lora_rank, 1, n)
            k = kv.concat(k_pe, 0).set_name(f"Kcur-{i}")
            out = attention(ctx, q, k, kv.set_name(f"Vcur-{i}"), o.kq_scale, self.cache,
                            value_projection=layer.attn_v_b)
        else:
            kv = layer.attn_kv_b.matmul(kv)  # per head: nope key features, then the value
            size, head = kv.strides[0], (o.nope + o.v_head) * kv.strides[0]
            k_nope = kv.view(0, (o.nope, o.heads, n), (head, head * o.heads))
            v = kv.view(o.nope * size, (o.v_head, o.heads, n), (head, head * o.heads)).contiguous()
            q = self._temper(q_nope.concat(q_pe, 0).set_name(f"Qcur-{i}"), temperature, i)
            k = k_nope.concat(k_pe.repeat_to(o.rope_dims, o.heads, n), 0).set_name(f"Kcur-{i}")
            out = attention(ctx, q, k, v.set_name(f"Vcur-{i}"), o.kq_scale, self.cache)
        return out.reshape(o.v_head * o.heads, n).set_name(f"kqv_out-{i}")

    @staticmethod
    def _temper(q: Tensor, temperature: Tensor | None, i: int) -> Tensor:
        return q if temperature is None else q.mul(temperature).set_name(f"Qcur_attn_temp_scaled-{i}")

    def feed_forward(self, layer: Layer, x: Tensor, i: int, rows: tuple[int, ...]) -> Tensor:
        if i < self.options.leading_dense:
            return ffn(x, layer.ffn_gate, layer.ffn_up, layer.ffn_down, i)
        out = moe(x, self.experts[i], self.routing, i, rows=rows)
        shared = ffn(x, layer.ffn_gate_shexp, layer.ffn_up_shexp, layer.ffn_down_shexp, i)
        return out.add(shared.set_name(f"ffn_shexp-{i}"))

    def forward(self, ctx: Context, batch: Batch) -> Tensor | None:
        o, w = self.options, self.weights
        inp = inputs(ctx, batch, len(self.layers), self.rows_alone)
        h = w.token_embd.rows(inp.tokens).set_name("embd")
        temperature = {name: ctx.input().from_numpy(values).set_name(name)
                       for name, values in self.batch_inputs(batch).items()}.get("attn_scale")
        for i, layer in enumerate(self.layers):
            self.cache.set_layer(i)
            x = h.rms_norm(layer.attn_norm, o.eps).set_name(f"attn_norm-{i}")
            x = self.self_attention(ctx, layer, x, inp.positions, temperature, i)
            if inp.done(i):
                return None
            x, h = inp.rows(i, layer.attn_output.matmul(x), h)
            h = x.add(h).set_name(f"ffn_inp-{i}")
            x = self.feed_forward(layer, h.rms_norm(layer.ffn_norm, o.eps).set_name(f"ffn_norm-{i}"), i,
                                  inp.sequence_rows(i))
            h = x.set_name(f"ffn_out-{i}").add(h).set_name(f"l_out-{i}")
        return head(h, w.output_norm, w.output, o.eps)

# ---------------------------------------------------------------- glm4moelite: Ollama's naming of this graph

OLD_FORMAT = "this model uses a weight format that is no longer supported; please re-download it"  # Ollama's


@register("glm4moelite")
class Glm4MoeLite(DeepSeek2):
    """GLM-4.7-Flash as Ollama's converter writes it (architecture "glm4moelite"): DeepSeek-V2's graph under other
    key names, so this class only translates the keys and DeepSeek2 runs the model.

    llama.cpp converts the same checkpoint (Glm4MoeLiteForCausalLM) to its deepseek2 architecture, and the pinned
    llama.cpp has no glm4moelite of its own; Ollama's model/models/glm4moelite builds the same graph: a low-rank
    query, MLA with attn_k_b/attn_v_b absorbed into the query and output (one latent key per token in the cache),
    plain (not NeoX) RoPE on the rotary parts without YaRN, scores scaled by 1/sqrt(key_length), one dense layer
    then sigmoid-routed experts with a selection bias, normalised and scaled weights and a shared expert. Its
    tensors carry llama.cpp's names and shapes (attn_kv_b split into attn_k_b and attn_v_b at conversion). What
    differs is in the keys (convert_glm4moelite.go):
    - attention.key_length / value_length are a head's size before absorption (qk_nope + qk_rope, v_head), and
      attention.key_length_mla / value_length_mla the latent's (kv_lora_rank + qk_rope, kv_lora_rank): the
      other way round from llama.cpp, whose key_length is what the cache stores;
    - attention.head_count_kv is the checkpoint's num_key_value_heads (all heads), where MLA caches one;
    - expert_weights_norm defaults to true and the gating is always sigmoid (Ollama's model does not read
      expert_gating_func; its converter writes 2).
    Ollama refuses its first conversions of January 2026 (one attn_kv_b, no *_length_mla keys) with "please
    re-download"; so does this class.
    """

    def hyperparameters(self, config: Config) -> Config:
        return Config(as_deepseek2(self.backend.model.metadata))


def as_deepseek2(metadata: dict) -> dict:
    """Ollama's glm4moelite keys with the meanings llama.cpp's deepseek2 gives them (same architecture name)."""
    arch = metadata.get("general.architecture")
    key = f"{arch}.attention."
    latent_k, latent_v = metadata.get(f"{key}key_length_mla"), metadata.get(f"{key}value_length_mla")
    if latent_k is None or latent_v is None:
        raise ModelError(f"{OLD_FORMAT} (no {key}key_length_mla / value_length_mla: a conversion before MLA "
                         "absorption)")
    rank, rope = metadata.get(f"{key}kv_lora_rank"), metadata.get(f"{arch}.rope.dimension_count")
    if isinstance(rank, int) and isinstance(rope, int) and (latent_k, latent_v) != (rank + rope, rank):
        raise ModelError(f"{key}key_length_mla {latent_k} and value_length_mla {latent_v} must be kv_lora_rank "
                         f"+ rope.dimension_count ({rank + rope}) and kv_lora_rank ({rank})")
    translated = dict(metadata)
    translated[f"{key}key_length"], translated[f"{key}value_length"] = latent_k, latent_v
    translated[f"{key}key_length_mla"] = metadata.get(f"{key}key_length")
    translated[f"{key}value_length_mla"] = metadata.get(f"{key}value_length")
    translated[f"{key}head_count_kv"] = 1  # one latent key per token, whatever the checkpoint's KV heads
    translated[f"{arch}.expert_gating_func"] = 2  # sigmoid, as Ollama's model routes
    translated.setdefault(f"{arch}.expert_weights_norm", True)
    return {name: value for name, value in translated.items() if value is not None}
