"""The model store: blobs, manifests and the operations behind /api/tags, show, create, copy, delete.

Follows Ollama's server (server/create.go, images.go, routes.go, manifest/ at f63eea3d) so that a store
written by Ollama works here and one written here works in Ollama: same paths, same JSON bytes, same
digests. Two deliberate differences: blobs and manifests are written atomically (temp file + rename),
and an uploaded blob whose sha256 differs from its name is refused and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from ollama_engine.envconfig import models_dir, noprune
from ollama_engine.fs import GGUFError, GGUFFile
from ollama_engine.store import disk
from ollama_engine.store.disk import (
    CONFIG_MEDIA_TYPE,
    MEDIA_ADAPTER,
    MEDIA_DRAFT,
    MEDIA_LICENSE,
    MEDIA_MESSAGES,
    MEDIA_MODEL,
    MEDIA_PARAMS,
    MEDIA_PROJECTOR,
    MEDIA_PROMPT,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    BadRequest,
    BlobNotFound,
    InvalidName,
    Layer,
    Manifest,
    ModelNotFound,
    StoreError,
    check_digest,
)
from ollama_engine.store.modelfile import Command, Modelfile
from ollama_engine.store.names import Name, name_from_parts, parse_name
from ollama_engine.store.params import go_value, parameter_lines
from ollama_engine.template.gojson import GoStruct, go_json
from ollama_engine.template.goparse import TemplateError
from ollama_engine.template.gotemplate import DEFAULT_TEMPLATE, GoTemplate

Progress = Callable[[dict[str, Any]], None]
GGUF_MAGIC = b"GGUF"


def default_root() -> Path:
    """$OLLAMA_MODELS, else ~/.ollama/models (Ollama's envconfig.Models)."""
    return models_dir()


@dataclass
class _Guard:
    """What the threads working on one store share: a lock, the pinned blobs (digest -> how many creates hold
    it) and one lock per model name."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pins: Counter[str] = field(default_factory=Counter)
    names: dict[str, threading.Lock] = field(default_factory=dict)


_GUARDS: dict[Path, _Guard] = {}
_GUARDS_LOCK = threading.Lock()


def _guard_for(root: Path) -> _Guard:
    """One guard per store folder, shared by every Store object on it in this process."""
    with _GUARDS_LOCK:
        return _GUARDS.setdefault(root.resolve(), _Guard())


@dataclass
class ResolvedModel:
    """What the scheduler and the API need to run a stored model."""

    name: Name
    short_name: str
    digest: str  # sha256 hex of the manifest
    model_path: Path
    template: str | None  # the TEMPLATE layer (Go syntax); None: use the GGUF's chat template
    system: str
    params: dict[str, Any]  # the params layer: options defaults (stop, temperature, ...)
    messages: list[dict[str, Any]]
    license: list[str]
    adapter_paths: list[Path] = field(default_factory=list)
    projector_paths: list[Path] = field(default_factory=list)
    draft_path: Path | None = None  # the draft model for speculative decoding (a draft layer), if any
    config: dict[str, Any] = field(default_factory=dict)
    parent_model: str = ""
    modified_at: float = 0.0


class Store:
    """A model store rooted at `root` (default: $OLLAMA_MODELS or ~/.ollama/models)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"
        self._guard = _guard_for(self.root)
        self._local = threading.local()  # .pinned: the digests the create running in this thread holds

    # ---- blobs -----------------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        """blobs/sha256-<hex> for a digest in `sha256:` or `sha256-` form; InvalidDigest otherwise."""
        return self.blobs_dir / check_digest(digest).replace(":", "-")

    def has_blob(self, digest: str) -> bool:
        """HEAD /api/blobs/:digest (InvalidDigest -> 400; False -> 404 `blob "<digest>" not found`)."""
        return self.blob_path(digest).is_file()

    def write_blob(self, data: bytes | BinaryIO | Iterable[bytes], digest: str | None = None) -> tuple[str, bool]:
        """Store bytes as a blob: (digest, created). With `digest`, the content must hash to it
        (POST /api/blobs/:digest: created -> 201, already there -> 200, DigestMismatch -> 400)."""
        if digest is not None:
            expected = check_digest(digest)
            if self.has_blob(expected):
                return expected, False
        else:
            expected = None
        with self.blob_writer(expected) as writer:
            for chunk in disk.read_chunks(data):
                writer.write(chunk)
            return writer.commit(self.blob_path)

    def blob_writer(self, expected_digest: str | None = None) -> disk.BlobWriter:
        """A blob streamed in piece by piece (an upload): a temp file in blobs/, renamed by commit(self.blob_path)
        to its digest's name only when the digest is the expected one."""
        return disk.BlobWriter(self.blobs_dir, expected_digest)

    def remove_temp_files(self) -> list[Path]:
        """Temp files left by an interrupted upload, pull or create, or a killed serve (serve's start-up)."""
        return disk.remove_stale_temp_files(self.root)

    def add_file(self, path: str | os.PathLike[str]) -> str:
        """Copy a local file into the store as a blob (what the CLI uploads before create); its digest."""
        with open(path, "rb") as f:
            return self.write_blob(f)[0]

    # ---- manifests -------------------------------------------------------------------------------

    def manifest_path(self, name: Name) -> Path:
        """manifests/<host>/<namespace>/<model>/<tag>; InvalidName (400, no path) for a part longer than a file
        name can be (Ollama allows a 350-character host; the file system does not)."""
        parts = name.parts()
        if any(len(part.encode()) > disk.NAME_MAX for part in parts):
            raise InvalidName(f'name "{name}" is invalid: a part is longer than {disk.NAME_MAX} characters')
        return self.manifests_dir.joinpath(*parts)

    def read_manifest(self, name: Name) -> Manifest:
        path = self.manifest_path(name)
        try:
            return Manifest.from_bytes(path.read_bytes(), path)
        except FileNotFoundError:
            raise ModelNotFound(f"model '{name.display_shortest()}' not found") from None
        except (ValueError, TypeError) as error:
            raise StoreError(f"{path}: bad manifest: {error}") from error

    def manifests(self) -> dict[Name, Manifest]:
        """Every readable manifest under manifests/*/*/*/* (bad ones are skipped, as Ollama does)."""
        out: dict[Name, Manifest] = {}
        for name, path in self._manifest_files():
            try:
                out[name] = Manifest.from_bytes(path.read_bytes(), path)
            except (OSError, ValueError, TypeError):
                continue
        return out

    def _manifest_files(self) -> Iterator[tuple[Name, Path]]:
        """The name and path of every file under manifests/*/*/*/*, sorted by path."""
        if not self.manifests_dir.is_dir():
            return
        for path in sorted(self.manifests_dir.glob("*/*/*/*")):
            name = name_from_parts(path.relative_to(self.manifests_dir).parts)
            if name is not None and path.is_file():
                yield name, path

    def existing_name(self, name: Name) -> Name:
        """The name with each part spelled as an existing manifest spells it (lookup is case-insensitive).
        A name spelled as stored is itself: every request's lookup reads one manifest, not the whole store."""
        with contextlib.suppress(InvalidName):
            if self.manifest_path(name).is_file():
                return name
        host, namespace, model, tag = name.host, name.namespace, name.model, name.tag
        for existing, _ in self._manifest_files():
            if existing.host.lower() == host.lower():
                host = existing.host
            if existing.namespace.lower() == namespace.lower():
                namespace = existing.namespace
            if existing.model.lower() == model.lower():
                model = existing.model
            if existing.tag.lower() == tag.lower():
                tag = existing.tag
        return Name(host, namespace, model, tag, name.scheme)

    def write_manifest(self, name: Name, config: Layer, layers: Sequence[Layer]) -> Manifest:
        manifest = Manifest(config, list(layers))
        path = self.manifest_path(name)
        disk.write_atomically(path, [manifest.to_bytes()])
        return Manifest.from_bytes(path.read_bytes(), path)

    def lookup(self, model: str) -> tuple[Name, Manifest]:
        """Parse, validate and find a model by name (case-insensitive); InvalidName or ModelNotFound."""
        name = parse_name(model)
        if not name.is_valid():
            raise InvalidName(f'name "{model}" is invalid')
        name = self.existing_name(name)
        return name, self.read_manifest(name)

    # ---- list / show / resolve -------------------------------------------------------------------

    def list_models(self) -> list[dict[str, Any]]:
        """/api/tags `models`: newest first; name and model are the shortest display name."""
        entries = []
        for name, manifest in self.manifests().items():
            config = self._config(manifest)
            model_layer = manifest.first(MEDIA_MODEL)
            entry = {
                "name": name.display_shortest(),
                "model": name.display_shortest(),
                "modified_at": _rfc3339(manifest.mtime),
                "size": manifest.size,
                "digest": manifest.digest,
                "details": _details(config, model_layer.source if model_layer else ""),
            }
            entries.append((manifest.mtime, entry))
        entries.sort(key=lambda e: e[0], reverse=True)
        return [entry for _, entry in entries]

    def resolve(self, model: str) -> ResolvedModel:
        """Everything a stored model runs with: the GGUF path, template, system prompt, parameters."""
        name, manifest = self.lookup(model)
        resolved = ResolvedModel(name=name, short_name=name.display_shortest(), digest=manifest.digest,
                                 model_path=Path(), template=None, system="", params={}, messages=[], license=[],
                                 config=self._config(manifest), modified_at=manifest.mtime)
        for layer in manifest.layers:
            path = self.blob_path(layer.digest)
            kind = layer.media_type
            if kind == MEDIA_MODEL:
                resolved.model_path, resolved.parent_model = path, layer.source
            elif kind == MEDIA_ADAPTER:
                resolved.adapter_paths.append(path)
            elif kind == MEDIA_PROJECTOR:
                resolved.projector_paths.append(path)
            elif kind == MEDIA_DRAFT:
                resolved.draft_path = path
            elif kind in (MEDIA_TEMPLATE, MEDIA_PROMPT):
                resolved.template = path.read_text()
            elif kind == MEDIA_SYSTEM:
                resolved.system = path.read_text()
            elif kind == MEDIA_PARAMS:
                resolved.params = json.loads(path.read_bytes())
            elif kind == MEDIA_MESSAGES:
                resolved.messages = json.loads(path.read_bytes())
            elif kind == MEDIA_LICENSE:
                resolved.license.append(path.read_text())
        if resolved.model_path == Path():
            raise StoreError(f"model '{resolved.short_name}' has no model layer")
        return resolved

    def show(self, model: str, *, verbose: bool = False, system: str | None = None) -> dict[str, Any]:
        """The store's part of /api/show: license, modelfile, parameters, template, system, details,
        messages, model_info, tensors (verbose), modified_at. Capabilities are the API's to add."""
        m = self.resolve(model)
        if system:
            m.system = system
        info = GGUFFile.open(m.model_path)
        template = m.template if m.template is not None else info.metadata.get("tokenizer.chat_template") or ""
        out: dict[str, Any] = {
            "license": "\n".join(m.license),
            "modelfile": self.modelfile(m),
            "parameters": parameter_lines(m.params),
            "template": template,
            "system": m.system,
            "details": _details(m.config, m.parent_model),
            "messages": [{"role": x.get("role", ""), "content": x.get("content", "")} for x in m.messages],
            "model_info": model_info(info, verbose),
            "modified_at": _rfc3339(m.modified_at),
        }
        if verbose:
            out["tensors"] = [{"name": t.name, "type": t.file_type.name, "shape": list(t.shape)}
                              for t in info.tensors.values()]
        return out

    def modelfile(self, m: ResolvedModel) -> str:
        """`ollama show --modelfile`: three comment lines, a blank line, then FROM <blob path> and the rest."""
        commands = [Command("model", str(m.model_path))]
        commands += [Command("adapter", str(p)) for p in m.adapter_paths]
        commands += [Command("model", str(p)) for p in m.projector_paths]
        if m.draft_path is not None:
            commands.append(Command("draft", str(m.draft_path)))
        commands.append(Command("template", m.template if m.template is not None else DEFAULT_TEMPLATE))
        if m.system:
            commands.append(Command("system", m.system))
        for key in sorted(m.params):
            values = m.params[key] if isinstance(m.params[key], list) else [m.params[key]]
            commands += [Command(key, _plain(v)) for v in values]
        commands += [Command("license", text) for text in m.license]
        commands += [Command("message", f"{x.get('role', '')}: {x.get('content', '')}") for x in m.messages]
        header = ('# Modelfile generated by "ollama show"\n# To build a new Modelfile based on this, replace FROM '
                  f"with:\n# FROM {m.short_name}\n\n")
        return header + str(Modelfile(commands))

    # ---- copy / delete / prune -------------------------------------------------------------------

    def copy(self, source: str, destination: str) -> None:
        """/api/copy: the manifest file is copied; the blobs are shared. Same path: nothing to do."""
        src = parse_name(source)
        if not src.is_valid():
            raise InvalidName(f'source "{source}" is invalid')
        dst = parse_name(destination)
        if not dst.is_valid():
            raise InvalidName(f'destination "{destination}" is invalid')
        src, dst = self.existing_name(src), self.existing_name(dst)
        src_path, dst_path = self.manifest_path(src), self.manifest_path(dst)
        if src_path == dst_path:
            return
        if not src_path.is_file():
            raise ModelNotFound(f'model "{source}" not found')
        disk.write_atomically(dst_path, [src_path.read_bytes()])

    def delete(self, model: str) -> list[str]:
        """/api/delete: remove the manifest, prune empty folders, delete blobs no other manifest uses.
        Returns the digests of the blobs deleted."""
        name = parse_name(model)
        if not name.is_valid():
            raise InvalidName(f'name "{model}" is invalid')
        name = self.existing_name(name)
        with self._name_lock(name):
            try:
                manifest = self.read_manifest(name)
            except ModelNotFound:
                raise ModelNotFound(f"model '{model}' not found") from None
            assert manifest.path is not None
            manifest.path.unlink()
            self._prune_dirs(self.manifests_dir)
            return self._remove_unused(manifest.all_digests())

    def prune(self, keep: Iterable[str] = ()) -> list[str]:
        """Delete blobs no manifest references (Ollama does this at start-up unless OLLAMA_NOPRUNE);
        `keep` protects digests just uploaded and waiting for create."""
        if not self.blobs_dir.is_dir():
            return []
        protected = {check_digest(d) for d in keep}
        candidates = []
        for path in self.blobs_dir.iterdir():
            if path.is_file() and disk.DIGEST_RE.fullmatch(path.name):
                digest = check_digest(path.name)
                if digest not in protected:
                    candidates.append(digest)
        return self._remove_unused(candidates)

    def _remove_unused(self, digests: Iterable[str]) -> list[str]:
        """Delete those of `digests` that no manifest references and no create in progress holds (pinned).
        Under the store's lock, so a create pins its blobs either before (kept) or after (it writes them again)."""
        with self._guard.lock:
            in_use = {d for m in self.manifests().values() for d in m.all_digests()} | set(self._guard.pins)
            removed = []
            for digest in dict.fromkeys(digests):
                if digest in in_use:
                    continue
                try:
                    self.blob_path(digest).unlink()
                    removed.append(digest)
                except FileNotFoundError:
                    pass
            return removed

    @contextlib.contextmanager
    def _name_lock(self, name: Name) -> Iterator[None]:
        """Creates and deletes of one name run one at a time: each reads the manifest it replaces and removes
        that one's unused blobs, which must not be blobs another create of the name is about to reference."""
        key = str(name).lower()
        with self._guard.lock:
            lock = self._guard.names.setdefault(key, threading.Lock())
        with lock:
            yield

    @contextlib.contextmanager
    def _pinning(self) -> Iterator[None]:
        """Blobs a create will reference are pinned (never removed as unused) until its manifest is written."""
        self._local.pinned = pinned = []
        try:
            yield
        finally:
            self._local.pinned = None
            with self._guard.lock:
                self._guard.pins.subtract(pinned)
                for digest in pinned:
                    if self._guard.pins[digest] <= 0:
                        self._guard.pins.pop(digest, None)

    def _pin(self, digest: str) -> str:
        """Pin a blob for the create running in this thread (no-op outside a create); the digest."""
        digest = check_digest(digest)
        pinned = getattr(self._local, "pinned", None)
        if pinned is not None:
            with self._guard.lock:
                self._guard.pins[digest] += 1
            pinned.append(digest)
        return digest

    def _prune_dirs(self, path: Path) -> None:
        for child in path.iterdir() if path.is_dir() else ():
            if child.is_dir() and not child.is_symlink():
                self._prune_dirs(child)
                if not any(child.iterdir()):
                    child.rmdir()

    # ---- create ----------------------------------------------------------------------------------

    def create(self, model: str, *, files: Mapping[str, str] | None = None, adapters: Mapping[str, str] | None = None,
               from_: str | None = None, template: str | None = None, system: str | None = None,
               license: str | Sequence[str] | None = None, parameters: Mapping[str, Any] | None = None,
               messages: Sequence[Mapping[str, Any]] | None = None, progress: Progress | None = None,
               drafts: Mapping[str, str] | None = None) -> Name:
        """/api/create from uploaded GGUF blobs (`files`: {relative file name: digest}) or an existing model
        (`from_`), with TEMPLATE / SYSTEM / LICENSE / PARAMETER / MESSAGE overrides and a draft model
        (`drafts`, Ollama's draft_files: one GGUF, stored as a draft layer). Progress gets the status lines
        Ollama streams except the final `success` (the API sends that)."""
        report = progress or (lambda _: None)
        if drafts and len(drafts) > 1:
            raise BadRequest("draft_files: a model has one draft model (one GGUF file)")
        for path, digest in {**(files or {}), **(adapters or {}), **(drafts or {})}.items():
            if not _valid_relative_path(path):
                raise BadRequest("file path must be relative")
            if not digest:
                raise disk.InvalidDigest()
        name = parse_name(model)
        if not name.is_valid():
            raise InvalidName("invalid model name")
        name = self.existing_name(name)
        self.manifest_path(name)  # a name that cannot be a path is refused before any work
        with self._name_lock(name), self._pinning():
            for digest in {**(files or {}), **(adapters or {}), **(drafts or {})}.values():
                self._pin(digest)
            self._create(name, files, adapters, from_, template, system, license, parameters, messages, report,
                         drafts)
        return name

    def _create(self, name: Name, files: Mapping[str, str] | None, adapters: Mapping[str, str] | None,
                from_: str | None, template: str | None, system: str | None, license: str | Sequence[str] | None,
                parameters: Mapping[str, Any] | None, messages: Sequence[Mapping[str, Any]] | None,
                report: Progress, drafts: Mapping[str, str] | None = None) -> None:
        """create's work, under the name's lock with its blobs pinned."""
        old = self._maybe_manifest(name)

        config: dict[str, Any] = {"families": []}
        if from_:
            layers = self._layers_from_model(from_, config)
        elif files:
            layers = [self._gguf_layer(digest, config, report) for _, digest in sorted(files.items())]
        else:
            raise BadRequest("neither 'from' or 'files' was specified")
        for _, digest in sorted((adapters or {}).items()):
            layers.append(self._gguf_layer(digest, {"families": []}, report, adapter=True))
        for _, digest in sorted((drafts or {}).items()):  # replaces the draft a `from` model had
            layers = [x for x in layers if x.media_type != MEDIA_DRAFT]
            layers.append(self._gguf_layer(digest, {"families": []}, report, draft=True))

        if template:
            try:
                GoTemplate.parse(template)
            except TemplateError as error:
                raise BadRequest(f"template error: {error}") from error
            layers = self._replace_layer(layers, MEDIA_TEMPLATE, template.encode())
        if system:
            layers = self._replace_layer(layers, MEDIA_SYSTEM, system.encode())
        for text in [license] if isinstance(license, str) else list(license or []):
            if text:
                layers.append(self._new_layer(text.encode(), MEDIA_LICENSE))
        layers = self._set_parameters(layers, dict(parameters or {}))
        if messages:
            encoded = go_json([_message_json(m) for m in messages]) + "\n"
            layers = self._replace_layer(layers, MEDIA_MESSAGES, encoded.encode())

        config_layer = self._new_layer((go_json(_config_json(config, layers)) + "\n").encode(), CONFIG_MEDIA_TYPE)
        for layer in layers:
            if layer.status:
                report({"status": layer.status})
        report({"status": "writing manifest"})
        self.write_manifest(name, config_layer, layers)
        if old is not None and not noprune():
            self._remove_unused(old.all_digests())

    def create_from_modelfile(self, model: str, modelfile: Modelfile, relative_dir: str | os.PathLike[str] = ".",
                              progress: Progress | None = None) -> Name:
        """Create locally from a parsed Modelfile: copy its files in as blobs, then `create`."""
        request, uploads = modelfile.create_request(relative_dir)
        for digest, path in uploads.items():
            with open(path, "rb") as f:
                self.write_blob(f, digest)
        return self.create(model, files=request.get("files"), adapters=request.get("adapters"),
                           from_=request.get("from"), template=request.get("template"), system=request.get("system"),
                           license=request.get("license"), parameters=request.get("parameters"),
                           messages=request.get("messages"), progress=progress, drafts=request.get("draft_files"))

    # ---- create helpers --------------------------------------------------------------------------

    def _maybe_manifest(self, name: Name) -> Manifest | None:
        try:
            return self.read_manifest(name)
        except StoreError:
            return None

    def _new_layer(self, data: bytes, media_type: str) -> Layer:
        digest, created = self.write_blob(data, self._pin("sha256:" + hashlib.sha256(data).hexdigest()))
        os.utime(self.blob_path(digest))
        layer = Layer(media_type, digest, len(data))
        layer.status = f"{'creating new' if created else 'using existing'} layer {digest}"
        return layer

    def _replace_layer(self, layers: list[Layer], media_type: str, data: bytes) -> list[Layer]:
        kept = [x for x in layers if x.media_type != media_type]
        return kept + [self._new_layer(data, media_type)]

    def _gguf_layer(self, digest: str, config: dict[str, Any], report: Progress, adapter: bool = False,
                    draft: bool = False) -> Layer:
        report({"status": "parsing GGUF"})
        path = self.blob_path(digest)
        if not path.is_file():
            raise StoreError(f"open {path}: no such file or directory")
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise BadRequest("supplied file was not in GGUF format")
        try:
            gguf = GGUFFile.open(path)
        except GGUFError as error:
            raise BadRequest(f"supplied file was not in GGUF format: {error}") from error
        kind = gguf.metadata.get("general.type", "")
        media_type = MEDIA_MODEL
        arch = str(gguf.metadata.get("general.architecture", ""))
        if draft:
            if kind in ("adapter", "projector") or not gguf.metadata.get(f"{arch}.block_count"):
                raise BadRequest("draft_files: the draft must be a language model GGUF")
            media_type = MEDIA_DRAFT
        elif adapter or kind == "adapter":
            media_type = MEDIA_ADAPTER
        elif kind == "projector" or (not gguf.metadata.get(f"{arch}.block_count")
                                     and gguf.metadata.get(f"{arch}.vision.block_count")):
            media_type = MEDIA_PROJECTOR
        if media_type == MEDIA_MODEL:
            _describe_gguf(gguf, config)
        os.utime(path)
        layer = Layer(media_type, check_digest(digest), path.stat().st_size, source=str(path))
        layer.status = f"using existing layer {layer.digest}"
        return layer

    def _layers_from_model(self, source: str, config: dict[str, Any]) -> list[Layer]:
        src = parse_name(source)
        if not src.is_valid():
            raise InvalidName("invalid model name")
        src = self.existing_name(src)
        manifest = self.read_manifest(src)
        layers = []
        for old in manifest.layers:
            path = self.blob_path(self._pin(old.digest))
            if not path.is_file():
                raise StoreError(f"stat {path}: no such file or directory")
            layer = Layer(old.media_type, old.digest, path.stat().st_size, src.display_shortest(), old.name)
            layer.status = f"using existing layer {old.digest}"
            if old.media_type == MEDIA_MODEL:
                _describe_gguf(GGUFFile.open(path), config)
            layers.append(layer)
        base = self._config(manifest)
        for key in ("renderer", "parser", "requires", "capabilities"):
            if base.get(key):
                config.setdefault(key, base[key])
        return layers

    def _set_parameters(self, layers: list[Layer], params: dict[str, Any]) -> list[Layer]:
        """User parameters over the existing params layer's; a user key replaces the old value whole."""
        for layer in layers:
            if layer.media_type == MEDIA_PARAMS:
                for key, value in json.loads(self.blob_path(layer.digest).read_bytes()).items():
                    params.setdefault(key, value)
        if not params:
            return layers
        return self._replace_layer(layers, MEDIA_PARAMS, (go_json(params) + "\n").encode())

    def _config(self, manifest: Manifest) -> dict[str, Any]:
        if not manifest.config.digest:
            return {}
        try:
            return json.loads(self.blob_path(manifest.config.digest).read_bytes())
        except (OSError, ValueError):
            return {}


# ---- module helpers ------------------------------------------------------------------------------

FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 4: "MXFP4", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 21: "Q2_K_S", 32: "BF16"}


