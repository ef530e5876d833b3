"""Synthetic GGUF models: random weights, a real tokenizer, llama.cpp's tensor names and keys.

They make every architecture testable and benchmarkable without downloads. Tokenizer keys are copied
verbatim from one of llama.cpp's vocab-only files (models/ggml-vocab-<name>.gguf). Weights are
normal(0, 1/sqrt(fan_in)) so each layer's outputs keep roughly unit variance and logits are spread
(logits-parity tests need clear winners, not near-ties); norms are near 1.0, biases small. Norms,
biases, rope_freqs and BERT's position and token-type tables stay F32 as llama.cpp leaves them;
every other matrix, token_embd included, gets the requested weight type. Each tensor draws from its
own generator seeded by (seed, name), so a tensor's values do not depend on the file's other tensors.

Which tensors a file has comes from the model's own weight() declarations (declared.py: names from the
declarations, shapes from one rule per GGUF name). Presets are small changes of a few base specs (_tiny,
dataclasses.replace).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ollama_engine import paths
from ollama_engine.fs.gguf_file import Conversion, GGUFFile

from .declared import declared_tensors

ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "bert", "gemma2", "gemma3", "qwen3moe", "nomic-bert", "phi3", "olmo2", "mistral3",
    "gpt-oss", "llama4", "deepseek2", "gemma3n",
    "qwen2moe", "nomic-bert-moe", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe", "qwen3next", "qwen35",
    "qwen35moe", "gemma4", "laguna", "qwen2vl",
)
_ROPE_ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3moe", "nomic-bert", "phi3", "olmo2", "mistral3",
    "gpt-oss", "llama4", "deepseek2", "gemma3n",
    "qwen2moe", "nomic-bert-moe", "lfm2", "lfm2moe", "qwen3next", "qwen35", "qwen35moe", "gemma4", "laguna",
    "qwen2vl",
)
# a router and stacked experts instead of the FFN
_MOE_ARCHITECTURES = ("qwen3moe", "gpt-oss", "llama4", "qwen2moe", "lfm2moe", "nemotron_h_moe", "qwen3next",
                      "qwen35moe")
_BERT_ARCHITECTURES = ("bert", "nomic-bert", "nomic-bert-moe")  # encoders: post-norm, pooled
# Ollama's converters' architecture names (layout "ollama")
_OLLAMA_NAMES = {"gpt-oss": "gptoss", "olmo2": "olmo3", "deepseek2": "glm4moelite", "laguna": "laguna",
                 "qwen2vl": "qwen25vl"}

# Every type ggml quantizes to and computes with (Q2_0 aside: gguf-py does not know it yet), and the
# general.file_type llama-quantize writes for it. K and IQ types need rows that are multiples of 256.
_FILE_TYPES = {"F32": "ALL_F32", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M",
               "MXFP4": "MOSTLY_MXFP4_MOE"}  # the others: MOSTLY_<type>
WEIGHT_TYPES = {
    name: (GGMLQuantizationType[name], gguf.LlamaFileType[_FILE_TYPES.get(name, f"MOSTLY_{name}")])
    for name in ("F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K IQ1_S IQ1_M IQ2_XXS IQ2_XS "
                 "IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS TQ1_0 TQ2_0 MXFP4 NVFP4 Q1_0").split()
}

_CHUNK_ELEMENTS = 1 << 24  # large matrices are generated and quantized this many elements at a time


@dataclass(frozen=True)
class MLASpec:
    """deepseek2's attention and mixture options (ModelSpec.head_dim is its rotary part)."""

    kv_lora_rank: int = 64  # the compressed latent the cache stores
    q_lora_rank: int = 0  # > 0: a low-rank query (attn_q_a, attn_q_a_norm, attn_q_b); 0: attn_q
    nope: int = 32  # a head's query/key features without RoPE
    v_head: int = 32
    kv_b: bool = False  # older conversions: one attn_kv_b, no *_length_mla keys, multi-head keys
    leading_dense: int = 1  # leading_dense_block_count
    n_shared: int = 1  # shared experts, each n_ff_exp wide
    gating: int = 1  # expert_gating_func: 1 softmax, 2 sigmoid
    weights_norm: bool = False
    weights_scale: float = 1.0
    selection_bias: bool = False  # DeepSeek V3's exp_probs_b
    groups: int = 0  # expert_group_count and expert_group_used_count (0: none written)
    groups_used: int = 0
    temperature_length: int = 0  # attention.temperature_length (Mistral Large 3's query temperature)


@dataclass(frozen=True)
class Gemma3nSpec:
    """gemma3n's AltUp, Laurel, per-layer embeddings, sparsity and KV sharing (llama.cpp fixes the first three
    sizes: 4 streams, rank 64, 256 per layer; it shares keys from layer 20 and sparsifies layers 0-9)."""

    per_layer: int = 256  # embedding_length_per_layer_input
    laurel_rank: int = 64
    altup: int = 4  # altup.num_inputs
    shared_kv_layers: int = 0  # the last layers read the keys and values of earlier ones
    sparse_layers: int = 10  # activation_sparsity_scale: the 0.95 quantile in these first layers, -inf after
    swa_pattern: int = 5  # every n-th layer global, written as one flag per layer


@dataclass(frozen=True)
class LagunaSpec:
    """laguna's layers (ModelSpec.n_head is the full-attention layers'; every 4th layer from 0 is one)."""

    n_head_swa: int  # the sliding layers' query heads (attention.head_count is an array)
    rope_dims_swa: int  # rope.dimension_count_swa (ModelSpec.rope_dims: the full layers')
    n_ff_shexp: int  # expert_shared_feed_forward_length
    leading_dense: int = 1
    gate_per_element: bool = False  # attn_gate per head (XS.2) or per element (M.1)
    weights_scale: float = 2.5


