"""Ollama's on-disk store: content-addressed blobs and JSON manifests, and the errors of the store.

    $OLLAMA_MODELS/blobs/sha256-<64 hex>
    $OLLAMA_MODELS/manifests/<host>/<namespace>/<model>/<tag>

A model's digest is the sha256 of its manifest file's bytes, so manifests are written with Go's JSON
encoder rules (field order, compact, trailing newline) to give the same bytes Ollama would write.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ollama_engine.template.gojson import GoStruct, go_json

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MEDIA_MODEL = "application/vnd.ollama.image.model"
MEDIA_ADAPTER = "application/vnd.ollama.image.adapter"
MEDIA_PROJECTOR = "application/vnd.ollama.image.projector"
MEDIA_DRAFT = "application/vnd.ollama.image.draft"  # a draft model for speculative decoding (Ollama's name)
MEDIA_TEMPLATE = "application/vnd.ollama.image.template"
MEDIA_PROMPT = "application/vnd.ollama.image.prompt"  # the legacy name of the template layer
MEDIA_SYSTEM = "application/vnd.ollama.image.system"
MEDIA_PARAMS = "application/vnd.ollama.image.params"
MEDIA_MESSAGES = "application/vnd.ollama.image.messages"
MEDIA_LICENSE = "application/vnd.ollama.image.license"

DIGEST_RE = re.compile(r"sha256[:-][0-9a-fA-F]{64}")  # used with fullmatch
_CHUNK = 1 << 20
NAME_MAX = 255  # bytes in one file name (Linux, macOS): a longer name part cannot be a manifest path
# Temp files of a write in progress, with the pid of the process writing: `.<label>.<pid>.<random>.partial`
# (temp_path), and the older `tmp-<pid>-<n>` / `tmp-pull-<pid>-<hex>` names.
_TEMP_RES = (re.compile(r"\..+\.(\d+)\.[0-9a-f]+\.partial"), re.compile(r"tmp-(?:pull-)?(\d+)-[0-9a-f]+"))


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


def temp_path(directory: Path, label: str) -> Path:
    """A temp file's name in `directory`, unique to this write: `.<label>.<pid>.<random>.partial`.

    The pid lets the next serve start remove what a killed one left (remove_stale_temp_files); the random part
    keeps two writes of the same thing (two pulls of one blob) from sharing a file."""
    return directory / f".{label}.{os.getpid()}.{uuid.uuid4().hex[:16]}.partial"


class BlobWriter:
    """One file being written: hashed as it streams into a temp file, renamed into place only if its digest is
    the expected one. write() runs in worker threads while the event loop reads the next chunk; abort() may come
    from the event loop at any time (a client gone) and leaves nothing behind."""

    def __init__(self, directory: Path, expected_digest: str | None = None, label: str = "blob") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.temp = temp_path(directory, label)
        self.expected = expected_digest
        self.size = 0
        self._sha = hashlib.sha256()
        self._file: BinaryIO | None = open(self.temp, "xb", buffering=0)  # noqa: SIM115 (closed by commit/abort)
        self._lock = threading.Lock()  # a write in a thread and an abort from the loop never overlap

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        with self._lock:
            if self._file is None:
                return  # aborted while this chunk waited for a thread
            self._sha.update(chunk)
            view = memoryview(chunk)
            while view:  # an unbuffered write may take part of the chunk (a file size limit reached)
                written = self._file.write(view)
                if not written:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                view = view[written:]
            self.size += len(chunk)

    def write_all(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def commit(self, path_for: Callable[[str], Path], replace: bool = False) -> tuple[str, bool]:
        """Check the digest, make the file durable and rename it to `path_for(digest)`: (digest, created). An
        existing file is kept (a blob: same content) unless `replace` (a manifest). DigestMismatch (nothing left
        behind) when the digest is not the expected one."""
        with self._lock:
            if self._file is None:
                raise StoreError("the upload was aborted")
            try:
                digest = "sha256:" + self._sha.hexdigest()
                if self.expected is not None and digest != self.expected:
                    raise DigestMismatch(f'digest mismatch, expected "{self.expected}", got "{digest}"')
                os.fsync(self._file.fileno())
                os.chmod(self.temp, 0o644)
                target = path_for(digest)
                created = replace or not target.exists()
                if created:
                    os.replace(self.temp, target)
                return digest, created
            finally:
                self._close()

    def abort(self) -> None:
        """Remove the temp file now; a write still running finishes first. Safe after commit."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.temp.unlink(missing_ok=True)

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


def write_atomically(path: Path, chunks: Iterable[bytes], expected_digest: str | None = None) -> tuple[str, int]:
    """Write into a temp file beside `path`, hash on the way, rename into place only if the digest matches.

    Returns ("sha256:<hex>", size). On a mismatch or any error nothing is left behind.
    """
    with BlobWriter(path.parent, expected_digest, label=path.name) as writer:
        for chunk in chunks:
            writer.write(chunk)
        digest, _ = writer.commit(lambda _: path, replace=True)
        return digest, writer.size


def remove_stale_temp_files(root: Path) -> list[Path]:
    """Delete the temp files that an interrupted upload, pull or create, or a killed serve, left in `root`'s
    blobs/ and manifests/ (at serve's start). A file of another live process (a second serve on the same store)
    is kept; this process has written nothing yet, so its own pid counts as stale (a reused pid in a container)."""
    removed = []
    candidates = list((root / "blobs").glob("*")) + list((root / "manifests").rglob("*"))
    for path in candidates:
        pid = _temp_file_pid(path.name)
        if pid is None or (pid != os.getpid() and _process_alive(pid)) or not path.is_file():
            continue
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _temp_file_pid(name: str) -> int | None:
    for pattern in _TEMP_RES:
        if match := pattern.fullmatch(name):
            return int(match.group(1))
    return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


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
