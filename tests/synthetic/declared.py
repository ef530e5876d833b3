"""A synthetic model's tensors as its architecture declares them: names from the model's own weight()
declarations (models/base.py), shapes from the spec's hyper-parameters by one rule per GGUF name.

For each architecture families() says which declaration dataclasses the model binds (the tensors outside
the layers, and layer i's); a field is written when it is required, or optional and OPTIONAL says the spec
has it. The model's tensor_groups say what the Backend copies per layer (written once, outside the layers) and
which tensor a file may leave out for another (output.weight for token_embd's, when the spec ties them).
SHAPES gives each name's ggml shape and kind, and its order is the file's order (for most architectures the
order llama.cpp's converter writes a layer's tensors in; a file's order changes nothing a model reads, and
each tensor's data is seeded by its name alone), so an architecture's new names are its only lines here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gguf

if TYPE_CHECKING:
    from .models import ModelSpec

Shape = tuple[tuple[int, ...], str]  # ggml shape (ne0 first) and kind (see models._Tensor)
Rule = Callable[["ModelSpec", int], Shape]  # (the spec, its n_vocab set; the layer, -1 outside) -> shape


def _norm(s: ModelSpec, i: int) -> Shape:
    return (s.n_embd,), "norm"


def _bias(s: ModelSpec, i: int) -> Shape:
    return (s.n_embd,), "bias"


def _head_dim(s: ModelSpec, i: int) -> int:
    """Layer i's head size: gemma4's sliding layers have their own."""
    return s.gemma4.head_dim_swa if s.gemma4 is not None and s.gemma4.swa[i] else s.n_rot


def _kv(s: ModelSpec, i: int) -> int:
    """Layer i's key (or value) width: its KV heads (gemma4's sliding layers have their own) of its head size."""
    heads = s.gemma4.n_head_kv_swa if s.gemma4 is not None and s.gemma4.swa[i] else s.n_head_kv
    return heads * _head_dim(s, i)


def _qk_norm(width: Callable[[ModelSpec], int]) -> Rule:
    """A query or key norm: per head, or (olmo2) over all heads."""
    return lambda s, i: ((width(s) if s.arch == "olmo2" else _head_dim(s, i),), "norm")


def _query(s: ModelSpec, i: int) -> int:
    """Layer i's query width: its heads (laguna's differ per layer) of its head size, with MLA's features without
    RoPE; Qwen3-Next's gated attention projects each head's output gate beside it."""
    width = s.layer_heads(i) * (_head_dim(s, i) + (s.mla.nope if s.mla else 0))
    return 2 * width if _delta_net(s) else width


def _attention(s: ModelSpec, i: int) -> int:
    """The attention's output width in layer i: its heads' values."""
    return s.layer_heads(i) * (s.mla.v_head if s.mla else _head_dim(s, i))


def _delta_net(s: ModelSpec) -> bool:
    """Qwen3-Next's family (gated DeltaNet layers)."""
    return s.arch in ("qwen3next", "qwen35", "qwen35moe")


def _channels(s: ModelSpec) -> int:
    """What a Mamba-2 or DeltaNet convolution sees: x (or v), then B and C (or q and k) of every group."""
    return s.ssm_inner + 2 * s.ssm_groups * s.ssm_state


def _per_layer(s: ModelSpec) -> int:
    """The width of a layer's per-layer embedding (gemma3n, gemma4)."""
    return s.gemma3n.per_layer if s.gemma3n is not None else s.gemma4.n_embd_per_layer


