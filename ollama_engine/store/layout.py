"""Ollama's on-disk store: content-addressed blobs and JSON manifests, and the errors of the store.

    $OLLAMA_MODELS/blobs/sha256-<64 hex>
    $OLLAMA_MODELS/manifests/<host>/<namespace>/<model>/<tag>

A model's digest is the sha256 of its manifest file's bytes, so manifests are written with Go's JSON
encoder rules (field order, compact, trailing newline) to give the same bytes Ollama would write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ollama_engine.template.gojson import GoStruct, go_json

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MEDIA_MODEL = "application/vnd.ollama.image.model"
MEDIA_ADAPTER = "application/vnd.ollama.image.adapter"
MEDIA_PROJECTOR = "application/vnd.ollama.image.projector"
MEDIA_TEMPLATE = "application/vnd.ollama.image.template"
MEDIA_PROMPT = "application/vnd.ollama.image.prompt"  # the legacy name of the template layer
MEDIA_SYSTEM = "application/vnd.ollama.image.system"
MEDIA_PARAMS = "application/vnd.ollama.image.params"
MEDIA_MESSAGES = "application/vnd.ollama.image.messages"
MEDIA_LICENSE = "application/vnd.ollama.image.license"

DIGEST_RE = re.compile(r"sha256[:-][0-9a-fA-F]{64}")  # used with fullmatch
_CHUNK = 1 << 20


class StoreError(Exception):
    """A store operation failed; `status` is the HTTP status Ollama answers with."""

    status = 500


class BadRequest(StoreError):
    status = 400


class InvalidName(BadRequest):
    pass


class InvalidDigest(BadRequest):
    def __init__(self, message: str = "invalid digest format") -> None:
        super().__init__(message)


class DigestMismatch(BadRequest):
    pass


class NotFound(StoreError):
    status = 404


class ModelNotFound(NotFound):
    pass


class BlobNotFound(NotFound):
    pass


def check_digest(digest: str) -> str:
    """The digest in `sha256:<hex>` form (lower-case hex); InvalidDigest unless `^sha256[:-][0-9a-fA-F]{64}$`."""
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise InvalidDigest()
    return "sha256:" + digest[7:].lower()


@dataclass
class Layer:
    media_type: str
    digest: str
    size: int
    source: str = ""  # JSON "from": the file or model the layer came from
    name: str = ""  # JSON "name": a tensor name (safetensors models)
    status: str = field(default="", compare=False)  # create's progress line for this layer (not stored)

    def to_go(self) -> GoStruct:
        out = GoStruct(mediaType=self.media_type, digest=self.digest, size=self.size)
        if self.source:
            out["from"] = self.source
        if self.name:
            out["name"] = self.name
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layer:
        return cls(str(data.get("mediaType", "")), str(data.get("digest", "")), int(data.get("size", 0)),
                   str(data.get("from", "")), str(data.get("name", "")))


@dataclass
class Manifest:
    config: Layer
    layers: list[Layer]
    schema_version: int = 2
    media_type: str = MANIFEST_MEDIA_TYPE
    digest: str = ""  # sha256 hex of the file's bytes (set when read or written)
    path: Path | None = None
    mtime: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The file's bytes as Ollama's WriteManifest writes them (json.Encoder: trailing newline)."""
        doc = GoStruct(schemaVersion=self.schema_version, mediaType=self.media_type, config=self.config.to_go(),
                       layers=[layer.to_go() for layer in self.layers])
        return (go_json(doc) + "\n").encode()

    @property
    def size(self) -> int:
        """Bytes of all layers plus the config blob, as /api/tags reports."""
        return sum(layer.size for layer in self.layers) + self.config.size

    def all_digests(self) -> list[str]:
        return [layer.digest for layer in [*self.layers, self.config] if layer.digest]

    def first(self, media_type: str) -> Layer | None:
        return next((layer for layer in self.layers if layer.media_type == media_type), None)

    @classmethod
    def from_bytes(cls, data: bytes, path: Path | None = None) -> Manifest:
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("manifest is not a JSON object")
        known = {"schemaVersion", "mediaType", "config", "layers"}
        manifest = cls(Layer.from_json(doc.get("config") or {}),
                       [Layer.from_json(x) for x in doc.get("layers") or []],
                       int(doc.get("schemaVersion", 0)), str(doc.get("mediaType", "")),
                       hashlib.sha256(data).hexdigest(), path,
                       extra={k: v for k, v in doc.items() if k not in known})
        if path is not None:
            manifest.mtime = path.stat().st_mtime
        return manifest


def write_atomically(path: Path, chunks: Iterable[bytes], expected_digest: str | None = None) -> tuple[str, int]:
    """Write into a temp file beside `path`, hash on the way, rename into place only if the digest matches.

    Returns ("sha256:<hex>", size). On a mismatch or any error nothing is left behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f".{path.name}.{os.getpid()}.{id(chunks)}.partial"
    sha, size = hashlib.sha256(), 0
    try:
        with open(temp, "wb") as f:
            for chunk in chunks:
                sha.update(chunk)
                size += len(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        digest = "sha256:" + sha.hexdigest()
        if expected_digest is not None and digest != expected_digest:
            raise DigestMismatch(f'digest mismatch, expected "{expected_digest}", got "{digest}"')
        os.chmod(temp, 0o644)
        os.replace(temp, path)
        return digest, size
    finally:
        temp.unlink(missing_ok=True)


def read_chunks(source: bytes | BinaryIO | Iterable[bytes]) -> Iterable[bytes]:
    """Bytes, a binary file object, or an iterable of byte chunks, as chunks."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        yield bytes(source)
    elif hasattr(source, "read"):
        while chunk := source.read(_CHUNK):  # type: ignore[union-attr]
            yield chunk
    else:
        yield from source  # type: ignore[misc]


def file_digest(path: str | os.PathLike[str]) -> str:
    """`sha256:<hex>` of a file, as the CLI computes it before uploading a blob."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return "sha256:" + sha.hexdigest()