def file_type_name(file_type: int | None) -> str:
    """general.file_type as Ollama names it; 0 and absent read as "unknown" (Ollama's KV.FileType)."""
    if not file_type:
        return "unknown"
    return FILE_TYPES.get(int(file_type), "unknown")


def human_number(n: int) -> str:
    """Ollama's format.HumanNumber: 135M, 1.24B, 25.2B, 54."""
    for unit, suffix, decimals in ((10**9, "B", 1), (10**6, "M", 2), (10**3, "K", 0)):
        if n >= unit:
            value = n / unit
            if suffix == "K" or value == int(value):
                return f"{value:.0f}{suffix}"
            return f"{value:.{decimals}f}{suffix}"
    return str(n)


def parameter_count(gguf: GGUFFile) -> int:
    return sum(t.n_elements for t in gguf.tensors.values())


def model_info(gguf: GGUFFile, verbose: bool = False) -> dict[str, Any]:
    """/api/show `model_info`: the GGUF's key/values without general.name and the chat template; arrays
    longer than 5 become [] unless verbose; general.parameter_count computed from the tensors."""
    out: dict[str, Any] = {}
    for key, value in gguf.metadata.items():
        if key in ("general.name", "tokenizer.chat_template"):
            continue
        if isinstance(value, (list, tuple)) and len(value) > 5 and not verbose:
            value = []
        elif isinstance(value, bytes):
            value = value.decode(errors="replace")
        out[key] = value
    out["general.parameter_count"] = parameter_count(gguf)
    return out