SHAPES: dict[str, Rule] = {
    "token_embd.weight": lambda s, i: ((s.n_embd, s.n_vocab), "embedding"),
    "token_types.weight": lambda s, i: ((s.n_embd, 1 if s.arch == "nomic-bert-moe" else 2), "table"),  # BERT's
    "position_embd.weight": lambda s, i: ((s.n_embd, s.context_length), "table"),
    "token_embd_norm.weight": _norm,  # BERT's embeddings' norm; lfm2's output norm
    "token_embd_norm.bias": _bias,
    "per_layer_token_embd.weight": lambda s, i: ((_per_layer(s) * s.n_layer, s.n_vocab),
                                                 "embedding" if s.gemma3n else "matrix"),
    "per_layer_model_proj.weight": lambda s, i: ((s.n_embd, _per_layer(s) * s.n_layer),
                                                 "table" if s.gemma3n else "matrix"),  # gemma3n's stays F32
    "per_layer_proj_norm.weight": lambda s, i: ((_per_layer(s),), "norm"),
    "altup_proj.weight": lambda s, i: ((s.n_embd, s.n_embd, s.gemma3n.altup - 1), "table"),  # gemma3n's AltUp
    "altup_unembd_proj.weight": lambda s, i: ((s.n_embd, s.n_embd, s.gemma3n.altup - 1), "table"),
    "output_norm.weight": _norm,
    "output.weight": lambda s, i: ((s.n_embd, s.n_vocab), "embedding"),
    "rope_freqs.weight": lambda s, i: ((s.n_rot // 2,), "proportional" if s.gemma4 else "rope_freqs"),
    "rope_factors_long.weight": lambda s, i: ((s.n_rot // 2,), "rope_freqs"),  # phi3's LongRoPE
    "rope_factors_short.weight": lambda s, i: ((s.n_rot // 2,), "rope_freqs"),
    "attn_norm.weight": _norm,
    "attn_q_a.weight": lambda s, i: ((s.n_embd, s.mla.q_lora_rank), "matrix"),  # deepseek2's low-rank query
    "attn_q_a_norm.weight": lambda s, i: ((s.mla.q_lora_rank,), "norm"),
    "attn_q_b.weight": lambda s, i: ((s.mla.q_lora_rank, _query(s, i)), "matrix"),
    "attn_qkv.weight": lambda s, i: ((s.n_embd, _channels(s) if _delta_net(s) else s.n_q + 2 * s.n_kv), "matrix"),
    "attn_qkv.bias": lambda s, i: ((s.n_q + 2 * s.n_kv,), "bias"),
    "attn_q.weight": lambda s, i: ((s.n_embd, _query(s, i)), "matrix"),
    "attn_q.bias": lambda s, i: ((s.n_q,), "bias"),
    "attn_k.weight": lambda s, i: ((s.n_embd, _kv(s, i)), "matrix"),
    "attn_k.bias": lambda s, i: ((s.n_kv,), "bias"),
    "attn_v.weight": lambda s, i: ((s.n_embd, _kv(s, i)), "matrix"),
    "attn_v.bias": lambda s, i: ((s.n_kv,), "bias"),
    "attn_kv_a_mqa.weight": lambda s, i: ((s.n_embd, s.mla.kv_lora_rank + s.n_rot), "matrix"),  # MLA's latent
    "attn_kv_a_norm.weight": lambda s, i: ((s.mla.kv_lora_rank,), "norm"),
    "attn_kv_b.weight": lambda s, i: ((s.mla.kv_lora_rank, s.n_head * (s.mla.nope + s.mla.v_head)), "matrix"),
    "attn_k_b.weight": lambda s, i: ((s.mla.nope, s.mla.kv_lora_rank, s.n_head), "matrix"),
    "attn_v_b.weight": lambda s, i: ((s.mla.kv_lora_rank, s.mla.v_head, s.n_head), "matrix"),
    "attn_q_norm.weight": _qk_norm(lambda s: s.n_q),
    "attn_k_norm.weight": _qk_norm(lambda s: s.n_kv),
    "attn_gate.weight": lambda s, i: ((s.n_embd, s.ssm_inner if _delta_net(s) else  # DeltaNet's z
                                       s.layer_heads(i) * (s.n_rot if s.laguna.gate_per_element else 1)),
                                      "matrix"),  # laguna's output gate, per head or per element
    "ssm_in.weight": lambda s, i: ((s.n_embd, s.ssm_inner + _channels(s) + s.ssm_heads), "matrix"),  # Mamba-2's
    "ssm_ba.weight": lambda s, i: ((s.n_embd, 2 * s.ssm_heads), "matrix"),  # DeltaNet's beta and alpha
    "ssm_beta.weight": lambda s, i: ((s.n_embd, s.ssm_heads), "matrix"),
    "ssm_alpha.weight": lambda s, i: ((s.n_embd, s.ssm_heads), "matrix"),
    "ssm_conv1d.weight": lambda s, i: ((s.conv_width, _channels(s)), "table"),  # kernels stay F32
    "ssm_conv1d.bias": lambda s, i: ((_channels(s),), "bias"),
    "ssm_dt.bias": lambda s, i: ((s.ssm_heads,), "bias"),
    "ssm_a": lambda s, i: ((s.ssm_heads,) if _delta_net(s) else (1, s.ssm_heads), "decay"),  # no .weight suffix
    "ssm_d": lambda s, i: ((1, s.ssm_heads), "norm"),
    "ssm_norm.weight": lambda s, i: ((s.ssm_state,) if _delta_net(s) else (s.ssm_inner // s.ssm_groups,
                                                                           s.ssm_groups), "norm"),
    "ssm_out.weight": lambda s, i: ((s.ssm_inner, s.n_embd), "matrix"),
    "shortconv.conv.weight": lambda s, i: ((s.conv_width, s.n_embd), "table"),  # lfm2's short convolution
    "shortconv.in_proj.weight": lambda s, i: ((s.n_embd, 3 * s.n_embd), "matrix"),
    "shortconv.out_proj.weight": lambda s, i: ((s.n_embd, s.n_embd), "matrix"),
    "attn_output.weight": lambda s, i: ((_attention(s, i), s.n_embd), "matrix"),
    "attn_output.bias": _bias,
    "attn_output_norm.weight": _norm,  # BERT's post-norms
    "attn_output_norm.bias": _bias,
    "attn_sinks.weight": lambda s, i: ((s.n_head,), "sinks"),
    "post_attention_norm.weight": _norm,
    "post_ffw_norm.weight": _norm,
    "ffn_norm.weight": _norm,
    "ffn_gate_inp.weight": lambda s, i: ((s.n_embd, s.n_expert), "table"),  # routers stay F32
    "ffn_gate_inp.scale": _norm,  # gemma4's router's own norm
    "pre_ffw_norm_2.weight": _norm,  # gemma4's mixture beside the FFN
    "post_ffw_norm_1.weight": _norm,
    "post_ffw_norm_2.weight": _norm,
    "ffn_gate_exps.weight": lambda s, i: ((s.n_embd, s.n_ff_exp, s.n_expert), "expert"),
    "ffn_gate_up_exps.weight": lambda s, i: ((s.n_embd, 2 * s.n_ff_exp, s.n_expert), "expert"),
    "ffn_down_exps.weight": lambda s, i: ((s.n_ff_exp, s.n_embd, s.n_expert), "expert"),
    "ffn_down_exps.scale": lambda s, i: ((s.n_expert,), "norm"),
    "ffn_up_exps.weight": lambda s, i: ((s.n_embd, s.n_ff_exp, s.n_expert), "expert"),
    "ffn_gate_inp.bias": lambda s, i: ((s.n_expert,), "bias"),
    "ffn_gate_exps.bias": lambda s, i: ((s.n_ff_exp, s.n_expert), "bias"),
    "ffn_down_exps.bias": lambda s, i: ((s.n_embd, s.n_expert), "bias"),
    "ffn_up_exps.bias": lambda s, i: ((s.n_ff_exp, s.n_expert), "bias"),
    "exp_probs_b.bias": lambda s, i: ((s.n_expert,), "bias"),  # the routers' selection bias
    "ffn_gate_inp_shexp.weight": lambda s, i: ((s.n_embd,), "table"),
    "ffn_gate_shexp.weight": lambda s, i: ((s.n_embd, s.n_ff_shexp), "matrix"),
    "ffn_down_shexp.weight": lambda s, i: ((s.n_ff_shexp, s.n_embd), "matrix"),
    "ffn_up_shexp.weight": lambda s, i: ((s.n_embd, s.n_ff_shexp), "matrix"),
    "ffn_gate.weight": lambda s, i: ((s.n_embd, s.layer_ff(i)), "matrix"),
    "ffn_down.weight": lambda s, i: ((s.layer_ff(i), s.n_embd), "matrix"),
    "ffn_up.weight": lambda s, i: ((s.n_embd, s.layer_ff(i) * (2 if s.arch == "phi3" else 1)), "matrix"),  # phi3:
    # gate and up stacked
    "ffn_up.bias": lambda s, i: ((s.n_ff,), "bias"),
    "ffn_down.bias": _bias,
    "layer_output_norm.weight": _norm,
    "layer_output_norm.bias": _bias,
    "layer_output_scale.weight": lambda s, i: ((1,), "norm"),  # gemma4's
    "inp_gate.weight": lambda s, i: ((s.n_embd, _per_layer(s)), "matrix"),  # the per-layer embeddings' gate
    "proj.weight": lambda s, i: ((_per_layer(s), s.n_embd), "matrix"),
    "post_norm.weight": _norm,
    "altup_correct_coef.weight": lambda s, i: ((s.gemma3n.altup, s.gemma3n.altup), "table"),  # gemma3n's AltUp
    "altup_correct_scale.weight": _norm,
    "altup_predict_coef.weight": lambda s, i: ((s.gemma3n.altup, s.gemma3n.altup ** 2), "table"),
    "altup_router.weight": lambda s, i: ((s.n_embd, s.gemma3n.altup), "table"),
    "altup_router_norm.weight": _norm,
    "laurel_l.weight": lambda s, i: ((s.n_embd, s.gemma3n.laurel_rank), "table"),  # and its Laurel
    "laurel_r.weight": lambda s, i: ((s.gemma3n.laurel_rank, s.n_embd), "table"),
    "laurel_post_norm.weight": _norm,
    "cls.weight": lambda s, i: ((s.n_embd, s.n_embd), "matrix"),  # a reranker's head: dense + tanh, one score
    "cls.bias": _bias,
    "cls.output.weight": lambda s, i: ((s.n_embd, 1), "matrix"),
    "cls.output.bias": lambda s, i: ((1,), "bias"),
}
_ORDER = {name: index for index, name in enumerate(SHAPES)}


def mixture_layer(s: ModelSpec, i: int) -> bool:
    """Whether layer i has experts instead of a dense FFN: after the leading dense layers, every moe_every-th
    (nomic-bert-moe's: i % moe_every == 1, as its model counts them)."""
    if s.arch == "nomic-bert-moe":
        return i % s.moe_every == 1
    return s.n_expert > 0 and i >= s.leading_dense_layers and (i + 1) % s.moe_every == 0


def _low_rank_query(s: ModelSpec, i: int) -> bool:
    return s.mla is not None and s.mla.q_lora_rank > 0


def _own_keys(s: ModelSpec, i: int) -> bool:
    """Whether layer i projects keys and values apart: not phi3's (fused in attn_qkv), not in gemma4's last
    shared_kv_layers (they read earlier layers')."""
    return s.arch != "phi3" and (s.gemma4 is None or i < s.n_layer - s.gemma4.shared_kv_layers)


def _own_values(s: ModelSpec, i: int) -> bool:
    """As _own_keys, but gemma4's global layers may use their keys as values (k_eq_v_global)."""
    return _own_keys(s, i) and not (s.gemma4 is not None and s.gemma4.k_eq_v_global and not s.gemma4.swa[i])


def _gated_experts(s: ModelSpec, i: int) -> bool:
    """Experts with gate and up apart: not nomic-bert-moe's and nemotron_h_moe's (ungated), nor gemma4's fused."""
    fused = s.gemma4 is not None and s.gemma4.fused_gate_up
    return s.arch not in ("nomic-bert-moe", "nemotron_h_moe") and not fused


def _always(s: ModelSpec, i: int) -> bool:
    return True


OPTIONAL: dict[str, Callable[[ModelSpec, int], bool]] = {
    "rope_freqs.weight": lambda s, i: s.rope_freqs or s.gemma4 is not None,  # gemma4's proportional RoPE
    **dict.fromkeys(("rope_factors_long.weight", "rope_factors_short.weight"),
                    lambda s, i: s.original_context is not None),  # phi3's LongRoPE
    "token_types.weight": _always,  # nomic-bert's
    **{f"attn_{p}.bias": (lambda s, i: s.qkv_bias) for p in ("q", "k", "v", "qkv", "output")},
    **{f"ffn_{p}.bias": (lambda s, i: s.arch == "nomic-bert-moe") for p in ("up", "down")},  # its GELU FFNs
    **{f"ffn_{p}.weight": (lambda s, i: not mixture_layer(s, i)) for p in ("gate", "up", "down")},
    **{f"ffn_{p}_shexp.weight": mixture_layer for p in ("gate_inp", "gate", "up", "down")},
    "ffn_gate_exps.weight": _gated_experts,
    "ffn_up_exps.weight": lambda s, i: not (s.gemma4 is not None and s.gemma4.fused_gate_up),
    "ffn_gate_up_exps.weight": lambda s, i: s.gemma4 is not None and s.gemma4.fused_gate_up,
    "exp_probs_b.bias": lambda s, i: (s.arch in ("laguna", "lfm2moe", "nemotron_h_moe")
                                      or (s.mla is not None and s.mla.selection_bias)),
    # deepseek2 declares every tensor optional: which it has, the spec says
    **dict.fromkeys(("attn_norm.weight", "attn_output.weight", "ffn_norm.weight", "attn_kv_a_mqa.weight",
                     "attn_kv_a_norm.weight", "attn_gate.weight"), _always),
    "attn_q.weight": lambda s, i: s.arch != "phi3" and not _low_rank_query(s, i),
    **dict.fromkeys(("attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"), _low_rank_query),
    "attn_kv_b.weight": lambda s, i: s.mla.kv_b,  # older conversions: one attn_kv_b
    **dict.fromkeys(("attn_k_b.weight", "attn_v_b.weight"), lambda s, i: not s.mla.kv_b),
    **{f"ffn_{p}.bias": (lambda s, i: s.arch == "gpt-oss") for p in ("gate_inp", "gate_exps", "up_exps", "down_exps")},
    "attn_qkv.weight": _always,  # phi3's
    **dict.fromkeys(("attn_k.weight", "attn_k_norm.weight"), _own_keys),
    "attn_v.weight": _own_values,
    "ssm_conv1d.bias": _always,  # nemotron_h's
    "ssm_ba.weight": lambda s, i: s.arch == "qwen3next",
    **dict.fromkeys(("ssm_beta.weight", "ssm_alpha.weight"), lambda s, i: s.arch in ("qwen35", "qwen35moe")),
    **dict.fromkeys(("cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias"),  # a reranker's head
                    lambda s, i: s.pooling_type == gguf.PoolingType.RANK),
    # gemma4's per-layer embeddings, its output scale, and its mixture beside the FFN
    **dict.fromkeys(("per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight",
                     "inp_gate.weight", "proj.weight", "post_norm.weight"),
                    lambda s, i: s.gemma4 is not None and s.gemma4.n_embd_per_layer > 0),
    "layer_output_scale.weight": _always,
    **dict.fromkeys(("ffn_gate_inp.scale", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight",
                     "post_ffw_norm_2.weight"), lambda s, i: s.n_expert > 0),
    "ffn_down_exps.scale": lambda s, i: s.gemma4 is not None,
}
"""When the spec has an optional tensor, by name; an optional tensor named here by no rule is left out."""


@dataclass(frozen=True)
class Family:
    """Where an architecture's declarations are: its model class and the dataclasses it binds."""

    model: type  # models.base.Model: its tensor_groups
    outside: tuple[type, ...]  # bound without a prefix
    layer: Callable[[ModelSpec, int], tuple[type, ...]]  # bound with the prefix blk.<i>.


@functools.cache
def families() -> dict[str, Family]:
    """Every architecture's declarations (imported here, on first use: writing a file needs no ggml bindings
    otherwise)."""
    from ollama_engine.models import architectures
    from ollama_engine.models.layers import Dense, LlamaLayer, LlamaMoeLayer, Output
    from ollama_engine.models.moe import Experts

    registry = architectures()

    def module(arch: str) -> Any:
        """The module of the architecture's model class."""
        return importlib.import_module(registry[arch].__module__)

    def fixed(*classes: type) -> Callable[[ModelSpec, int], tuple[type, ...]]:
        return lambda s, i: classes

    def mixed(layer: type, dense: tuple[type, ...] = ()) -> Callable[[ModelSpec, int], tuple[type, ...]]:
        """A layer with its experts bound apart where it is a mixture layer, else with `dense`."""
        return lambda s, i: (layer, Experts) if mixture_layer(s, i) else (layer, *dense)

    def llama(s: ModelSpec, i: int) -> tuple[type, ...]:
        return (LlamaMoeLayer, Experts) if s.n_expert else (LlamaLayer,)

    lfm2, nemotron, qwen3next, nomic = (module(a) for a in ("lfm2", "nemotron_h", "qwen3next", "nomic-bert"))

    def lfm2_layer(s: ModelSpec, i: int) -> tuple[type, ...]:
        """A short convolution or attention, then a SwiGLU FFN or (lfm2moe) experts."""
        return mixed(lfm2.AttentionLayer if i in s.attention_layers else lfm2.ConvLayer, (Dense,))(s, i)

    def nemotron_layer(s: ModelSpec, i: int) -> tuple[type, ...]:
        """Mamba-2, attention or an MLP (nemotron_h_moe: experts and a shared one)."""
        if i in s.attention_layers:
            return (nemotron.AttentionLayer,)
        if i not in s.mlp_layers:
            return (nemotron.MambaLayer,)
        return (nemotron.MoeLayer, Experts) if s.n_expert else (nemotron.MlpLayer,)

    def qwen3next_layer(s: ModelSpec, i: int) -> tuple[type, ...]:
        """Gated DeltaNet, every full_attention_interval-th layer gated attention; experts and a gated shared
        expert, or (qwen35) a SwiGLU FFN."""
        mixer = qwen3next.LinearLayer if (i + 1) % s.full_attention_interval else qwen3next.AttentionLayer
        return (mixer, Experts, qwen3next.SharedExpert) if mixture_layer(s, i) else (mixer, Dense)

    found = {
        "llama": llama, "mistral3": llama, "llama4": mixed(module("llama4").Layer),
        "olmo2": fixed(module("olmo2").Olmo2Layer), "qwen2vl": fixed(module("qwen2vl").Qwen2VLLayer),
        **{arch: fixed(registry[arch].layer_type) for arch in ("qwen2", "qwen3", "gemma2", "gemma3")},
        **{arch: fixed(registry[arch].layer_type, Experts) for arch in ("qwen2moe", "qwen3moe")},
        "gpt-oss": fixed(module("gpt-oss").Layer, Experts),  # llama.cpp's names (the writer renames them for
        # Ollama's layouts)
        "deepseek2": mixed(module("deepseek2").Layer), "laguna": mixed(module("laguna").Layer),
        "bert": fixed(module("bert").Layer), "nomic-bert": fixed(nomic.Layer, nomic.SwiGLU),
        "nomic-bert-moe": mixed(nomic.Layer, (nomic.Gelu,)), "phi3": fixed(module("phi3").Phi3Layer),
        "gemma3n": fixed(module("gemma3n").Layer), "gemma4": mixed(module("gemma4").Layer),
        "lfm2": lfm2_layer, "lfm2moe": lfm2_layer, "nemotron_h": nemotron_layer, "nemotron_h_moe": nemotron_layer,
        "qwen3next": qwen3next_layer, "qwen35": qwen3next_layer, "qwen35moe": qwen3next_layer,
    }
    own_weights = ("laguna", "bert", "nomic-bert", "nomic-bert-moe", "lfm2", "lfm2moe", "gemma3n", "gemma4")
    outside = {arch: (module(arch).Weights,) for arch in own_weights}  # the others': layers.Output
    return {arch: Family(registry[arch], outside.get(arch, (Output,)), layer) for arch, layer in found.items()}


def declared_tensors(spec: ModelSpec, n_vocab: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of the spec's architecture, in the file's order: those outside
    the layers first, then layer by layer."""
    family = families()[spec.arch]
    spec = dataclasses.replace(spec, n_vocab=n_vocab)
    groups = family.model.tensor_groups
    left_out = {copy for _, copy in groups.tied} if spec.tied_embeddings else set()

    def names(classes: tuple[type, ...], i: int) -> list[str]:
        found = {field.metadata["gguf"] for cls in classes for field in dataclasses.fields(cls)
                 if (not field.metadata["optional"] and not _left_out(spec, field.metadata["gguf"]))
                 or OPTIONAL.get(field.metadata["gguf"], _never)(spec, i)}
        unknown = sorted(found - set(SHAPES))
        if unknown:
            raise ValueError(f"{spec.arch}: no shape rule for {unknown} (tests/synthetic/declared.py SHAPES)")
        return sorted(found - left_out, key=_ORDER.__getitem__)

    layers = [names(family.layer(spec, i), i) for i in range(spec.n_layer)]
    copied = {name for layer in layers for name in layer if groups.per_layer.intersection(name.split("."))}
    for name in sorted(set(names(family.outside, -1)) | copied, key=_ORDER.__getitem__):
        yield (name, *SHAPES[name](spec, -1))
    for i, layer in enumerate(layers):
        for name in layer:
            if name not in copied:
                yield (f"blk.{i}.{name}", *SHAPES[name](spec, i))


def _left_out(spec: ModelSpec, name: str) -> bool:
    """A required tensor the spec says to leave out: a file a model must refuse (qkv_bias=False on qwen2)."""
    return name in ("attn_q.bias", "attn_k.bias", "attn_v.bias") and not spec.qkv_bias


def _never(spec: Any, i: int) -> bool:
    return False
