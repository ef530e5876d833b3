"""Mixture-of-experts feed-forward: a router picks each token's top experts, whose outputs are mixed.

As llama.cpp's build_moe_ffn: the router's logits (n_expert, n) become probabilities (softmax or
sigmoid, or are kept raw and softmaxed over the chosen experts only), the n_used largest pick the
experts (descending, so the experts' outputs are summed in llama.cpp's order), their probabilities
are optionally normalised to sum to 1 and scaled, and each chosen expert's gated FFN runs through
ggml_mul_mat_id on the stacked expert matrices (n_embd, n_ff, n_expert). Llama 4 weighs each chosen
expert's input instead of its output (Routing.weight_before_ffn). DeepSeek V3 adds a per-expert bias
(exp_probs_b) to the probabilities that pick the experts, not to their weights, and may first keep only
the expert groups whose two best experts score highest (Routing.groups). Shared experts are plain FFNs
that the models add themselves. The expert weights are ordinary layer tensors (blk.N.ffn_*_exps), so the memory
report counts them with their layer. Ollama's gpt-oss files of August to October 2025 fuse gate and up into one
stack (ffn_gate_up_exps, rows interleaved as OpenAI's checkpoint has them: gate row k is row 2k, up row k is
row 2k + 1): one mul_mat_id, then the gate and up halves taken out of its result, as Ollama's gptoss model.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

from ollama_engine.fs import Config
from ollama_engine.ml import Backend, Tensor

from .alone import matmul_alone
from .base import ModelError, bind, require_uint, weight


class Gating(enum.Enum):
    """How router logits become expert weights (llama.cpp's llama_expert_gating_func_type)."""

    SOFTMAX = "softmax"  # softmax over all experts, then pick
    SIGMOID = "sigmoid"  # each expert's sigmoid, then pick
    SOFTMAX_WEIGHT = "softmax_weight"  # pick by raw logits, softmax over the chosen ones (gpt-oss)


@dataclasses.dataclass
class Experts:
    """One layer's router and stacked experts; the biases are gpt-oss's."""

    router: Tensor = weight("ffn_gate_inp.weight")
    router_bias: Tensor | None = weight("ffn_gate_inp.bias", optional=True)
    gate: Tensor | None = weight("ffn_gate_exps.weight", optional=True)  # None: ungated (nomic-bert-moe)
    gate_bias: Tensor | None = weight("ffn_gate_exps.bias", optional=True)
    up: Tensor | None = weight("ffn_up_exps.weight", optional=True)  # None: fused in gate_up
    up_bias: Tensor | None = weight("ffn_up_exps.bias", optional=True)
    down: Tensor = weight("ffn_down_exps.weight")
    down_bias: Tensor | None = weight("ffn_down_exps.bias", optional=True)
    # DeepSeek V3's, and Ollama's fused gate and up (interleaved rows); last and defaulted, so that Experts
    # built by hand (tests) may leave them out
    selection_bias: Tensor | None = dataclasses.field(
        default=None, metadata={"gguf": "exp_probs_b.bias", "optional": True})
    gate_up: Tensor | None = dataclasses.field(
        default=None, metadata={"gguf": "ffn_gate_up_exps.weight", "optional": True})
    gate_up_bias: Tensor | None = dataclasses.field(
        default=None, metadata={"gguf": "ffn_gate_up_exps.bias", "optional": True})
    # a scale per expert on its output (Gemma 4's per_expert_scale, llama.cpp's ffn_down_exps_s)
    down_scale: Tensor | None = dataclasses.field(
        default=None, metadata={"gguf": "ffn_down_exps.scale", "optional": True})


@dataclasses.dataclass(frozen=True)
class Routing:
    n_expert: int
    n_used: int
    gating: Gating
    normalize: bool  # make the chosen experts' weights sum to 1
    scale: float = 1.0  # expert_weights_scale; 0 and 1 leave the weights as they are
    weight_before_ffn: bool = False  # Llama 4: pick by raw logit, weigh each expert's input, not its output
    groups: int = 1  # expert_group_count: > 1 picks only from the groups_used best groups of experts
    groups_used: int = 0

    @classmethod
    def from_config(cls, config: Config, gating: Gating, normalize: bool, scale: float = 1.0,
                    weight_before_ffn: bool = False) -> Routing:
        n_expert = require_uint(config, "expert_count")
        n_used = require_uint(config, "expert_used_count")
        if not 0 < n_used <= n_expert:
            raise ModelError(f"{config.full_key('expert_used_count')} {n_used} must be in 1..expert_count {n_expert}")
        groups = config.get_uint("expert_group_count", 0)
        groups_used = config.get_uint("expert_group_used_count", 0)
        if groups > 1 and (n_expert % groups or n_expert // groups < 2 or not 0 < groups_used <= groups
                           or groups_used * (n_expert // groups) < n_used):
            raise ModelError(f"{config.full_key('expert_group_count')} {groups} (used {groups_used}) does not "
                             f"split expert_count {n_expert} into groups of 2 or more holding {n_used} used experts")
        return cls(n_expert, n_used, gating, normalize, scale, weight_before_ffn, max(groups, 1), groups_used)


def bind_experts(backend: Backend, layer: int, routing: Routing, n_embd: int, gated: bool = True) -> Experts:
    """Layer `layer`'s experts, their shapes checked against the routing and the embedding length: ggml
    aborts on an expert id beyond a stack (mul_mat_id, add_id, get_rows) and on a stack that is not 3-d.
    gated=False: the architecture's experts have no gate (nomic-bert-moe); otherwise gate and up, or both
    fused in gate_up, are required."""
    experts = bind(Experts, backend, f"blk.{layer}.")
    required = () if gated and experts.gate_up is not None else ("gate", "up") if gated else ("up",)
    for name in required:
        if getattr(experts, name) is None:
            raise ModelError(f"model is missing required tensor blk.{layer}.ffn_{name}_exps.weight")
    n_ff, e = (experts.down.shape + (-1,))[0], routing.n_expert
    expected = {"router": (n_embd, e), "router_bias": (e,), "gate": (n_embd, n_ff, e), "gate_bias": (n_ff, e),
                "up": (n_embd, n_ff, e), "up_bias": (n_ff, e), "down": (n_ff, n_embd, e), "down_bias": (n_embd, e),
                "selection_bias": (e,), "gate_up": (n_embd, 2 * n_ff, e), "gate_up_bias": (2 * n_ff, e),
                "down_scale": (e,)}
    for field in dataclasses.fields(Experts):
        tensor = getattr(experts, field.name)
        if tensor is not None and tensor.shape != expected[field.name]:
            raise ModelError(f"tensor blk.{layer}.{field.metadata['gguf']} has shape {list(tensor.shape)}, expected "
                             f"{list(expected[field.name])} (embedding_length {n_embd}, expert_count {e})")
    return experts


Activation = Callable[[Tensor, Tensor | None], Tensor]
"""gate, up -> activated (n_ff, n_used, n): SwiGLU by default; ungated experts give (up, None)."""


def moe(x: Tensor, experts: Experts, routing: Routing, layer: int, activation: Activation = Tensor.silu, *,
        router_input: Tensor | None = None, gate_up_halves: bool = False, rows: Sequence[int] = ()) -> Tensor:
    """The mixture's output (n_embd, n) for the normed hidden states x (n_embd, n).

    router_input: what the router reads where it is not x (Gemma 4 routes on its own norm of the residual).
    gate_up_halves: a fused gate_up stack holds gate then up in each row's two halves (llama.cpp's layout),
    not interleaved rows (Ollama's gpt-oss).
    rows: the batch's rows per sequence (alone.sequence_rows): a float router then rounds each sequence's
    logits as its batch alone would (alone.matmul_alone); without them the router is one product.
    """
    n_embd, n = x.ne[0], x.ne[1]
    r = routing
    logits = matmul_alone(experts.router, x if router_input is None else router_input, rows)  # (n_expert, n)
    logits.set_name(f"ffn_moe_logits-{layer}")
    if experts.router_bias is not None:
        logits = logits.add(experts.router_bias)
    if r.gating == Gating.SOFTMAX:
        probs = logits.softmax()
    elif r.gating == Gating.SIGMOID:
        probs = logits.sigmoid()
    else:
        probs = logits
    probs.set_name(f"ffn_moe_probs-{layer}")
    selection = logits if r.weight_before_ffn else probs  # Llama 4 applies the sigmoid after picking
    if experts.selection_bias is not None:  # picks by biased probabilities; the weights stay unbiased
        selection = probs.add(experts.selection_bias).set_name(f"ffn_moe_probs_biased-{layer}")
    if r.groups > 1:
        selection = _best_groups(selection, r, layer)
    selected = selection.argsort_top_k(r.n_used).set_name(f"ffn_moe_topk-{layer}")  # (n_used, n), I32
    weights = probs.reshape(1, r.n_expert, n).rows(selected).set_name(f"ffn_moe_weights-{layer}")  # (1, n_used, n)
    if r.gating == Gating.SOFTMAX_WEIGHT:
        weights = weights.reshape(r.n_used, n).softmax().reshape(1, r.n_used, n)
        weights.set_name(f"ffn_moe_weights_softmax-{layer}")
    if r.normalize:
        flat = weights.reshape(r.n_used, n)
        total = flat.sum_rows().set_name(f"ffn_moe_weights_sum-{layer}")
        total = total.clamp(6.103515625e-5, float("inf"))  # the smallest normal F16, as llama.cpp
        weights = flat.div(total.set_name(f"ffn_moe_weights_sum_clamped-{layer}"))
        weights = weights.set_name(f"ffn_moe_weights_norm-{layer}").reshape(1, r.n_used, n)
    if r.scale not in (0.0, 1.0):
        weights = weights.scale(r.scale).set_name(f"ffn_moe_weights_scaled-{layer}")
    x.ctx.forward(weights)  # routing first in the graph, as llama.cpp orders it (fused top-k kernels)

    x = x.reshape(n_embd, 1, n)
    if r.weight_before_ffn:
        x = x.repeat_to(n_embd, r.n_used, n).mul(weights).set_name(f"ffn_moe_weighted-{layer}")
    if experts.gate_up is not None and gate_up_halves:  # llama.cpp's fused gate and up: views of the halves
        fused = _biased(experts.gate_up.matmul_id(x, selected), experts.gate_up_bias, selected,
                        f"ffn_moe_gate_up-{layer}")  # (2 n_ff, n_used, n)
        half = fused.ne[0] // 2
        gate = fused.view(0, (half, fused.ne[1], fused.ne[2]), fused.strides[1:3]).set_name(f"ffn_moe_gate-{layer}")
        up = fused.view(half * fused.strides[0], (half, fused.ne[1], fused.ne[2]), fused.strides[1:3])
        hidden = activation(gate, up.set_name(f"ffn_moe_up-{layer}"))
    elif experts.gate_up is not None:  # Ollama's fused gate and up
        gate, up = _gate_up(x, experts, selected, layer)
        hidden = activation(gate, up)
    else:
        up = _biased(experts.up.matmul_id(x, selected), experts.up_bias, selected, f"ffn_moe_up-{layer}")
        if experts.gate is None:  # ungated experts: the activation of up alone (nomic-bert-moe)
            hidden = activation(up, None)
        else:
            gate = _biased(experts.gate.matmul_id(x, selected), experts.gate_bias, selected,
                           f"ffn_moe_gate-{layer}")
            hidden = activation(gate, up)  # (n_ff, n_used, n)
    out = experts.down.matmul_id(hidden, selected)
    if experts.down_scale is not None:  # each chosen expert's own scale, as llama.cpp's build_lora_mm_id
        scales = Tensor(out.ctx, experts.down_scale.handle)  # a weight: its reshape belongs to this graph
        scales = scales.reshape(1, r.n_expert, 1).repeat_to(1, r.n_expert, n).rows(selected)
        out = out.mul(scales)
    out = _biased(out, experts.down_bias, selected, f"ffn_moe_down-{layer}")
    if not r.weight_before_ffn:
        out = out.mul(weights).set_name(f"ffn_moe_weighted-{layer}")  # (n_embd, n_used, n)

    total = None  # the chosen experts' outputs summed in rank order
    for i in range(r.n_used):
        part = out.view(i * out.strides[1], (n_embd, n), (out.strides[2],))
        total = part if total is None else total.add(part)
    assert total is not None
    return (total.contiguous() if r.n_used == 1 else total).set_name(f"ffn_moe_out-{layer}")


def _gate_up(x: Tensor, experts: Experts, selected: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    """gate and up (n_ff, n_used, n) from the fused stack, whose rows interleave them: the even elements
    of each result row are the gate's, the odd ones the up's (Ollama's Slice(0, i, dim, 2))."""
    fused = _biased(experts.gate_up.matmul_id(x, selected), experts.gate_up_bias, selected,
                    f"ffn_moe_gate_up-{layer}")  # (2 n_ff, n_used, n)
    n_ff, n_used, n = fused.ne[0] // 2, fused.ne[1], fused.ne[2]
    pairs = fused.reshape(2, n_ff, n_used, n)

    def half(i: int, name: str) -> Tensor:
        return pairs.view(i * pairs.strides[0], (1, n_ff, n_used, n)).contiguous(n_ff, n_used, n).set_name(
            f"{name}-{layer}")

    return half(0, "ffn_moe_gate"), half(1, "ffn_moe_up")


def _best_groups(selection: Tensor, r: Routing, layer: int) -> Tensor:
    """selection (n_expert, n) with every expert outside the groups_used best groups at -inf; a group
    scores the sum of its two best experts (DeepSeek V3's group-limited routing, as llama.cpp)."""
    n = selection.ne[1]
    per = r.n_expert // r.groups
    grouped = selection.reshape(per, r.groups, n)
    best_two = grouped.argsort_top_k(2).contiguous().reshape(2, r.groups * n)
    scores = grouped.reshape(1, per, r.groups * n).rows(best_two).reshape(2, r.groups, n)
    scores = scores.sum_rows().reshape(r.groups, n)
    chosen = scores.argsort_top_k(r.groups_used).set_name(f"ffn_moe_group_topk-{layer}")  # (groups_used, n)
    masked = grouped.scale(0.0, float("-inf")).set_rows(grouped.rows(chosen), chosen)
    return masked.reshape(r.n_expert, n).set_name(f"ffn_moe_probs_masked-{layer}")


def _biased(x: Tensor, bias: Tensor | None, selected: Tensor, name: str) -> Tensor:
    """x named `name`, plus the chosen experts' biases if there are any (named as llama.cpp names them)."""
    x.set_name(name)
    if bias is None:
        return x
    base, layer = name.rsplit("-", 1)
    return x.add_id(bias, selected).set_name(f"{base}_biased-{layer}")
