"""The layers of DESIGN.md: lower never imports higher; only ollama_engine/ggml touches cffi."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys

import pytest

from ollama_engine.paths import REPO_ROOT

# package prefix -> rank; a module imports only from packages of lower or equal rank.
# fs sits below ml: the backend places the tensors a GGUF file lists.
LAYERS = [
    "ollama_engine.ggml", "ollama_engine.fs", "ollama_engine.ml", "ollama_engine.tokenizer", "ollama_engine.image",
    "ollama_engine.kvcache", "ollama_engine.models", "ollama_engine.sample", "ollama_engine.runner",
    "ollama_engine.server", "ollama_engine.llm", "ollama_engine.template", "ollama_engine.store", "ollama_engine.sched",
    "ollama_engine.api",
]
FOLDERS = {"models": "ollama_engine.models", "kvcache": "ollama_engine.kvcache", "server": "ollama_engine.server"}
# plain data (and the OLLAMA_* settings), importable from anywhere
SHARED = {"ollama_engine.paths", "ollama_engine.ml.memory", "ollama_engine.envconfig"}


def rank(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    return None


def source_modules():
    for path in sorted(REPO_ROOT.glob("ollama_engine/**/*.py")):
        yield ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts), path
    for folder, package in FOLDERS.items():
        for path in sorted((REPO_ROOT / folder).glob("**/*.py")):
            yield package + "." + ".".join(path.relative_to(REPO_ROOT / folder).with_suffix("").parts), path


def imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_lower_layers_never_import_higher_ones():
    problems = []
    for module, path in source_modules():
        own = rank(module)
        for target in imports(path):
            if target.split(".")[0] in FOLDERS:
                problems.append(f"{path}: bare import of {target}")
            theirs = rank(target)
            if own is not None and theirs is not None and theirs > own and target not in SHARED:
                problems.append(f"{path}: {module} imports higher layer {target}")
    assert not problems, "\n".join(problems)


# store and template are pure Python beside the engine: they read GGUF metadata and vocabularies only.
PURE = {"ollama_engine.store": ("ollama_engine.fs", "ollama_engine.tokenizer", "ollama_engine.template",
                                "ollama_engine.store"),
        "ollama_engine.template": ("ollama_engine.fs", "ollama_engine.tokenizer", "ollama_engine.template")}


def test_store_and_template_use_only_fs_tokenizer_and_each_other():
    problems = []
    for module, path in source_modules():
        allowed = next((a for package, a in PURE.items() if module == package or module.startswith(package + ".")),
                       None)
        for target in imports(path) if allowed is not None else ():
            if target.startswith("ollama_engine") and not target.startswith(allowed) and target not in SHARED:
                problems.append(f"{path}: {module} imports {target}")
    assert not problems, "\n".join(problems)


def test_the_installed_engine_needs_neither_the_tests_nor_the_build_tree():
    """The wheel holds ollama_engine alone: the synthetic writer lives in tests/, llama.cpp's source (vocab files,
    the reference) in build/; only the build script and the tests ask ollama_engine.paths where those are."""
    problems = []
    for module, path in source_modules():
        for target in imports(path):
            if target.split(".")[0] in ("synthetic", "tests") or target == "ollama_engine.paths":
                problems.append(f"{path}: {module} imports {target}")
    assert not problems, "\n".join(problems)


def test_only_the_ggml_package_touches_cffi():
    offenders = [
        str(path) for module, path in source_modules()
        if not module.startswith("ollama_engine.ggml")
        and any(t == "cffi" or t.startswith(("cffi.", "_cffi_backend")) or "_ggml_cffi" in t for t in imports(path))
    ]
    assert not offenders


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_ruff_clean():
    command = [sys.executable, "-m", "ruff", "check", "--quiet", str(REPO_ROOT)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_environment_is_read_in_envconfig_alone():
    """One place per decision: every OLLAMA_* (and the engine's own) variable is read by envconfig.py, so a
    setting has one parser, one default and one docstring. Passing the environment on to a child is fine."""
    readers = []
    for module, path in source_modules():
        if module == "ollama_engine.envconfig":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = ast.unparse(node.func)
                if target in ("os.environ.get", "os.getenv", "environ.get"):
                    readers.append(f"{module}:{node.lineno}")
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                if ast.unparse(node.value) in ("os.environ", "environ"):
                    readers.append(f"{module}:{node.lineno}")
    assert not readers, f"read the environment through ollama_engine.envconfig instead: {readers}"


def test_no_module_writes_a_setting_into_the_environment_for_another_to_read():
    """A command-line flag is passed down as a value (ml.device.use_rpc_servers, EnvConfig, a runner's own flag),
    not written into os.environ for a lower layer to read back. Library tuning for a third party before it loads
    (OPENBLAS_NUM_THREADS through setdefault) is not a setting of ours."""
    writers = []
    for module, path in source_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
                if ast.unparse(node.value) in ("os.environ", "environ"):
                    writers.append(f"{module}:{node.lineno}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.putenv", "os.environ.update"):
                writers.append(f"{module}:{node.lineno}")
    assert not writers, f"pass the value down instead of writing it into the environment: {writers}"
