"""GLM-4.7-Flash as Ollama's converter writes it (architecture "glm4moelite"): DeepSeek-V2's graph under other
key names, so this file only translates the keys and deepseek2.py runs the model.

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
re-download"; so does this file.
"""

from __future__ import annotations

from ollama_engine.fs import Config

from .base import ModelError, register
from .deepseek2 import DeepSeek2

OLD_FORMAT = "this model uses a weight format that is no longer supported; please re-download it"  # Ollama's


@register("glm4moelite")
class Glm4MoeLite(DeepSeek2):
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
