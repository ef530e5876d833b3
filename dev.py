#!/usr/bin/env python3
"""Set up everything on a fresh machine, then run the demo or the tests.

    python3 dev.py demo [ARGS...]          # the main job: `ollama-engine demo ARGS...`
    python3 dev.py test [ARGS...]          # the test suite: `pytest ARGS...`
    python3 dev.py test --avx2 [ARGS...]   # the suite as on a CPU without AVX-512 (see avx2_test)

Both create .venv (once) and build ggml (a no-op when up to date). `demo` installs only what the
engine needs; `test` adds the test extra: the ollama and openai clients, and the llama.cpp reference
(llama-cpp-python), built from source once into build/reference/ with the compiler flags our ggml is
built with (build_ggml.compiler_cmake_args), so that both run the same kernels: a few minutes the first
time. Each install is redone only when pyproject.toml changes. Needs only Python 3.10+, a C/C++ compiler
and CMake.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from build_ggml import compiler_cmake_args

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("OLLAMA_ENGINE_VENV", ROOT / ".venv"))
STAMPS = {"base": ".ollama-engine-installed-base", "test": ".ollama-engine-installed"}
REFERENCE = "llama-cpp-python==0.3.36"
# An AMD EPYC of the Zen 2/3 kind, or any x86-64 CPU without AVX-512: what ggml compiles for there natively.
AVX2_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"]


def say(message: str) -> None:
    print(f"[dev] {message}", file=sys.stderr, flush=True)


def run(*args: str | Path, env: dict | None = None, cwd: Path = ROOT) -> None:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env)
    if result.returncode != 0:
        sys.exit(result.returncode)


def reference_wheels(folder: Path, cmake_args: list[str]) -> Path:
    """A folder holding the llama.cpp reference built with these CMake flags (built once).

    Not through pip's wheel cache: it may hold a build made with other flags (e.g. -march=native alone).
    """
    if not list(folder.glob("llama_cpp_python-*.whl")):
        say(f"building the llama.cpp reference ({REFERENCE}) from source into {folder}: minutes")
        env = {**os.environ, "CMAKE_ARGS": shlex.join(cmake_args)}
        run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir", "--no-binary",
            "llama-cpp-python", REFERENCE, "-w", folder, env=env)
    return folder


def ensure_venv(extra: str, venv_dir: Path = VENV, root: Path = ROOT, wheels: Path | None = None) -> None:
    """The venv with the package installed: `base` (the engine alone) or `test` (plus the test extra)."""
    python = venv_dir / "bin" / "python"
    if not python.exists():
        say(f"creating the virtual environment {venv_dir}")
        venv.EnvBuilder(with_pip=True).create(venv_dir)
    wanted = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()
    # a test install includes the base one
    stamps = [venv_dir / STAMPS[name] for name in (["test"] if extra == "test" else ["base", "test"])]
    if any(stamp.exists() and stamp.read_text() == wanted for stamp in stamps):
        return
    run(python, "-m", "pip", "install", "-q", "--upgrade", "pip", "setuptools", "wheel")
    if extra == "test":
        wheels = wheels or reference_wheels(ROOT / "build" / "reference", compiler_cmake_args())
        say("installing ollama-engine and its test dependencies")
        run(python, "-m", "pip", "install", "--progress-bar", "off", "--find-links", wheels, "-e", f"{root}[test]")
        # a venv made before may hold the same version built with other flags
        [wheel] = wheels.glob("llama_cpp_python-*.whl")
        run(python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel)
    else:
        say("installing ollama-engine (the engine's dependencies only)")
        run(python, "-m", "pip", "install", "--progress-bar", "off", "-e", str(root))
    (venv_dir / STAMPS[extra]).write_text(wanted)


def avx2_test(pytest_args: list[str]) -> None:
    """Run the suite as an AVX2-only CPU would, on any x86-64 machine.

    ggml's kernels (and so its rounding) differ between CPU families. Both our ggml and the llama.cpp
    reference are compiled for AVX2 without AVX-512, into build/avx2/: a copy of the working tree
    (tracked files and untracked ones git does not ignore), its own venv, ggml build and reference wheel.
    The first run compiles both: about 10 minutes on 2 cores.
    """
    home = ROOT / "build" / "avx2"
    tree, venv_dir = home / "tree", home / "venv"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    copied = 0
    for name in filter(None, listed):
        source, target = ROOT / name, tree / name
        if source.is_file() and (not target.exists() or target.read_bytes() != source.read_bytes()):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            copied += 1
    say(f"working tree copied to {tree} ({copied} files changed)")
    ensure_venv("test", venv_dir, tree, reference_wheels(home / "wheels", AVX2_FLAGS + compiler_cmake_args()))
    python = venv_dir / "bin" / "python"
    pin = json.loads((ROOT / "vendor" / "ggml-source.json").read_text())
    source = ROOT / "build" / "src" / pin["llama_cpp_dir"]
    build_args = [f"--cmake-arg={flag}" for flag in AVX2_FLAGS if flag != "-DGGML_NATIVE=OFF"] + ["--portable"]
    if source.is_dir():  # the sources the default build downloaded
        build_args += ["--source", str(source)]
    run(python, "build_ggml.py", *build_args, cwd=tree)
    check = ("from ollama_engine.ggml import lib; import llama_cpp; "
             "info = llama_cpp.llama_print_system_info().decode(); "
             "assert lib.ggml_cpu_has_avx2() and not lib.ggml_cpu_has_avx512() and 'AVX512 = 1' not in info, info")
    run(python, "-c", check, cwd=tree)
    say("ggml and the llama.cpp reference run AVX2 kernels, no AVX-512")
    sys.exit(subprocess.run([str(python), "-m", "pytest", *pytest_args], cwd=tree).returncode)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__)
        sys.exit(2)
    command, rest = argv[0], argv[1:]
    if command == "test" and rest[:1] == ["--avx2"]:
        avx2_test(rest[1:])
    ensure_venv("base" if command == "demo" else "test")
    python = VENV / "bin" / "python"
    run(python, "build_ggml.py")
    if command == "demo":
        run(python, "-m", "ollama_engine", "demo", *rest)
    else:
        run(python, "-m", "pytest", *rest)


if __name__ == "__main__":
    main(sys.argv[1:])
