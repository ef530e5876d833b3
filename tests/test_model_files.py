"""models/ stays a folder a newcomer can change: an architecture's file imports shared modules only, never another
architecture's, and each forward is short enough to read top to bottom."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ollama_engine.models import architectures

MODELS = Path(__file__).resolve().parents[1] / "models"
LONGEST_FORWARD = 60


def architecture_modules() -> set[str]:
    """The modules of models/ that register an architecture."""
    return {cls.__module__.rsplit(".", 1)[-1] for cls in architectures().values()}


def sibling_imports(path: Path, architectures: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1
                 and node.module is None for alias in node.names}
    return (imported & architectures) - {path.stem}


@pytest.mark.parametrize("module", sorted(architecture_modules()))
def test_an_architecture_imports_no_other_architecture(module: str) -> None:
    path = MODELS / f"{module}.py"
    assert not sibling_imports(path, architecture_modules())


@pytest.mark.parametrize("module", sorted(architecture_modules()))
def test_every_forward_is_short(module: str) -> None:
    tree = ast.parse((MODELS / f"{module}.py").read_text())
    lengths = {node.name: fn.end_lineno - fn.lineno + 1 for node in tree.body if isinstance(node, ast.ClassDef)
               for fn in node.body if isinstance(fn, ast.FunctionDef) and fn.name == "forward"}
    assert all(length < LONGEST_FORWARD for length in lengths.values()), lengths


def test_shared_modules_register_nothing() -> None:
    shared = {"base", "graphs", "layers", "moe", "options", "pooling", "rope", "sliding"}
    assert not shared & architecture_modules()