@dataclass(frozen=True)
class Gemma4Spec:
    """gemma4's layers (ModelSpec.head_dim and n_head_kv are the global layers' where they differ)."""

    swa: tuple[bool, ...]  # per layer: sliding (True) or global
    head_dim_swa: int  # attention.key_length_swa
    n_head_kv_swa: int  # the sliding layers' KV heads (head_count_kv then is an array)
    rope_dims_swa: int  # rope.dimension_count_swa
    rotated_global: int  # pairs the global layers' proportional RoPE turns (rope_freqs 1; the others 1e30)
    shared_kv_layers: int = 0  # the last layers read the keys and values of earlier ones
    n_embd_per_layer: int = 0  # per-layer embeddings' width (0: none)
    k_eq_v_global: bool = False  # global layers without attn_v (their key projection is the value)
    double_wide: bool = False  # the shared layers' FFN twice as wide (feed_forward_length an array)
    fused_gate_up: bool = False  # with experts (ModelSpec.n_expert): gate and up in one stack, ffn_gate_up_exps


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and options of a synthetic model. head_dim None means n_embd // n_head."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    vocab: str  # llama.cpp vocab file: models/ggml-vocab-<vocab>.gguf
    head_dim: int | None = None
    n_vocab: int | None = None  # None: the tokenizer's size; larger: pad with unused tokens
    context_length: int = 2048
    rope_base: float = 10000.0
    eps: float = 1e-5
    tied_embeddings: bool = True
    rope_freqs: bool = False  # Llama-3 style per-frequency rope factors
    qkv_bias: bool = False
    qk_norm: bool = False
    pooling_type: int = int(gguf.PoolingType.CLS)  # bert only: 1 mean, 2 CLS, 3 last, 4 rank (a cls head)
    sliding_window: int | None = None  # gemma: attention.sliding_window and its pattern (every n-th global)
    sliding_window_pattern: int | None = None
    rope_base_swa: float | None = None
    attn_softcap: float | None = None  # gemma2: attn_logit_softcapping, final_logit_softcapping
    final_softcap: float | None = None
    n_expert: int = 0  # mixtures of experts: experts per layer, experts used per token, an expert's width
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_type: str | None = None  # the experts' weight type where it differs (gpt-oss: MXFP4)
    moe_every: int = 1  # llama4's interleave_moe_layer_step: every n-th layer is a mixture
    embedding_type: str | None = None  # token_embd's and output's type where it differs (llama-quantize's
    # --token-embedding-type and --output-tensor-type)
    original_context: int | None = None  # rope.scaling.original_context_length (phi3's factors, YaRN)
    rope_scaling_type: str | None = None  # rope.scaling.type and .factor (mistral3: "yarn")
    rope_scaling_factor: float | None = None
    rope_attn_factor: float | None = None  # rope.scaling.attn_factor (phi3's long context)
    yarn_log_mul: float | None = None  # rope.scaling.yarn_log_multiplier (mistral3)
    attn_temperature_scale: float | None = None  # attention.temperature_scale (mistral3, Llama 4's scaling)
    layout: str = "llama.cpp"  # gpt-oss: "ollama" (Ollama's converter: architecture "gptoss", its tensor names,
    # no rope.scaling.type), "ollama-qkv" (and q, k, v fused, as it converts OpenAI's original checkpoint),
    # "ollama-2025-09" (and, as its files until October 2025: gate and up fused with interleaved rows in
    # ffn_gate_up_exps, the experts' biases BF16) or "ollama-2025-08" (and, as its first ones, until 26 August
    # 2025, what gpt-oss:20b still is: MXFP4 experts under type id 4 in OpenAI's nibble order); deepseek2:
    # "ollama" (Ollama's GLM-4.7-Flash: architecture "glm4moelite", its key/value length keys, all KV heads)
    mla: MLASpec | None = None  # deepseek2 only
    gemma4: Gemma4Spec | None = None  # gemma4 only
    laguna: LagunaSpec | None = None  # laguna only
    attention_layers: tuple[int, ...] = ()  # lfm2: the layers with attention; the others are short convolutions
    conv_width: int = 3  # lfm2: shortconv.l_cache, the convolution's taps
    leading_dense: int = 0  # lfm2moe: leading_dense_block_count, the layers before the mixtures
    mlp_layers: tuple[int, ...] = ()  # nemotron_h: the MLP layers (attention_layers: attention; others Mamba-2)
    ssm_inner: int = 0  # nemotron_h: ssm.inner_size, .state_size, .time_step_rank (heads), .group_count
    ssm_state: int = 0
    ssm_heads: int = 0
    ssm_groups: int = 1
    rope_dims: int | None = None  # rope.dimension_count where it is not the head size (qwen3next: partial)
    full_attention_interval: int = 4  # qwen3next: every n-th layer is full attention, the others DeltaNet
    gemma3n: Gemma3nSpec | None = None  # gemma3n only
    rope_sections: tuple[int, ...] = ()  # qwen35: rope.dimension_sections (multimodal RoPE)
    name: str = "synthetic"

    @property
    def n_rot(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def n_q(self) -> int:
        return self.n_head * self.n_rot

    @property
    def n_kv(self) -> int:
        return self.n_head_kv * self.n_rot

    @property
    def n_ff_shexp(self) -> int:
        """A shared expert's width: llama4's as one expert (expert_feed_forward_length), deepseek2's n_shared
        experts', laguna's its own, the others' n_ff (written as expert_shared_feed_forward_length)."""
        if self.mla is not None:
            return self.n_ff_exp * self.mla.n_shared
        if self.laguna is not None:
            return self.laguna.n_ff_shexp
        return self.n_ff_exp if self.arch == "llama4" else self.n_ff

    @property
    def leading_dense_layers(self) -> int:
        """The dense layers before the mixtures."""
        for options in (self.mla, self.laguna):
            if options is not None:
                return options.leading_dense
        return self.leading_dense

    def layer_ff(self, i: int) -> int:
        """Layer i's FFN width: gemma4's shared-KV layers' doubled where the spec says (use_double_wide_mlp)."""
        g = self.gemma4
        doubled = g is not None and g.double_wide and i >= self.n_layer - g.shared_kv_layers
        return 2 * self.n_ff if doubled else self.n_ff

    def layer_heads(self, i: int) -> int:
        """Layer i's query heads: laguna's full-attention layers (0 and every 4th after it, when a sliding window
        is set: llama.cpp's default pattern) have n_head, its sliding ones laguna.n_head_swa."""
        if self.laguna is None or self.sliding_window is None or i % 4 == 0:
            return self.n_head
        return self.laguna.n_head_swa


def _tiny(arch: str, vocab: str, **options: Any) -> ModelSpec:
    """A tiny model: 2 layers of width 64, 4 query heads over 2 KV heads, an FFN of 128, 512 positions;
    `options` replace any field."""
    fields = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_ff": 128, "context_length": 512}
    return ModelSpec(arch=arch, vocab=vocab, **{**fields, **options})


_QWEN = {"rope_base": 1000000.0, "eps": 1e-6}
_YARN_16 = {"original_context": 16, "rope_scaling_type": "yarn", "rope_scaling_factor": 4.0}  # YaRN from 16 positions
_MAMBA = {"conv_width": 4, "ssm_inner": 128, "ssm_state": 32, "ssm_heads": 8, "ssm_groups": 2}
_DELTANET = {"head_dim": 32, "n_ff": 64, "rope_base": 1000000.0, "tied_embeddings": False, "rope_dims": 8,
             "conv_width": 4, "ssm_inner": 64, "ssm_state": 16, "ssm_heads": 4, "ssm_groups": 2, "eps": 1e-6}
_EXPERTS_8_2 = {"n_expert": 8, "n_expert_used": 2, "n_ff_exp": 32}

_tiny_qwen2 = _tiny("qwen2", "qwen2", qkv_bias=True, **_QWEN)
_tiny_qwen3 = _tiny("qwen3", "qwen2", head_dim=32, qk_norm=True, **_QWEN)
_tiny_bert = _tiny("bert", "bert-bge", n_head_kv=4, eps=1e-12, qkv_bias=True)
_tiny_olmo2 = _tiny("olmo2", "gpt-2", rope_base=500000.0, eps=1e-6, tied_embeddings=False, qk_norm=True)
_tiny_lfm2 = _tiny("lfm2", "gpt-2", n_layer=4, rope_base=1000000.0, attention_layers=(1, 3))
_tiny_nemotron_h = _tiny("nemotron_h", "gpt-2", n_layer=6, tied_embeddings=False, attention_layers=(3,),
                         mlp_layers=(1, 5), **_MAMBA)
_tiny_qwen3next = _tiny("qwen3next", "gpt-2", n_layer=4, **_DELTANET, **_EXPERTS_8_2)
_tiny_deepseek2 = _tiny("deepseek2", "llama-bpe", n_layer=3, n_head_kv=1, head_dim=32, eps=1e-6, tied_embeddings=False,
                        n_expert=8, n_expert_used=2, n_ff_exp=64)

_PRESETS: dict[str, ModelSpec] = {
    "tiny-llama": _tiny("llama", "llama-spm", tied_embeddings=False, rope_freqs=True),
    "tiny-qwen2": _tiny_qwen2,
    # qwen2vl (Qwen2-VL, Qwen2.5-VL's text model): tiny-qwen2 with multimodal RoPE, 8 rotated pairs in
    # sections 2 (time), 3 (height), 3 (width), 0, as Qwen2.5-VL's 16, 24, 24, 0 of 64
    "tiny-qwen2vl": dataclasses.replace(_tiny_qwen2, arch="qwen2vl", rope_sections=(2, 3, 3, 0)),
    "tiny-qwen3": _tiny_qwen3,
    "tiny-bert": _tiny_bert,
    # a cross-encoder (bge-reranker's layout): tiny-bert with a cls head
    "tiny-bert-reranker": dataclasses.replace(_tiny_bert, pooling_type=int(gguf.PoolingType.RANK)),
    "tiny-qwen3moe": dataclasses.replace(_tiny_qwen3, arch="qwen3moe", n_expert=8, n_expert_used=3, n_ff_exp=64),
    # Mixtral: llama with a mixture of experts for every FFN, as wide as feed_forward_length
    "tiny-mixtral": _tiny("llama", "llama-spm", n_ff=64, rope_base=1000000.0, tied_embeddings=False, n_expert=4,
                          n_expert_used=2, n_ff_exp=64),
    # Qwen2-MoE: Qwen2's attention, experts and a sigmoid-gated shared expert as wide as feed_forward_length
    "tiny-qwen2moe": dataclasses.replace(_tiny_qwen2, arch="qwen2moe", n_ff=96, tied_embeddings=False, n_expert=8,
                                         n_expert_used=3, n_ff_exp=32),
    # gpt-oss: two layers (sliding, global), YaRN from 16 positions, MXFP4 experts with biases, sinks
    "tiny-gpt-oss": _tiny("gpt-oss", "gpt-2", head_dim=32, rope_base=150000.0, tied_embeddings=False, qkv_bias=True,
                          n_expert=8, n_expert_used=3, n_ff_exp=64, expert_type="MXFP4", sliding_window=8, **_YARN_16),
    # llama4: dense and mixture layers alternating, three chunked RoPE layers then a global one without
    "tiny-llama4": _tiny("llama4", "llama-bpe", n_layer=4, head_dim=32, rope_base=500000.0, rope_freqs=True,
                         tied_embeddings=False, n_expert=4, n_expert_used=1, n_ff_exp=64, moe_every=2),
    "tiny-nomic-bert": _tiny("nomic-bert", "bert-bge", n_head_kv=4, rope_base=1000.0, eps=1e-12,
                             pooling_type=int(gguf.PoolingType.MEAN)),
    # nomic-embed-text v2 (XLM-RoBERTa's Unigram vocabulary): every second layer (1, 3) a mixture of
    # ungated GELU experts as wide as feed_forward_length
    "tiny-nomic-bert-moe": _tiny("nomic-bert-moe", "nomic-bert-moe", n_layer=4, n_head_kv=4,
                                 pooling_type=int(gguf.PoolingType.MEAN), qkv_bias=True, n_expert=4, n_expert_used=2,
                                 n_ff_exp=128, moe_every=2),
    # Gemma with a short window and small caps so that a short prompt crosses the window and the caps bite
    "tiny-gemma2": _tiny("gemma2", "llama-spm", head_dim=32, eps=1e-6, sliding_window=8, attn_softcap=3.0,
                         final_softcap=10.0),
    "tiny-gemma3": _tiny("gemma3", "llama-spm", n_layer=3, n_head_kv=1, head_dim=32, qk_norm=True, sliding_window=8,
                         sliding_window_pattern=3, rope_base_swa=10000.0, **_QWEN),
    # phi3: fused q/k/v and gate/up, LongRoPE factors (long ones: contexts over 64), a window llama.cpp ignores
    "tiny-phi3": _tiny("phi3", "phi-3", tied_embeddings=False, sliding_window=8, original_context=64,
                       rope_attn_factor=1.19),
    "tiny-olmo2": _tiny_olmo2,
    # gemma4: sliding layers 0-2 and 4 (heads of 64, 2 KV heads, window 8), global 3 and 5 (heads of 128, one KV
    # head, no attn_v, a quarter of each head turned by proportional RoPE); layers 4 and 5 read layers 2's and
    # 3's keys and values and have FFNs twice as wide; per-layer embeddings of 32; final logits capped at 10
    "tiny-gemma4": _tiny("gemma4", "llama-spm", n_layer=6, n_head_kv=1, head_dim=128, rope_base_swa=10000.0,
                         sliding_window=8, final_softcap=10.0, **_QWEN,
                         gemma4=Gemma4Spec(swa=(True, True, True, False, True, False), head_dim_swa=64,
                                           n_head_kv_swa=2, rope_dims_swa=64, rotated_global=16, shared_kv_layers=2,
                                           n_embd_per_layer=32, k_eq_v_global=True, double_wide=True)),
    # olmo2 as OLMo 3: sliding-window layers (a window of 8, every third layer global) and YaRN on the global ones;
    # layout "ollama" writes it as Ollama's converter does (architecture olmo3, the pattern as one flag per layer)
    "tiny-olmo3": dataclasses.replace(_tiny_olmo2, n_layer=3, sliding_window=8, sliding_window_pattern=3,
                                      original_context=64, rope_scaling_type="yarn", rope_scaling_factor=8.0),
    # mistral3 as Ministral 3: YaRN and a query temperature that changes every 16 positions
    "tiny-mistral3": _tiny("mistral3", "llama-spm", head_dim=32, rope_base=1000000.0, yarn_log_mul=1.0,
                           attn_temperature_scale=0.1, **_YARN_16),
    # deepseek2 as DeepSeek V3: low-rank query, one dense layer then mixtures with a shared expert, sigmoid
    # routing with a selection bias in expert groups, YaRN from 16 positions with mscale_all_dim 0.707
    "tiny-deepseek2": dataclasses.replace(
        _tiny_deepseek2, yarn_log_mul=0.0707, **_YARN_16,
        mla=MLASpec(q_lora_rank=32, gating=2, weights_norm=True, weights_scale=2.5, selection_bias=True, groups=4,
                    groups_used=2)),
    # deepseek2 as GLM-4.7-Flash (llama.cpp converts it to deepseek2): low-rank query, the latent cache, one dense
    # layer then sigmoid-routed experts with a selection bias and no groups, normalised weights scaled by 1.8, a
    # shared expert, plain RoPE (theta 1e6) without YaRN, heads of 64 + 32 features with values of 96; layout
    # "ollama" writes Ollama's conversion (architecture glm4moelite)
    "tiny-glm4moelite": dataclasses.replace(
        _tiny_deepseek2, rope_base=1000000.0, eps=1e-5, n_ff_exp=32,
        mla=MLASpec(kv_lora_rank=64, q_lora_rank=32, nope=64, v_head=96, gating=2, weights_norm=True,
                    weights_scale=1.8, selection_bias=True)),
    # laguna as Laguna-XS.2: layer 0 full attention (4 heads of 32, half of each turned, YaRN from 64 positions,
    # theta 5e5), layers 1-3 sliding (window 8, 6 heads, 24 features turned by plain RoPE with theta 5e4: no
    # default of either converter's), 2 KV heads, q/k norms, a softplus gate per head on the attention output;
    # one dense layer, then sigmoid-routed experts with a selection bias, normalised weights scaled by 2.5, and a
    # shared expert of 64; layout "ollama" writes Ollama's conversion (attn_g, rope.swa.* keys, per-layer flags)
    "tiny-laguna": _tiny("laguna", "gpt-2", n_layer=4, head_dim=32, rope_base=500000.0, rope_base_swa=50000.0,
                         rope_dims=16, eps=1e-6, tied_embeddings=False, sliding_window=8, original_context=64,
                         rope_scaling_type="yarn", rope_scaling_factor=4.0, **_EXPERTS_8_2,
                         laguna=LagunaSpec(n_head_swa=6, rope_dims_swa=24, n_ff_shexp=64)),
    # lfm2: short convolutions (3 taps) with attention in layers 1 and 3, the output tied to token_embd
    "tiny-lfm2": _tiny_lfm2,
    # lfm2moe: tiny-lfm2's layers, the first dense, then mixtures of 8 experts (2 used, sigmoid routing)
    "tiny-lfm2moe": dataclasses.replace(_tiny_lfm2, arch="lfm2moe", leading_dense=1, **_EXPERTS_8_2),
    # nemotron_h: Mamba-2 (4 taps, 8 heads of 16, 2 groups of state 32), MLP and attention layers: "M-M*M-"
    "tiny-nemotron_h": _tiny_nemotron_h,
    # nemotron_h_moe: tiny-nemotron_h's layers, the MLPs mixtures of 8 ungated ReLU² experts (2 used, sigmoid
    # routing, selection bias, weights normalised and scaled) plus a shared expert as wide as n_ff
    "tiny-nemotron_h_moe": dataclasses.replace(_tiny_nemotron_h, arch="nemotron_h_moe", **_EXPERTS_8_2),
    # qwen3next: gated DeltaNet in layers 0-2 (2 key heads of 16, 4 value heads, 4 conv taps), gated full
    # attention in 3 (head size 32, RoPE over 8 dims), mixtures of 8 experts (2 used) with a gated shared expert
    "tiny-qwen3next": _tiny_qwen3next,
    # qwen35: tiny-qwen3next's layers with beta and alpha projected apart, multimodal RoPE (sections 2, 1, 1
    # of the 4 rotated pairs) and a SwiGLU FFN; qwen35moe: the same with tiny-qwen3next's mixtures
    "tiny-qwen35": dataclasses.replace(_tiny_qwen3next, arch="qwen35", rope_sections=(2, 1, 1, 0), n_expert=0,
                                       n_expert_used=0, n_ff_exp=0),
    "tiny-qwen35moe": dataclasses.replace(_tiny_qwen3next, arch="qwen35moe", rope_sections=(2, 1, 1, 0)),
    # gemma3n: 22 layers (llama.cpp shares keys from layer 20 on), every other one sliding (window 8), so that
    # layer 20 reads layer 18's keys and values and layer 21 layer 19's; activation sparsity in layers 0-9; the
    # first 4096 tokens of llama-spm (per-layer embeddings are 256 x 22 per token); final logits capped at 30
    "tiny-gemma3n": _tiny("gemma3n", "llama-spm", n_layer=22, n_vocab=4096, head_dim=32, rope_base_swa=10000.0,
                          sliding_window=8, final_softcap=30.0, gemma3n=Gemma3nSpec(shared_kv_layers=2, swa_pattern=2),
                          **_QWEN),
    "smollm2-135m": ModelSpec(arch="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, vocab="gpt-2",
                              context_length=8192, rope_base=100000.0),
    "llama-3.2-1b": ModelSpec(arch="llama", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192,
                              vocab="llama-bpe", context_length=131072, rope_base=500000.0, rope_freqs=True),
}
PRESETS: dict[str, ModelSpec] = {name: dataclasses.replace(spec, name=name) for name, spec in _PRESETS.items()}


def resolve_spec(arch_or_preset: str, **overrides: Any) -> ModelSpec:
    """A preset by name, or an architecture name for its tiny preset, with fields replaced."""
    name = f"tiny-{arch_or_preset}" if arch_or_preset in ARCHITECTURES else arch_or_preset
    if name not in PRESETS:
        raise ValueError(
            f"unknown synthetic model {arch_or_preset!r}: choose an architecture {ARCHITECTURES} "
            f"or a preset {tuple(PRESETS)}"
        )
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown synthetic model option(s) {unknown}: valid options are {sorted(fields)}")
    spec = dataclasses.replace(PRESETS[name], **overrides)
    _check(spec)
    return spec


def write_synthetic(
    path: str | os.PathLike[str],
    arch_or_preset: str,
    *,
    weight_type: str = "F32",
    seed: int = 0,
    vocab: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a synthetic model to `path` (atomically) and return the path.

    `vocab` names a llama.cpp vocab file (default: the preset's); `overrides` replace ModelSpec fields.
    """
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight type {weight_type!r}: choose one of {tuple(WEIGHT_TYPES)}")
    if vocab is not None:
        overrides["vocab"] = vocab
    spec = resolve_spec(arch_or_preset, **overrides)
    qtype, file_type = WEIGHT_TYPES[weight_type]
    tokenizer = _tokenizer_values(spec)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    tensors = list(_tensor_plan(spec, n_vocab, qtype))
    if spec.layout != "llama.cpp" and spec.arch == "gpt-oss":
        tensors = list(_ollama_gpt_oss(tensors, spec.layout))
    if spec.layout == "ollama" and spec.arch == "laguna":  # Ollama's name for the attention output gate
        tensors = [dataclasses.replace(t, name=t.name.replace(".attn_gate.", ".attn_g."), parts=(t,))
                   if ".attn_gate." in t.name else t for t in tensors]  # its data generated under the old name
    arch = _OLLAMA_NAMES[spec.arch] if spec.layout != "llama.cpp" else spec.arch

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        with contextlib.closing(gguf.GGUFWriter(partial, arch)) as writer:
            _add_hparams(writer, spec, n_vocab, file_type)
            for key, (value, vtype, etype) in tokenizer.items():
                writer.add_key_value(key, value, vtype, etype)
            for t in tensors:
                shape = t.shape[::-1]  # numpy order; the writer stores it reversed
                writer.add_tensor_info(t.name, shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.file_type_id)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t in tensors:  # one tensor in memory at a time
                writer.write_tensor_data(_generate(t, spec, seed))
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
    return path


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first)
    kind: str  # "matrix", "table" (a matrix kept F32), "norm", "bias" or "rope_freqs"
    qtype: GGMLQuantizationType
    parts: tuple[_Tensor, ...] = ()  # a fused tensor's: their data concatenated along its last dimension
    interleave: bool = False  # the parts' rows (dimension 1 from the end) alternate instead
    conversion: Conversion | None = None  # stored in the file as Ollama's older files store it

    @property
    def file_type_id(self) -> int:
        return int(self.qtype) if self.conversion is None else self.conversion.file_type_id

    @property
    def n_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype if self.conversion is None else self.conversion.file_type]
        return math.prod(self.shape) // block_size * type_size


def _check(spec: ModelSpec) -> None:
    if spec.embedding_type is not None and spec.embedding_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown embedding type {spec.embedding_type!r}: choose one of {tuple(WEIGHT_TYPES)}")
    if spec.layout not in ("llama.cpp", "ollama", "ollama-qkv", "ollama-2025-09", "ollama-2025-08") or (
            spec.layout != "llama.cpp" and spec.arch != "gpt-oss"
            and (spec.arch, spec.layout) not in (("olmo2", "ollama"), ("deepseek2", "ollama"), ("laguna", "ollama"),
                                               ("qwen2vl", "ollama"))):
        raise ValueError(f"{spec.name}: layout {spec.layout!r}: llama.cpp, or ollama, ollama-qkv, ollama-2025-09 "
                         "or ollama-2025-08 for gpt-oss, ollama for olmo2, deepseek2, laguna and qwen2vl")
    if spec.arch == "laguna" and spec.layout == "ollama" and spec.laguna.gate_per_element:
        raise ValueError(f"{spec.name}: Ollama's laguna gates per head only")
    if spec.arch == "deepseek2" and spec.layout == "ollama" and (spec.mla.kv_b or spec.rope_scaling_type):
        raise ValueError(f"{spec.name}: Ollama's glm4moelite has attn_k_b/attn_v_b and no rope scaling")
    if spec.expert_type is not None and spec.expert_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown expert type {spec.expert_type!r}: choose one of {tuple(WEIGHT_TYPES)}")
    if spec.arch not in ARCHITECTURES:
        raise ValueError(f"unsupported synthetic architecture {spec.arch!r}: choose one of {ARCHITECTURES}")
    if min(spec.n_layer, spec.n_embd, spec.n_head, spec.n_head_kv, spec.n_ff, spec.n_rot) < 1:
        raise ValueError(f"{spec.name}: sizes must be positive: {spec}")
    if spec.n_head % spec.n_head_kv:
        raise ValueError(f"{spec.name}: n_head {spec.n_head} is not a multiple of n_head_kv {spec.n_head_kv}")
    if spec.arch in _ROPE_ARCHITECTURES and spec.n_rot % 2:
        raise ValueError(f"{spec.name}: head_dim {spec.n_rot} must be even for RoPE")
    if spec.arch in ("qwen2", "qwen2vl", *_BERT_ARCHITECTURES) and spec.n_rot * spec.n_head != spec.n_embd:
        raise ValueError(f"{spec.name}: {spec.arch} needs head_dim * n_head == n_embd")
    if spec.arch in _BERT_ARCHITECTURES and spec.n_head_kv != spec.n_head:
        raise ValueError(f"{spec.name}: {spec.arch} needs n_head_kv == n_head")
    if spec.arch == "nomic-bert-moe" and (spec.moe_every < 1 or spec.n_ff_exp != spec.n_ff):
        raise ValueError(f"{spec.name}: nomic-bert-moe needs moe_every >= 1 and experts as wide as the FFN "
                         "(n_ff_exp == n_ff: llama.cpp sizes them by feed_forward_length)")
    if (spec.arch == "deepseek2") != (spec.mla is not None):
        raise ValueError(f"{spec.name}: mla options are deepseek2's, and deepseek2 needs them")
    if spec.mla is not None and spec.n_head_kv != (spec.n_head if spec.mla.kv_b else 1):
        raise ValueError(f"{spec.name}: deepseek2 needs n_head_kv 1 (n_head with kv_b)")
    if (spec.arch == "gemma4") != (spec.gemma4 is not None) or (
            spec.gemma4 is not None and len(spec.gemma4.swa) != spec.n_layer):
        raise ValueError(f"{spec.name}: gemma4 options are gemma4's, and gemma4 needs them (a flag per layer)")
    if (spec.arch == "laguna") != (spec.laguna is not None):
        raise ValueError(f"{spec.name}: laguna options are laguna's, and laguna needs them")
    mixture = spec.arch in _MOE_ARCHITECTURES or spec.n_expert
    if mixture and not (0 < spec.n_expert_used <= spec.n_expert and spec.n_ff_exp > 0):
        raise ValueError(f"{spec.name}: a mixture of experts needs 0 < n_expert_used <= n_expert and n_ff_exp > 0")


def _tensor_plan(spec: ModelSpec, n_vocab: int, qtype: GGMLQuantizationType) -> Iterator[_Tensor]:
    """Every tensor the architecture's model reads (declared.py), with its ggml shape and type, in the file's
    order. Matrices get the weight type (token_embd and output the spec's embedding_type, stacked experts its
    expert_type, where it names one); the other kinds stay F32, as llama.cpp's quantizer leaves them."""
    for name, shape, kind in declared_tensors(spec, n_vocab):
        own = qtype
        if kind == "embedding":
            kind, own = "matrix", WEIGHT_TYPES[spec.embedding_type][0] if spec.embedding_type else qtype
        if kind == "expert":
            kind, own = "matrix", WEIGHT_TYPES[spec.expert_type][0] if spec.expert_type else qtype
        if kind != "matrix":
            yield _Tensor(name, shape, kind, GGMLQuantizationType.F32)
            continue
        block_size = GGML_QUANT_SIZES[own][0]
        if shape[0] % block_size:
            raise ValueError(f"{spec.name}: {name} has rows of {shape[0]}, not a multiple of the {own.name} block "
                             f"size {block_size}; choose sizes that are")
        yield _Tensor(name, shape, kind, own)


def _add_gemma3n_hparams(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """gemma3n's keys as llama.cpp's converter writes them: the pattern as a flag per layer, AltUp's, the
    per-layer width, the shared layers, and each layer's sparsity as the normal quantile of 0.95 (or of 0)."""
    g, n = spec.gemma3n, spec.gemma3n.swa_pattern
    writer.add_array(f"{writer.arch}.attention.sliding_window_pattern",
                     [i % n < n - 1 for i in range(spec.n_layer)])
    writer.add_uint32(f"{writer.arch}.altup.active_idx", 0)
    writer.add_uint32(f"{writer.arch}.altup.num_inputs", g.altup)
    writer.add_uint32(f"{writer.arch}.embedding_length_per_layer_input", g.per_layer)
    writer.add_uint32(f"{writer.arch}.attention.shared_kv_layers", g.shared_kv_layers)
    quantile = float(np.float32(1.6448533535003662))
    writer.add_array(f"{writer.arch}.activation_sparsity_scale",
                     [quantile if i < g.sparse_layers else -math.inf for i in range(spec.n_layer)])


def _ollama_gpt_oss(tensors: list[_Tensor], layout: str) -> Iterator[_Tensor]:
    """gpt-oss's tensors as Ollama's converter names them (model/models/gptoss in Ollama), with the same
    data: attn_out, attn_sinks, ffn_norm; but in layout "ollama", q, k and v (and their biases) in one
    attn_qkv. Its files until October 2025 (convert_gptoss.go before commits c00fa9cc2 and 93085127f) have
    gate and up (and their biases) in one ffn_gate_up_exps with their rows interleaved (gate row k is row
    2k, up row k row 2k + 1) and the experts' biases in BF16; until 26 August 2025 (commit 59412fbb4)
    their MXFP4 experts are in OpenAI's nibble order under type id 4."""
    renames = {".attn_output.": ".attn_out.", ".attn_sinks.weight": ".attn_sinks",
               ".post_attention_norm.": ".ffn_norm."}
    fuse_qkv, old = layout != "ollama", layout in ("ollama-2025-08", "ollama-2025-09")
    by_name = {t.name: t for t in tensors}
    for t in tensors:
        name = t.name
        for before, after in renames.items():
            name = name.replace(before, after)
        conversion = _old_conversion(t, openai_mxfp4=layout == "ollama-2025-08") if old else None
        if fuse_qkv and ".attn_q." in name:
            parts = tuple(by_name[name.replace(".attn_q.", f".attn_{p}.")] for p in "qkv")
            shape = (*t.shape[:-1], sum(p.shape[-1] for p in parts))
            yield _Tensor(name.replace(".attn_q.", ".attn_qkv."), shape, t.kind, t.qtype, parts)
        elif old and ".ffn_gate_exps." in name:
            parts = (t, by_name[t.name.replace(".ffn_gate_exps.", ".ffn_up_exps.")])
            shape = (*t.shape[:-2], 2 * t.shape[-2], t.shape[-1])
            yield _Tensor(name.replace(".ffn_gate_exps.", ".ffn_gate_up_exps."), shape, t.kind, t.qtype, parts,
                          interleave=True, conversion=conversion)
        elif not (fuse_qkv and (".attn_k." in name or ".attn_v." in name)) and not (old and ".ffn_up_exps." in name):
            yield dataclasses.replace(t, name=name, parts=(t,), conversion=conversion)  # seeded by the llama.cpp name


def _old_conversion(t: _Tensor, openai_mxfp4: bool) -> Conversion | None:
    """How Ollama's gpt-oss files of August to October 2025 store the tensor, where not as ggml has it."""
    if "_exps.bias" in t.name:
        return Conversion.BF16_TO_F32
    mxfp4 = openai_mxfp4 and "_exps." in t.name and t.qtype == GGMLQuantizationType.MXFP4
    return Conversion.OPENAI_MXFP4 if mxfp4 else None


def _laguna_heads(spec: ModelSpec) -> list[int]:
    """Query heads per layer (ModelSpec.layer_heads)."""
    return [spec.layer_heads(i) for i in range(spec.n_layer)]


def _add_laguna_hparams(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """laguna's keys as llama.cpp's converter writes them (beyond the common ones), or as Ollama's does (layout
    "ollama": its rope.swa.* keys, the pattern as flags and layer types, YaRN's betas and attention factor
    written out, here llama.cpp's values, so that both files compute alike)."""
    lag = spec.laguna
    writer.add_leading_dense_block_count(lag.leading_dense)
    writer.add_expert_shared_feed_forward_length(lag.n_ff_shexp)
    writer.add_expert_weights_norm(True)
    writer.add_expert_weights_scale(lag.weights_scale)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if spec.layout != "ollama":
        writer.add_rope_dimension_count_swa(lag.rope_dims_swa)
        return
    prefix = f"{writer.arch}."
    sliding = [spec.sliding_window is not None and i % 4 != 0 for i in range(spec.n_layer)]
    writer.add_bool(prefix + "attention.sink_enabled", False)
    writer.add_array(prefix + "attention.sliding_window_pattern", sliding)
    writer.add_array(prefix + "attention.layer_types", [int(s) for s in sliding])
    writer.add_uint32(prefix + "attention.gating_type", 1)
    writer.add_bool(prefix + "attention.qk_norm", True)
    writer.add_uint32(prefix + "expert_shared_count", 1)
    writer.add_uint32(prefix + "decoder_sparse_step", 1)
    if lag.leading_dense:
        writer.add_array(prefix + "dense_layers", list(range(lag.leading_dense)))
    writer.add_string(prefix + "rope.scaling.type", spec.rope_scaling_type or "")
    for key, value in (("rope.scaling.beta_fast", 32.0), ("rope.scaling.beta_slow", 1.0),
                       ("rope.scaling.attn_factor", 1.0), ("rope.swa.freq_base", spec.rope_base_swa or 10000.0),
                       ("rope.swa.scaling.factor", 1.0)):
        writer.add_float32(prefix + key, value)
    writer.add_string(prefix + "rope.swa.scaling.type", "linear")
    writer.add_uint32(prefix + "rope.swa.dimension_count", lag.rope_dims_swa)


def _add_mla_hparams(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """deepseek2's keys as llama.cpp's converter writes them (key/value lengths: the cached latent's)."""
    mla = spec.mla
    writer.add_leading_dense_block_count(mla.leading_dense)
    writer.add_q_lora_rank(mla.q_lora_rank)  # 0 for a direct query: llama.cpp requires the key (V2-Lite aside)
    writer.add_kv_lora_rank(mla.kv_lora_rank)
    if mla.kv_b:
        writer.add_key_length(mla.nope + spec.n_rot)
        writer.add_value_length(mla.v_head)
    elif spec.layout == "ollama":  # Ollama's glm4moelite: a head's lengths, the latent's as *_mla
        writer.add_key_length(mla.nope + spec.n_rot)
        writer.add_value_length(mla.v_head)
        writer.add_key_length_mla(mla.kv_lora_rank + spec.n_rot)
        writer.add_value_length_mla(mla.kv_lora_rank)
    else:
        writer.add_key_length(mla.kv_lora_rank + spec.n_rot)
        writer.add_value_length(mla.kv_lora_rank)
        writer.add_key_length_mla(mla.nope + spec.n_rot)
        writer.add_value_length_mla(mla.v_head)
    writer.add_expert_shared_count(mla.n_shared)
    writer.add_expert_weights_scale(mla.weights_scale)
    writer.add_expert_weights_norm(mla.weights_norm)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType(mla.gating))
    if mla.groups:
        writer.add_expert_group_count(mla.groups)
        writer.add_expert_group_used_count(mla.groups_used)
    if mla.temperature_length:
        writer.add_attn_temperature_length(mla.temperature_length)


def _add_gemma4_hparams(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """What llama.cpp's Gemma4Model converter writes beside the common keys."""
    g = spec.gemma4
    writer.add_head_count_kv([g.n_head_kv_swa if swa else spec.n_head_kv for swa in g.swa])
    writer.add_key_length_swa(g.head_dim_swa)
    writer.add_value_length_swa(g.head_dim_swa)
    writer.add_rope_dimension_count_swa(g.rope_dims_swa)
    writer.add_sliding_window_pattern(list(g.swa))
    writer.add_shared_kv_layers(g.shared_kv_layers)
    writer.add_embedding_length_per_layer_input(g.n_embd_per_layer)


def _add_hparams(writer: gguf.GGUFWriter, spec: ModelSpec, n_vocab: int, file_type: int) -> None:
    """The keys llama.cpp's converters write for the architecture."""
    writer.add_name(spec.name)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    if spec.arch in ("nemotron_h", "nemotron_h_moe"):  # one entry per layer: 0 but for the MLP layers
        width = spec.n_ff_exp if spec.arch == "nemotron_h_moe" else spec.n_ff
        writer.add_feed_forward_length([width if i in spec.mlp_layers else 0 for i in range(spec.n_layer)])
    else:
        writer.add_feed_forward_length([spec.layer_ff(i) for i in range(spec.n_layer)] if spec.gemma4 else spec.n_ff)
    writer.add_head_count(_laguna_heads(spec) if spec.arch == "laguna" else spec.n_head)
    if spec.arch in ("nemotron_h", "nemotron_h_moe"):  # head_count_kv 0 but in attention layers; Mamba-2 sizes
        writer.add_head_count_kv([spec.n_head_kv if i in spec.attention_layers else 0 for i in range(spec.n_layer)])
        writer.add_ssm_conv_kernel(spec.conv_width)
        writer.add_ssm_inner_size(spec.ssm_inner)
        writer.add_ssm_state_size(spec.ssm_state)
        writer.add_ssm_time_step_rank(spec.ssm_heads)
        writer.add_ssm_group_count(spec.ssm_groups)
        writer.add_key_length(spec.n_rot)
        writer.add_value_length(spec.n_rot)
        writer.add_layer_norm_eps(spec.eps)
        if spec.arch == "nemotron_h_moe":  # as the converter writes Nemotron 3 Nano's
            writer.add_expert_shared_feed_forward_length(spec.n_ff)
            writer.add_expert_shared_count(1)
            writer.add_expert_weights_norm(True)
            writer.add_expert_weights_scale(2.5)
            writer.add_expert_group_count(1)
    elif spec.arch in ("qwen3next", "qwen35", "qwen35moe"):
        writer.add_head_count_kv(spec.n_head_kv)
        if spec.rope_sections:
            writer.add_rope_dimension_sections(list(spec.rope_sections))
        writer.add_ssm_conv_kernel(spec.conv_width)
        writer.add_ssm_state_size(spec.ssm_state)
        writer.add_ssm_group_count(spec.ssm_groups)
        writer.add_ssm_time_step_rank(spec.ssm_heads)
        writer.add_ssm_inner_size(spec.ssm_inner)
        writer.add_full_attention_interval(spec.full_attention_interval)
    elif spec.arch in ("lfm2", "lfm2moe"):  # one entry per layer, 0 for a short convolution
        writer.add_head_count_kv([spec.n_head_kv if i in spec.attention_layers else 0 for i in range(spec.n_layer)])
        writer.add_uint32(f"{writer.arch}.shortconv.l_cache", spec.conv_width)
        if spec.arch == "lfm2moe":
            writer.add_leading_dense_block_count(spec.leading_dense)
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    elif spec.gemma4 is not None:
        _add_gemma4_hparams(writer, spec)
    elif spec.mla is not None and spec.layout == "ollama":
        writer.add_head_count_kv(spec.n_head)  # Ollama's glm4moelite: the checkpoint's num_key_value_heads
    else:
        writer.add_head_count_kv(spec.n_head_kv)
    writer.add_vocab_size(n_vocab)
    if spec.arch in _BERT_ARCHITECTURES:
        writer.add_layer_norm_eps(spec.eps)
        writer.add_causal_attention(False)
        writer.add_pooling_type(gguf.PoolingType(spec.pooling_type))
        if spec.arch in ("nomic-bert", "nomic-bert-moe"):
            writer.add_rope_freq_base(spec.rope_base)
        if spec.arch == "nomic-bert-moe":
            writer.add_expert_count(spec.n_expert)
            writer.add_expert_used_count(spec.n_expert_used)
            writer.add_uint32(f"{spec.arch}.moe_every_n_layers", spec.moe_every)
        return
    writer.add_layer_norm_rms_eps(spec.eps)
    if spec.n_expert:
        writer.add_expert_count(spec.n_expert)
        writer.add_expert_used_count(spec.n_expert_used)
        writer.add_expert_feed_forward_length(spec.n_ff_exp)
        if spec.arch == "llama4":
            writer.add_uint32(f"{writer.arch}.interleave_moe_layer_step", spec.moe_every)
        if spec.arch in ("qwen2moe", "qwen3next", "qwen35moe"):
            writer.add_expert_shared_feed_forward_length(spec.n_ff)
    writer.add_rope_freq_base(spec.rope_base)
    writer.add_rope_dimension_count(spec.rope_dims or spec.n_rot)
    if spec.arch == "qwen2vl" and spec.layout == "ollama":  # Ollama's converter: Hugging Face's 3 sections
        writer.add_array(f"{writer.arch}.rope.mrope_section", list(spec.rope_sections[:3]))
    elif spec.arch == "qwen2vl":
        writer.add_rope_dimension_sections(list(spec.rope_sections))
    if spec.laguna is not None:
        _add_laguna_hparams(writer, spec)
    if spec.mla is not None:
        _add_mla_hparams(writer, spec)
    elif spec.n_rot != spec.n_embd // spec.n_head:
        writer.add_key_length(spec.n_rot)
        writer.add_value_length(spec.n_rot)
    if spec.sliding_window is not None:
        writer.add_uint32(f"{writer.arch}.attention.sliding_window", spec.sliding_window)
    if spec.sliding_window_pattern is not None and writer.arch == "olmo3":  # Ollama's: a flag per layer
        n = spec.sliding_window_pattern
        writer.add_array(f"{writer.arch}.attention.sliding_window_pattern",
                         [n == 0 or i % n < n - 1 for i in range(spec.n_layer)])
    elif spec.sliding_window_pattern is not None:
        writer.add_uint32(f"{writer.arch}.attention.sliding_window_pattern", spec.sliding_window_pattern)
    for key, value in (("rope.freq_base_swa", spec.rope_base_swa), ("attn_logit_softcapping", spec.attn_softcap),
                       ("final_logit_softcapping", spec.final_softcap)):
        if value is not None:
            writer.add_float32(f"{writer.arch}.{key}", value)
    if spec.original_context is not None:
        writer.add_rope_scaling_orig_ctx_len(spec.original_context)
    if spec.rope_scaling_type is not None and spec.layout == "llama.cpp":
        writer.add_rope_scaling_type(gguf.RopeScalingType(spec.rope_scaling_type))
    for key, value in (("rope.scaling.factor", spec.rope_scaling_factor), ("rope.scaling.attn_factor",
                       spec.rope_attn_factor), ("rope.scaling.yarn_log_multiplier", spec.yarn_log_mul),
                       ("attention.temperature_scale", spec.attn_temperature_scale)):
        if value is not None:
            writer.add_float32(f"{writer.arch}.{key}", value)
    if spec.gemma3n is not None:
        _add_gemma3n_hparams(writer, spec)



def _tokenizer_values(spec: ModelSpec) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    """tokenizer.* keys of the vocab file with their GGUF types, padded to spec.n_vocab tokens."""
    vocab_dir = paths.llama_cpp_source() / "models"
    vocab_path = vocab_dir / f"ggml-vocab-{spec.vocab}.gguf"
    if not vocab_path.exists():
        available = sorted(
            p.name[len("ggml-vocab-") : -len(".gguf")] for p in vocab_dir.glob("ggml-vocab-*.gguf")
        )
        raise ValueError(f"no llama.cpp vocab {spec.vocab!r} ({vocab_path}); available: {available}")
    source = GGUFFile.open(vocab_path)
    values = {
        key: (value, *source.value_types[key]) for key, value in source.metadata.items() if key.startswith("tokenizer.")
    }
    if (spec.arch in _BERT_ARCHITECTURES and "tokenizer.ggml.token_type_count" not in values) or spec.arch == "bert":
        values["tokenizer.ggml.token_type_count"] = (2, GGUFValueType.UINT32, None)  # bert: token_types' 2 rows

    n_tokens = len(values["tokenizer.ggml.tokens"][0])
    n_vocab = spec.n_vocab if spec.n_vocab is not None else n_tokens
    if n_vocab < n_tokens:  # a SentencePiece vocabulary may keep its first n_vocab pieces: specials, bytes, ...
        kept = [values[k][0] for k in values if k.endswith("_token_id")] + [
            i for i, t in enumerate(values["tokenizer.ggml.token_type"][0]) if t == gguf.TokenType.BYTE]
        if values["tokenizer.ggml.model"][0] != "llama" or any(t >= n_vocab for t in kept):
            raise ValueError(f"{spec.name}: n_vocab {n_vocab} is smaller than the {spec.vocab} vocab ({n_tokens})")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value, vtype, etype = values[key]
            values[key] = (value[:n_vocab], vtype, etype)
        n_tokens = n_vocab
    n_pad = n_vocab - n_tokens
    padding = {
        "tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(n_tokens, n_vocab)],
        "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * n_pad,
        "tokenizer.ggml.scores": [0.0] * n_pad,
    }
    for key, extra in padding.items():
        if n_pad and key in values:
            value, vtype, etype = values[key]
            values[key] = (value + extra, vtype, etype)
    return values


def _generate(t: _Tensor, spec: ModelSpec, seed: int) -> np.ndarray:
    """The tensor's data, encoded in its type (converted as the file stores it), as GGUFWriter writes it."""
    if t.parts:
        parts = [_generate(part, spec, seed).view(np.uint8) for part in t.parts]
        if t.interleave:  # (outer, rows, row bytes) each; row r of part p becomes row len(parts) r + p
            rows = t.shape[-2] // len(parts)
            data = np.stack([p.reshape(t.shape[-1], rows, -1) for p in parts], axis=2).reshape(-1)
        else:
            data = np.concatenate([p.reshape(-1) for p in parts])
    else:
        data = _values(t, spec, seed)
    return data if t.conversion is None else _stored(t.conversion, data.view(np.uint8).reshape(-1))


def _stored(conversion: Conversion, data: np.ndarray) -> np.ndarray:
    """ggml's bytes `data` as the file stores them: the inverse of Conversion.convert."""
    if conversion is Conversion.BF16_TO_F32:  # values BF16 holds exactly (_values rounds them)
        return (data.view("<u4") >> 16).astype("<u2")
    blocks = data.reshape(-1, 17)  # the scale, then qs[j] = element j | element j + 16 << 4
    elements = np.concatenate((blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4), axis=1).reshape(-1, 16, 2)
    out = np.empty_like(blocks)
    out[:, 0] = blocks[:, 0]
    out[:, 1:] = elements[:, :, 0] | (elements[:, :, 1] << 4)  # byte i = element 2i | element 2i + 1 << 4
    return out


def _values(t: _Tensor, spec: ModelSpec, seed: int) -> np.ndarray:
    """A tensor's data as ggml has it, generated from (seed, its name)."""
    if t.kind == "proportional":  # gemma4's global layers: the first pairs turn, the others (1e30) stand still
        rotated = spec.gemma4.rotated_global
        return np.array([1.0] * rotated + [1e30] * (t.shape[0] - rotated), dtype=np.float32)
    if t.kind == "rope_freqs":
        if "rope_factors_" in t.name:  # phi3's: long ones rising from 1 to 16, short ones near 1
            return (np.geomspace(1.0, 16.0, t.shape[0]) if "long" in t.name else np.linspace(1.0, 1.3, t.shape[0])
                    ).astype(np.float32)
        return _llama3_rope_factors(spec)
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    if t.kind == "sinks":  # attention sinks: logits of the scores' size
        return rng.standard_normal(t.shape, dtype=np.float32)
    if t.kind == "decay":  # Mamba-2's A = -exp(A_log): negative, one per head
        return -np.exp(rng.uniform(math.log(0.1), math.log(2.0), t.shape)).astype(np.float32)
    if t.kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(t.shape, dtype=np.float32)).astype(np.float32)
    if t.kind == "bias":
        bias = 0.1 * rng.standard_normal(t.shape, dtype=np.float32)
        # gpt-oss's expert biases are BF16 in some of Ollama's files: the same values in every layout
        return _round_bf16(bias) if spec.arch == "gpt-oss" and "_exps." in t.name else bias

    cols, rows = t.shape[0], math.prod(t.shape[1:])
    scale = np.float32(1.0 / math.sqrt(cols))
    out: np.ndarray | None = None
    step = max(1, _CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        chunk = _encode(rng.standard_normal((n, cols), dtype=np.float32) * scale, t.qtype)
        if out is None:
            out = np.empty((rows, chunk.shape[1]), dtype=chunk.dtype)
        out[start : start + n] = chunk
    assert out is not None
    return out


def _round_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest BF16 (ties to even), as float32."""
    bits = values.view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype("<u4").view(np.float32)


def _encode(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return data
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    # ggml's own quantizers, as llama-quantize's (lazy import: the bindings may not be built). IQ1_S,
    # IQ2_XXS and IQ2_XS need an importance matrix: a uniform one, as activations of unit variance give.
    from ollama_engine.ggml import quantize, requires_importance

    importance = np.ones(data.shape[1], dtype=np.float32) if requires_importance(int(qtype)) else None
    return quantize(int(qtype), data, importance).reshape(data.shape[0], -1)


def _llama3_rope_factors(spec: ModelSpec) -> np.ndarray:
    """Llama 3.1/3.2 rope scaling (factor 32, low 1, high 4, original context 8192), as the converter."""
    factor, low_freq_factor, high_freq_factor, old_context = 32.0, 1.0, 4.0, 8192
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    dim = spec.n_rot
    freqs = 1.0 / (spec.rope_base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
