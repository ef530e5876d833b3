"""A synthetic model's tensors as its architecture declares them: names from the model's own weight()
declarations (models/base.py), shapes from the spec's hyper-parameters by one rule per GGUF name.

For each architecture families() says which declaration dataclasses the model binds (the tensors outside
the layers, and layer i's); a field is written when it is required, or optional and OPTIONAL says the spec
has it. The model's tensor_groups say what the Backend copies per layer (written once, outside the layers) and
which tensor a file may leave out for another (output.weight for token_embd's, when the spec ties them).
SHAPES gives each name's ggml shape and kind, and its order is the file's order (llama.cpp's converter
writes a layer's tensors in this order), so an architecture's new names are its only lines here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .models import ModelSpec

Shape = tuple[tuple[int, ...], str]  # ggml shape (ne0 first) and kind (see models._Tensor)
Rule = Callable[["ModelSpec", int], Shape]  # (the spec, its n_vocab set; the layer, -1 outside) -> shape


def _norm(s: ModelSpec, i: int) -> Shape:
    return (s.n_embd,), "norm"


def _qk_norm(width: Callable[[ModelSpec], int]) -> Rule:
    """A query or key norm: per head, or (olmo2) over all heads."""
    return lambda s, i: ((width(s) if s.arch == "olmo2" else s.n_rot,), "norm")


def _query(s: ModelSpec, i: int) -> int:
    """Layer i's query width: its heads (laguna's differ per layer) of n_rot, with MLA's features without RoPE."""
    return s.layer_heads(i) * (s.n_rot + (s.mla.nope if s.mla else 0))


def _attention(s: ModelSpec, i: int) -> int:
    """The attention's output width in layer i: its heads' values."""
    return s.layer_heads(i) * (s.mla.v_head if s.mla else s.n_rot)


