"""The graph laid out as llama.cpp lays out its own where a GPU's kernels depend on the layout.

On the CPU a weight's product rounds each row alike however many rows there are, so these choices do not show in
the CPU's parity tests; on a GPU they decide which kernel runs (and so the rounding) or whether ggml-cuda fuses
nodes. Each was found on an H200 (bench/RESULTS.md, "First run on a GPU").
"""

from __future__ import annotations

from pathlib import Path

from ollama_engine import ggml
from ollama_engine.ggml.backend import NodeTimer
from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.models import load_model

STORIES = Path(__file__).parent / "data" / "stories260K.gguf"


def computed_nodes(batches: list[Batch]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(kind, name, shape) of every node the last batch's graph computed, in order."""
    model = load_model(STORIES, [], num_threads=1)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 1, 256, 64)
        for batch in batches[:-1]:
            model.graphs.compute(batch)
        nodes: list[tuple[str, str, tuple[int, ...]]] = []
        timer = NodeTimer(lambda node, seconds: nodes.append((ggml.node_kind(node), ggml.get_name(node),
                                                              ggml.full_shape(node))))
        with model.backend.eval_callback(timer):
            model.graphs.compute(batches[-1])
        return nodes
    finally:
        model.close()


def test_the_last_layer_projects_every_row_before_keeping_those_wanted():
    """llama.cpp's build_attn applies the output projection (wo) to every row and only then keeps the rows that
    want logits: a 1-row product on a GPU takes another kernel than an 11-row one (a random-weight 8B's prompt
    logprobs were 0.07 off llama.cpp's on an H200 while we kept the rows first; 0 after)."""
    nodes = computed_nodes([Batch(positions=range(5), sequences=[0] * 5, outputs=[4], tokens=[1, 2, 3, 4, 5])])
    layers = max(int(name.rsplit("-", 1)[1]) for _, name, _ in nodes if name.startswith("attn_out-"))
    projected = {name: shape for _, name, shape in nodes if name.startswith("attn_out-")}
    assert projected[f"attn_out-{layers}"][1] == 5  # all five rows, in the last layer too
    ffn = [shape for _, name, shape in nodes if name == f"ffn_out-{layers}"]
    assert ffn and ffn[0][1] == 1  # then only the row that wants logits


def test_each_key_is_written_to_the_cache_by_rope_view_set_rows():
    """ggml-cuda fuses a key's ROPE, a VIEW of it and the SET_ROWS that writes it to the cache into one kernel
    when the three are adjacent nodes, as llama.cpp's graph has them; a RESHAPE instead of the view, or the
    cache's own reshape between them, kept ours apart (one kernel more per layer and step)."""
    nodes = computed_nodes([Batch(positions=range(3), sequences=[0] * 3, outputs=[2], tokens=[1, 2, 3]),
                            Batch(positions=[3], sequences=[0], outputs=[0], tokens=[4])])
    kinds = [kind for kind, _, _ in nodes]
    writes = [i for i, (kind, name, _) in enumerate(nodes) if kind == "SET_ROWS" and name.startswith("cache_k")]
    assert writes
    assert all(kinds[i - 2:i] == ["ROPE", "VIEW"] for i in writes), [kinds[i - 3:i + 1] for i in writes]
