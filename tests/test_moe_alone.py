"""Every mixture of experts routes a sequence's rows of a shared batch as that sequence's batch alone would.

Quantized GGUFs keep the router (ffn_gate_inp) in F32, and ggml computes an F32 matrix product of two rows or
more through llamafile's sgemm but a single row through a per-row dot product: they round differently in the
last bit (AVX2 and AVX-512 alike), and a router logit's last bit can move an expert's weight or swap the
experts picked. A decode step batched with another sequence's prompt would then differ from the same step
alone. models/alone.py computes each sequence's rows with its own kernel; every mixture model passes its
batch's rows to the shared routing (moe.moe's `rows`), as laguna's did first (tests/test_laguna.py).

Each case: one sequence's decode row in a batch with another sequence's 9-row prompt. Its router logits in
every layer, and both sequences' logits, bitwise equal to those of the step alone and the prompt alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from synthetic.models import PRESETS, write_synthetic

from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.ml import TensorCapture
from ollama_engine.models import load_model

MIXTURES: dict[str, tuple[str, dict]] = {
    "qwen3moe": ("tiny-qwen3moe", {}),
    "mixtral": ("tiny-mixtral", {}),
    "qwen2moe": ("tiny-qwen2moe", {}),
    "gpt-oss": ("tiny-gpt-oss", {}),
    "llama4": ("tiny-llama4", {}),
    "gemma4": ("tiny-gemma4", {"n_expert": 4, "n_expert_used": 2, "n_ff_exp": 64,
                               "gemma4": dataclasses.replace(PRESETS["tiny-gemma4"].gemma4, fused_gate_up=True)}),
    "deepseek2": ("tiny-deepseek2", {}),
    "glm4moelite": ("tiny-glm4moelite", {}),
    "laguna": ("tiny-laguna", {}),
    "lfm2moe": ("tiny-lfm2moe", {}),
    "nemotron_h_moe": ("tiny-nemotron_h_moe", {}),
    "qwen3next": ("tiny-qwen3next", {}),
    "qwen35moe": ("tiny-qwen35moe", {}),
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("moe-alone")

    def write(name: str) -> Path:
        preset, overrides = MIXTURES[name]
        path = folder / f"{name}-Q8_0.gguf"
        return path if path.exists() else write_synthetic(path, preset, weight_type="Q8_0", **overrides)

    return write


def routed(path: Path, batches: list[Batch]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The last batch's logits and every mixture layer's router logits (ffn_moe_logits), after the others."""
    model = load_model(path, num_threads=2)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 2, 256, 32)
        for batch in batches[:-1]:
            model.graphs.compute(batch)
        taken: dict[str, np.ndarray] = {}
        with model.backend.eval_callback(TensorCapture(lambda name: name.startswith("ffn_moe_logits"),
                                                       lambda name, values: taken.__setitem__(name, values.copy()))):
            logits = model.graphs.compute(batches[-1])
        return logits, taken
    finally:
        model.close()


@pytest.mark.parametrize("name", list(MIXTURES))
def test_a_decode_step_batched_with_a_prompt_routes_as_alone(synthetic, name):
    path = synthetic(name)
    experts = PRESETS[MIXTURES[name][0]].n_expert if "n_expert" not in MIXTURES[name][1] else 4
    first = Batch(positions=range(10), sequences=[0] * 10, outputs=[9], tokens=np.arange(10) + 100)
    prompt = np.arange(9) + 300
    mixed, mixed_router = routed(path, [first, Batch(positions=[10, *range(9)], sequences=[0] + [1] * 9,
                                                     outputs=[0, 9], tokens=[7, *prompt])])
    step, step_router = routed(path, [first, Batch(positions=[10], sequences=[0], outputs=[0], tokens=[7])])
    alone, alone_router = routed(path, [Batch(positions=range(9), sequences=[1] * 9, outputs=[8], tokens=prompt)])
    assert mixed_router and set(mixed_router) == set(step_router) == set(alone_router)
    for layer, values in mixed_router.items():  # the last layer keeps the rows that want logits only
        rows = values.reshape(-1, experts)
        np.testing.assert_array_equal(rows[:1], step_router[layer].reshape(-1, experts), err_msg=layer)
        np.testing.assert_array_equal(rows[1:], alone_router[layer].reshape(-1, experts), err_msg=layer)
    np.testing.assert_array_equal(mixed, np.concatenate([step, alone]))
