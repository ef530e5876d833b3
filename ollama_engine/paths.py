"""Where the build puts things: one place, so build_ggml.py, the bindings and the tests agree."""

from __future__ import annotations

from pathlib import Path

from ollama_engine import envconfig

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = envconfig.build_dir(REPO_ROOT / "build")
SOURCE_ROOT = BUILD_DIR / "src"


def llama_cpp_source() -> Path:
    """The llama.cpp tree that build_ggml.py extracted (or OLLAMA_ENGINE_LLAMA_CPP for --source builds)."""
    override = envconfig.llama_cpp_source_override()
    if override is not None:
        return override
    marker = BUILD_DIR / "source-path.txt"
    if marker.exists():
        return Path(marker.read_text().strip())
    return SOURCE_ROOT / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"

