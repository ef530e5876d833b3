"""fit == alloc: the one check every architecture's memory report must pass, written once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ollama_engine.runner.allocate import LoadedModel, LoadParams, open_model


@contextlib.contextmanager
def fitted_then_allocated(path: str, params: LoadParams) -> Iterator[LoadedModel]:
    """The model opened as the runner opens it (fit, then alloc) with its weights loaded.

    Asserts that alloc allocated exactly what fit reported (weights, cache, worst-case graphs), and, when
    the block ends, that whatever the block computed allocated nothing more and left the report as it was.
    """
    fit = open_model(path, params, allocate=False)
    report = fit.memory.to_json()
    fit.close()
    loaded = open_model(path, params, allocate=True)
    try:
        assert loaded.memory.to_json() == report, "alloc's report differs from fit's"
        before = loaded.model.backend.allocated()["CPU"]
        reported = loaded.memory.input_weights + loaded.memory.cpu.size()
        assert before == reported, f"the CPU's buffers hold {before} bytes, the report {reported}"
        loaded.model.backend.load()
        yield loaded
        assert loaded.model.backend.allocated()["CPU"] == before, "computing allocated more on the CPU"
        assert loaded.memory.to_json() == report, "computing changed the report"
    finally:
        loaded.close()