SHAPES: dict[str, Rule] = {
    "token_embd.weight": lambda s, i: ((s.n_embd, s.n_vocab), "embedding"),
    "output_norm.weight": _norm,
    "output.weight": lambda s, i: ((s.n_embd, s.n_vocab), "embedding"),
    "rope_freqs.weight": lambda s, i: ((s.n_rot // 2,), "rope_freqs"),
    "attn_norm.weight": _norm,
    "attn_q_a.weight": lambda s, i: ((s.n_embd, s.mla.q_lora_rank), "matrix"),  # deepseek2's low-rank query
    "attn_q_a_norm.weight": lambda s, i: ((s.mla.q_lora_rank,), "norm"),
    "attn_q_b.weight": lambda s, i: ((s.mla.q_lora_rank, _query(s, i)), "matrix"),
    "attn_q.weight": lambda s, i: ((s.n_embd, _query(s, i)), "matrix"),
    "attn_q.bias": lambda s, i: ((s.n_q,), "bias"),
    "attn_k.weight": lambda s, i: ((s.n_embd, s.n_kv), "matrix"),
    "attn_k.bias": lambda s, i: ((s.n_kv,), "bias"),
    "attn_v.weight": lambda s, i: ((s.n_embd, s.n_kv), "matrix"),
    "attn_v.bias": lambda s, i: ((s.n_kv,), "bias"),
    "attn_kv_a_mqa.weight": lambda s, i: ((s.n_embd, s.mla.kv_lora_rank + s.n_rot), "matrix"),  # MLA's latent
    "attn_kv_a_norm.weight": lambda s, i: ((s.mla.kv_lora_rank,), "norm"),
    "attn_kv_b.weight": lambda s, i: ((s.mla.kv_lora_rank, s.n_head * (s.mla.nope + s.mla.v_head)), "matrix"),
    "attn_k_b.weight": lambda s, i: ((s.mla.nope, s.mla.kv_lora_rank, s.n_head), "matrix"),
    "attn_v_b.weight": lambda s, i: ((s.mla.kv_lora_rank, s.mla.v_head, s.n_head), "matrix"),
    "attn_q_norm.weight": _qk_norm(lambda s: s.n_q),
    "attn_k_norm.weight": _qk_norm(lambda s: s.n_kv),
    "attn_gate.weight": lambda s, i: ((s.n_embd, s.layer_heads(i) * (s.n_rot if s.laguna.gate_per_element else 1)),
                                      "matrix"),  # laguna's output gate, per head or per element
    "attn_output.weight": lambda s, i: ((_attention(s, i), s.n_embd), "matrix"),
    "attn_output.bias": lambda s, i: ((s.n_embd,), "bias"),
    "attn_sinks.weight": lambda s, i: ((s.n_head,), "sinks"),
    "post_attention_norm.weight": _norm,
    "post_ffw_norm.weight": _norm,
    "ffn_norm.weight": _norm,
    "ffn_gate_inp.weight": lambda s, i: ((s.n_embd, s.n_expert), "table"),  # routers stay F32
    "ffn_gate_exps.weight": lambda s, i: ((s.n_embd, s.n_ff_exp, s.n_expert), "expert"),
    "ffn_down_exps.weight": lambda s, i: ((s.n_ff_exp, s.n_embd, s.n_expert), "expert"),
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
    "ffn_gate.weight": lambda s, i: ((s.n_embd, s.n_ff), "matrix"),
    "ffn_down.weight": lambda s, i: ((s.n_ff, s.n_embd), "matrix"),
    "ffn_up.weight": lambda s, i: ((s.n_embd, s.n_ff), "matrix"),
}
_ORDER = {name: index for index, name in enumerate(SHAPES)}


def mixture_layer(s: ModelSpec, i: int) -> bool:
    """Whether layer i has experts instead of a dense FFN: after the leading dense layers, every moe_every-th."""
    return s.n_expert > 0 and i >= s.leading_dense_layers and (i + 1) % s.moe_every == 0


def _low_rank_query(s: ModelSpec, i: int) -> bool:
    return s.mla is not None and s.mla.q_lora_rank > 0


def _always(s: ModelSpec, i: int) -> bool:
    return True


OPTIONAL: dict[str, Callable[[ModelSpec, int], bool]] = {
    "rope_freqs.weight": lambda s, i: s.rope_freqs,
    **{f"attn_{p}.bias": (lambda s, i: s.qkv_bias) for p in "qkv"},
    **{f"ffn_{p}.weight": (lambda s, i: not mixture_layer(s, i)) for p in ("gate", "up", "down")},
    **{f"ffn_{p}_shexp.weight": mixture_layer for p in ("gate", "up", "down")},
    "ffn_gate_exps.weight": _always,  # gated experts, gate and up apart
    "ffn_up_exps.weight": _always,
    "exp_probs_b.bias": lambda s, i: s.arch == "laguna" or (s.mla is not None and s.mla.selection_bias),
    # deepseek2 declares every tensor optional: which it has, the spec says
    **dict.fromkeys(("attn_norm.weight", "attn_output.weight", "ffn_norm.weight", "attn_kv_a_mqa.weight",
                     "attn_kv_a_norm.weight", "attn_gate.weight"), _always),
    "attn_q.weight": lambda s, i: not _low_rank_query(s, i),
    **dict.fromkeys(("attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"), _low_rank_query),
    "attn_kv_b.weight": lambda s, i: s.mla.kv_b,  # older conversions: one attn_kv_b
    **dict.fromkeys(("attn_k_b.weight", "attn_v_b.weight"), lambda s, i: not s.mla.kv_b),
    **{f"ffn_{p}.bias": (lambda s, i: s.arch == "gpt-oss") for p in ("gate_inp", "gate_exps", "up_exps", "down_exps")},
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
    """The architectures whose tensors come from their declarations (imported here, on first use: writing
    a file needs no ggml bindings otherwise)."""
    from ollama_engine.models import REGISTRY
    from ollama_engine.models.deepseek2 import Layer as DeepSeek2Layer
    from ollama_engine.models.gemma2 import Gemma2, Gemma3
    from ollama_engine.models.gptoss import Layer as GptOssLayer
    from ollama_engine.models.laguna import Layer as LagunaLayer
    from ollama_engine.models.laguna import Weights as LagunaWeights
    from ollama_engine.models.layers import LlamaLayer, LlamaMoeLayer, Output
    from ollama_engine.models.llama4 import Layer as Llama4Layer
    from ollama_engine.models.moe import Experts
    from ollama_engine.models.olmo2 import Olmo2Layer
    from ollama_engine.models.qwen2 import Qwen2, Qwen2Moe
    from ollama_engine.models.qwen3 import Qwen3, Qwen3Moe

    def llama(s: ModelSpec, i: int) -> tuple[type, ...]:
        return (LlamaMoeLayer, Experts) if s.n_expert else (LlamaLayer,)

    def mixed(layer: type) -> Callable[[ModelSpec, int], tuple[type, ...]]:
        """A layer with its experts bound apart where it is a mixture layer."""
        return lambda s, i: (layer, Experts) if mixture_layer(s, i) else (layer,)

    def fixed(*classes: type) -> Callable[[ModelSpec, int], tuple[type, ...]]:
        return lambda s, i: classes

    found = {
        "llama": llama, "mistral3": llama, "llama4": mixed(Llama4Layer), "olmo2": fixed(Olmo2Layer),
        "qwen2": fixed(Qwen2.layer_type), "qwen2moe": fixed(Qwen2Moe.layer_type, Experts),
        "qwen3": fixed(Qwen3.layer_type), "qwen3moe": fixed(Qwen3Moe.layer_type, Experts),
        "gemma2": fixed(Gemma2.layer_type), "gemma3": fixed(Gemma3.layer_type),
        "gpt-oss": fixed(GptOssLayer, Experts),  # llama.cpp's names (the writer renames them for Ollama's layouts)
        "deepseek2": mixed(DeepSeek2Layer), "laguna": mixed(LagunaLayer),
    }
    if "qwen2vl" in REGISTRY:  # a newer model file: found through the registry
        found["qwen2vl"] = fixed(importlib.import_module(REGISTRY["qwen2vl"].__module__).Qwen2VLLayer)
    outside = {"laguna": (LagunaWeights,)}
    return {arch: Family(REGISTRY[arch], outside.get(arch, (Output,)), layer) for arch, layer in found.items()}


def declared_tensors(spec: ModelSpec, n_vocab: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of the spec's architecture, in the file's order: those outside
    the layers first, then layer by layer."""
    family = families()[spec.arch]
    spec = dataclasses.replace(spec, n_vocab=n_vocab)
    groups = family.model.tensor_groups
    left_out = {copy for _, copy in groups.tied} if spec.tied_embeddings else set()

    def names(classes: tuple[type, ...], i: int) -> list[str]:
        found = {field.metadata["gguf"] for cls in classes for field in dataclasses.fields(cls)
                 if not field.metadata["optional"] or OPTIONAL.get(field.metadata["gguf"], _never)(spec, i)}
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


def _never(spec: Any, i: int) -> bool:
    return False
