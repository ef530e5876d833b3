"""Model names to GGUF files: the one function every route calls (`resolve_model`).

A name is either an existing GGUF path or an Ollama model name ([host/][namespace/]model[:tag], defaults
registry.ollama.ai, library, latest) looked up read-only in Ollama's store under OLLAMA_MODELS (reference §4.3):
manifests/HOST/NAMESPACE/MODEL/TAG → the layer of media type application/vnd.ollama.image.model →
blobs/sha256-HEX. The full store (ollama_engine/store) will replace the lookup behind this function.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ollama_engine.sched import Model

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
ADAPTER_MEDIA_TYPE = "application/vnd.ollama.image.adapter"
PROJECTOR_MEDIA_TYPE = "application/vnd.ollama.image.projector"


class ModelNotFoundError(LookupError):
    """No GGUF file and no manifest under this name."""


def split_name(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) with Ollama's defaults filled in."""
    rest, tag = name, DEFAULT_TAG
    if ":" in name.rsplit("/", 1)[-1]:
        rest, tag = name.rsplit(":", 1)
    parts = rest.split("/")
    model = parts[-1]
    namespace = parts[-2] if len(parts) >= 2 else DEFAULT_NAMESPACE
    host = parts[-3] if len(parts) >= 3 else DEFAULT_HOST
    return host, namespace, model, tag


def short_name(host: str, namespace: str, model: str, tag: str) -> str:
    """Ollama's display form: model:tag, ns/model:tag, or host/ns/model:tag."""
    if host != DEFAULT_HOST:
        return f"{host}/{namespace}/{model}:{tag}"
    if namespace != DEFAULT_NAMESPACE:
        return f"{namespace}/{model}:{tag}"
    return f"{model}:{tag}"


def _find_case_insensitive(directory: Path, part: str) -> Path | None:
    exact = directory / part
    if exact.exists():
        return exact
    try:
        for entry in os.scandir(directory):
            if entry.name.lower() == part.lower():
                return Path(entry.path)
    except OSError:
        return None
    return None


def _blob(models: Path, digest: str) -> str:
    return str(models / "blobs" / digest.replace(":", "-"))


def resolve_model(name: str, models: Path) -> Model:
    """The Model a request names; raises ModelNotFoundError."""
    if not name:
        raise ModelNotFoundError(name)
    if name.endswith(".gguf") or os.sep in name and Path(name).is_file():
        path = Path(name).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(name)
        resolved = str(path.resolve())
        return Model(name=name, short_name=path.stem, model_path=resolved, capabilities=["completion"])
    host, namespace, model, tag = split_name(name)
    manifest = models / "manifests"
    for part in (host, namespace, model, tag):
        found = _find_case_insensitive(manifest, part)
        if found is None:
            raise ModelNotFoundError(name)
        manifest = found
    try:
        raw = manifest.read_bytes()
        layers = json.loads(raw).get("layers") or []
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(name) from err
    paths = {kind: [_blob(models, layer["digest"]) for layer in layers if layer.get("mediaType") == kind]
             for kind in (MODEL_MEDIA_TYPE, ADAPTER_MEDIA_TYPE, PROJECTOR_MEDIA_TYPE)}
    if not paths[MODEL_MEDIA_TYPE]:
        raise ModelNotFoundError(name)
    display = short_name(host, namespace, model, tag)
    return Model(
        name=display, short_name=display, model_path=paths[MODEL_MEDIA_TYPE][0],
        digest=hashlib.sha256(raw).hexdigest(), adapter_paths=paths[ADAPTER_MEDIA_TYPE],
        projector_paths=paths[PROJECTOR_MEDIA_TYPE], capabilities=["completion"],
    )
