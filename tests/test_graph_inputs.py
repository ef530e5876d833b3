"""A reused graph must not keep a stale input: every architecture's inputs, after Graph.bind, equal those of a
graph built for the same batch (models.graphs.stale_inputs), and forgetting one is caught."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from synthetic.models import PRESETS, write_synthetic

from ollama_engine.kvcache import Batch
from ollama_engine.ml import DType
from ollama_engine.models import architectures, llama, load_model
from ollama_engine.models.graphs import stale_inputs

TINY = sorted(name for name in PRESETS if name.startswith("tiny-"))
# the architectures only Ollama's converters name: written by a preset in Ollama's layout
OLLAMA = {"tiny-gpt-oss": "gptoss", "tiny-olmo3": "olmo3", "tiny-glm4moelite": "glm4moelite",
          "tiny-qwen2vl": "qwen25vl"}
CASES = [(preset, "llama.cpp") for preset in TINY] + [(preset, "ollama") for preset in OLLAMA]
PROMPT, STEPS = 20, 16  # decoding from position 20 to 35 crosses mistral3's temperature step at 32


def open_model(path: Path):
    model = load_model(path, num_threads=1)
    model.backend.load()
    if model.cache is not None:  # encoders have none (and build a graph for every batch)
        model.cache.init(model.backend, DType.F32, 1, 256, 32)
    return model


def stale_while_decoding(model) -> dict[int, list[str]]:
    """A prompt, then one token a step; for every step that reused a graph, the inputs it left stale."""
    stale, previous = {}, None
    batches = [Batch(positions=list(range(PROMPT)), sequences=[0] * PROMPT, outputs=[PROMPT - 1],
                     tokens=[(7 * p + 3) % 50 + 1 for p in range(PROMPT)])]
    batches += [Batch(positions=[p], sequences=[0], outputs=[0], tokens=[p % 40 + 2])
                for p in range(PROMPT, PROMPT + STEPS)]
    for batch in batches:
        graph = model.graphs.acquire(batch)
        try:
            graph.bind(batch)
            if graph is previous:
                stale[batch.positions[0]] = stale_inputs(graph, batch)
            graph.run()
        finally:
            model.graphs.release(graph)
        previous = graph
    return stale


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("graph-inputs")


def test_every_architecture_is_checked() -> None:
    """A new architecture needs a tiny preset, and so gets the check below."""
    checked = {PRESETS[preset].arch for preset in TINY} | set(OLLAMA.values())
    assert {name for name in architectures() if not name.endswith("_embed")} <= checked


@pytest.mark.parametrize(("preset", "layout"), CASES)
def test_a_reused_graph_refreshes_every_input(folder: Path, preset: str, layout: str) -> None:
    path = write_synthetic(folder / f"{preset}-{layout}.gguf", preset, weight_type="F32", layout=layout)
    model = open_model(path)
    try:
        if layout == "ollama":
            assert model.config.architecture() == OLLAMA[preset]
        if not model.reuse_graphs:
            pytest.skip(f"{preset} builds a graph for every batch")
        stale = stale_while_decoding(model)
    finally:
        model.close()
    assert len(stale) >= STEPS - 2, "decode steps of one shape must reuse their graph"
    assert {step: names for step, names in stale.items() if names} == {}


def test_an_input_left_out_of_batch_inputs_is_caught(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that adds a per-position input and forgets to list it in batch_inputs() (as mistral3's query
    temperature once was, costing 0.25 in a logit) keeps the built batch's values on reuse: it is reported."""
    forward = llama.Llama.forward

    def forgetful(self, ctx, batch):
        logits = forward(self, ctx, batch)
        if logits is None:
            return None
        rows = np.asarray(batch.positions, dtype=np.float32)[np.asarray(batch.outputs)]
        return logits.add(ctx.input().from_numpy(rows.reshape(-1, 1)).set_name("position_bias"))

    monkeypatch.setattr(llama.Llama, "forward", forgetful)
    model = open_model(write_synthetic(folder / "forgetful.gguf", "tiny-llama", weight_type="F32"))
    try:
        stale = stale_while_decoding(model)
    finally:
        model.close()
    assert stale and all(names == ["position_bias"] for names in stale.values())
