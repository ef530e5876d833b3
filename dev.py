#!/usr/bin/env python3
"""Set up everything on a fresh machine, then run the demo or the tests.

    python3 dev.py demo [ARGS...]   # the main job: `ollama-engine demo ARGS...`
    python3 dev.py test [ARGS...]   # the test suite: `pytest ARGS...`

Both create .venv (once) and build ggml (a no-op when up to date). `demo` installs only what the
engine needs; `test` adds the test extra (the llama.cpp reference, llama-cpp-python, takes a few
minutes to build the first time, then pip's wheel cache has it; and the ollama and openai clients).
Each install is redone only when pyproject.toml changes. Needs only Python 3.10+, a C/C++ compiler
and CMake.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("OLLAMA_ENGINE_VENV", ROOT / ".venv"))
PYTHON = VENV / "bin" / "python"
INSTALL_STAMPS = {"base": VENV / ".ollama-engine-installed-base", "test": VENV / ".ollama-engine-installed"}


def say(message: str) -> None:
    print(f"[dev] {message}", file=sys.stderr, flush=True)


def run(*args: str | Path, env: dict | None = None) -> None:
    result = subprocess.run([str(a) for a in args], cwd=ROOT, env=env)
    if result.returncode != 0:
        sys.exit(result.returncode)


def ensure_venv(extra: str) -> None:
    """The venv with the package installed: `base` (the engine alone) or `test` (plus the test extra)."""
    if not PYTHON.exists():
        say(f"creating the virtual environment {VENV}")
        venv.EnvBuilder(with_pip=True).create(VENV)
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    # a test install includes the base one
    stamps = [INSTALL_STAMPS["test"]] if extra == "test" else [INSTALL_STAMPS["base"], INSTALL_STAMPS["test"]]
    if any(stamp.exists() and stamp.read_text() == wanted for stamp in stamps):
        return
    run(PYTHON, "-m", "pip", "install", "-q", "--upgrade", "pip", "setuptools", "wheel")
    if extra == "test":
        say("installing ollama-engine and its test dependencies (the first time builds llama-cpp-python: minutes)")
        run(PYTHON, "-m", "pip", "install", "--progress-bar", "off", "-e", ".[test]")
    else:
        say("installing ollama-engine (the engine's dependencies only)")
        run(PYTHON, "-m", "pip", "install", "--progress-bar", "off", "-e", ".")
    INSTALL_STAMPS[extra].write_text(wanted)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__)
        sys.exit(2)
    command, rest = argv[0], argv[1:]
    ensure_venv("base" if command == "demo" else "test")
    run(PYTHON, "build_ggml.py")
    if command == "demo":
        run(PYTHON, "-m", "ollama_engine", "demo", *rest)
    else:
        run(PYTHON, "-m", "pytest", *rest)


if __name__ == "__main__":
    main(sys.argv[1:])