def _describe_gguf(gguf: GGUFFile, config: dict[str, Any]) -> None:
    arch = str(gguf.metadata.get("general.architecture", ""))
    config.setdefault("format", "gguf")
    config.setdefault("family", arch)
    config.setdefault("type", human_number(parameter_count(gguf)))
    config.setdefault("file_type", file_type_name(gguf.metadata.get("general.file_type")))
    config["families"].append(arch)


def _config_json(config: dict[str, Any], layers: Sequence[Layer]) -> GoStruct:
    """Ollama's ConfigV2, fields in its order (omitempty ones only when set)."""
    out = GoStruct(model_format=config.get("format", ""), model_family=config.get("family", ""),
                   model_families=config.get("families") or None, model_type=config.get("type", ""),
                   file_type=config.get("file_type", ""))
    for key in ("renderer", "parser", "requires", "remote_host", "remote_model", "capabilities"):
        if config.get(key):
            out[key] = config[key]
    out.update(architecture="amd64", os="linux",
               rootfs=GoStruct(type="layers", diff_ids=[layer.digest for layer in layers]))
    return out


def _details(config: Mapping[str, Any], parent_model: str) -> dict[str, Any]:
    details = {"parent_model": parent_model, "format": config.get("model_format", ""),
               "family": config.get("model_family", ""), "families": config.get("model_families"),
               "parameter_size": config.get("model_type", ""), "quantization_level": config.get("file_type", "")}
    for key in ("context_length", "embedding_length"):
        if config.get(key):
            details[key] = config[key]
    return details


