"""`ollama-engine plan` run in-process on a tiny Llama of N_LAYER layers (test_plan, test_plan_svg)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from synthetic.models import write_synthetic

from ollama_engine.llm.plan import add_plan_command
from ollama_engine.ml.memory import MIB

N_LAYER = 6
MINIMUM = 457 * MIB  # what the planner reserves on every CUDA GPU


def tiny_llama(folder: Path) -> Path:
    return write_synthetic(folder / "llama.gguf", "tiny-llama", n_layer=N_LAYER)


def run(model: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """The command's exit status and output, for a context of 256 and batches of 32."""
    parser = argparse.ArgumentParser()
    add_plan_command(parser.add_subparsers())
    args = parser.parse_args(["plan", str(model), "--ctx", "256", "--batch", "32", *argv])
    rc = args.run(args)
    return rc, capsys.readouterr().out
