"""RoPE options shared by architectures: llama.cpp's YaRN (gpt-oss, mistral3)."""

from __future__ import annotations

import numpy as np

from ollama_engine.fs import Config
from ollama_engine.ml import RopeOptions

from .base import ModelError


def yarn_options(config: Config, rope_scale: float, *, neox: bool, tuned: bool = False,
                 scaling: str = "linear") -> RopeOptions:
    """RoPE with llama.cpp's YaRN parameters for rope.scaling.type "yarn" (plain RoPE otherwise).

    As llama_context's constructor: extrapolation 1, betas 32 and 1, the original context from
    rope.scaling.original_context_length, and the attention factor mscale = 1 + 0.1 ln(factor) divided
    by the mscale that ggml applies again inside RoPE, times rope.scaling.attn_factor; computed in
    float32, as llama.cpp does. `tuned` architectures (mistral3) also read what their llama.cpp loaders
    read: the betas rope.scaling.yarn_beta_fast/slow (Ollama's conversions: rope.scaling.beta_fast/slow)
    and rope.scaling.yarn_log_multiplier, which divides mscale by 1 + 0.1 log_mul ln(factor). `scaling` is
    the type of files without rope.scaling.type (llama.cpp's default, linear; Ollama's gpt-oss: yarn).
    """
    original = config.get_uint("rope.scaling.original_context_length", config.get_uint("context_length", 0))
    scaling = config.get_string("rope.scaling.type", scaling)
    if scaling not in ("", "none", "linear", "yarn"):  # Ollama's converters may write "" for none
        raise ModelError(f"rope.scaling.type {scaling!r} is not supported (none, linear, yarn)")
    if scaling != "yarn":
        return RopeOptions(neox=neox, original_context=original)
    one, tenth = np.float32(1.0), np.float32(0.1)
    factor = one / np.float32(rope_scale)
    attention_factor = one
    if factor > one:
        log_mul = np.float32(config.get_float("rope.scaling.yarn_log_multiplier", 0.0) if tuned else 0.0)
        mscale = tenth * np.log(factor) + one
        attention_factor = mscale / (tenth * log_mul * np.log(factor) + one) if log_mul else mscale
        attention_factor *= one / mscale
    attention_factor *= np.float32(config.get_float("rope.scaling.attn_factor", 1.0))
    beta_fast, beta_slow = 32.0, 1.0
    if tuned:
        beta_fast = config.get_float("rope.scaling.yarn_beta_fast", config.get_float("rope.scaling.beta_fast", 32.0))
        beta_slow = config.get_float("rope.scaling.yarn_beta_slow", config.get_float("rope.scaling.beta_slow", 1.0))
    return RopeOptions(neox=neox, original_context=original, extrapolation_factor=1.0,
                       attention_factor=float(attention_factor), beta_fast=beta_fast, beta_slow=beta_slow)


def mrope_sections(config: Config, dims: int) -> list[int]:
    """rope.dimension_sections (Ollama's qwen25vl files: rope.mrope_section), padded to ggml's 4: how many of
    the `dims` // 2 rotated pairs each position component drives. Checked here, since ggml divides by their
    sum (0 would fault) and reads no more than 4."""
    sections = config.get_ints("rope.dimension_sections") or config.get_ints("rope.mrope_section")
    arch = config.architecture()
    if not sections or len(sections) > 4 or min(sections) < 0 or not 0 < sum(sections) <= dims // 2:
        raise ModelError(f"{arch}: rope.dimension_sections {sections} must be up to 4 non-negative counts of "
                         f"rotated pairs, 1 to {dims // 2} in all")
    return (sections + [0] * 4)[:4]


def mrope_text_positions(positions: np.ndarray) -> np.ndarray:
    """Text tokens' 4 multimodal RoPE position components, component-major: p, p, p, 0 (llama.cpp's
    llm_graph_input_pos for a token batch)."""
    positions = np.asarray(positions, dtype=np.int32)
    return np.concatenate([positions, positions, positions, np.zeros_like(positions)])