def _message_json(m: Mapping[str, Any]) -> GoStruct:
    out = GoStruct(role=m.get("role", ""), content=m.get("content", ""))
    for key in ("thinking", "images", "tool_calls", "tool_name", "tool_call_id"):
        if m.get(key):
            out[key] = m[key]
    return out


def _plain(value: Any) -> str:
    return go_value(value, quoted=False)


def _valid_relative_path(path: str) -> bool:
    """Go's fs.ValidPath: slash-separated, unrooted, no empty, `.` or `..` elements (or exactly `.`)."""
    if path == ".":
        return True
    if not path or path.startswith("/") or "\\" in path:
        return False
    return all(part not in ("", ".", "..") for part in PurePosixPath(path).parts) and not path.endswith("/") \
        and "//" not in path


def _rfc3339(mtime: float) -> str:
    """RFC 3339 with nanoseconds and the local offset, as Go marshals a file's modification time."""
    stamp = datetime.datetime.fromtimestamp(mtime).astimezone()
    nanos = int(round((mtime - int(mtime)) * 1e9)) % 1_000_000_000
    text = stamp.strftime("%Y-%m-%dT%H:%M:%S")
    if nanos:
        text += "." + f"{nanos:09d}".rstrip("0")
    offset = stamp.strftime("%z")
    return text + ("Z" if offset in ("+0000", "") else f"{offset[:3]}:{offset[3:]}")


__all__ = ["BlobNotFound", "ResolvedModel", "Store", "default_root", "file_type_name", "human_number",
           "model_info"]
