"""What a request's model name stands for: the runnable Model, and everything the API renders it with.

One lookup per request in Ollama's store (or a GGUF path), then a cached view of the GGUF (metadata,
vocabulary, tokenizer, chat template) keyed by file and modification time, so a chat turn does not
re-read a 100 MB file. The Modelfile's TEMPLATE (Go syntax) wins over the GGUF's Jinja chat template;
without either the prompt passes through raw (Ollama's `{{ .Prompt }}`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ollama_engine.fs import GGUFFile
from ollama_engine.sched import Model
from ollama_engine.store import InvalidName, ModelNotFound, ResolvedModel, Store, StoreError, parse_name
from ollama_engine.template import (
    DEFAULT_TEMPLATE,
    ChatTemplate,
    GoTemplate,
    parse_go_template,
    template_capabilities,
)
from ollama_engine.tokenizer import Tokenizer, Vocabulary, from_metadata

RANK_POOLING = 4  # `<arch>.pooling_type` of a reranker (llama.cpp's LLAMA_POOLING_TYPE_RANK)


class ModelNotFoundError(LookupError):
    """No GGUF file and no stored model under this name (404)."""


class GGUFView:
    """The parts of one GGUF file the API needs, built on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gguf = GGUFFile.open(path)
        self.metadata: dict[str, Any] = self.gguf.metadata
        self.architecture = str(self.metadata.get("general.architecture", ""))
        self._lock = threading.Lock()

    @cached_property
    def vocabulary(self) -> Vocabulary:
        return Vocabulary(self.metadata)

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        return ChatTemplate.from_metadata(self.metadata)

    @property
    def tokenizer(self) -> Tokenizer:
        with self._lock:  # built once, possibly from a worker thread
            if "_tokenizer" not in self.__dict__:
                self.__dict__["_tokenizer"] = from_metadata(self.metadata)
            return self.__dict__["_tokenizer"]

    @property
    def embedding_only(self) -> bool:
        """A pooling model (BERT-style): embeddings, no completion (Ollama's capability rule)."""
        return f"{self.architecture}.pooling_type" in self.metadata

    @property
    def reranker(self) -> bool:
        """A classifier scoring query/document pairs (`<arch>.pooling_type` 4, llama.cpp's rank pooling)."""
        return self.metadata.get(f"{self.architecture}.pooling_type") == RANK_POOLING

    @property
    def context_length(self) -> int:
        return int(self.metadata.get(f"{self.architecture}.context_length", 0) or 0)

    @property
    def vision(self) -> bool:
        return f"{self.architecture}.vision.block_count" in self.metadata


_VIEWS: dict[tuple[str, float], GGUFView] = {}
_VIEWS_LOCK = threading.Lock()


def gguf_view(path: Path) -> GGUFView:
    """The cached view of a GGUF file (a new one when the file changed)."""
    key = (str(path), os.stat(path).st_mtime)
    with _VIEWS_LOCK:
        view = _VIEWS.get(key)
    if view is None:
        view = GGUFView(path)
        with _VIEWS_LOCK:
            _VIEWS[key] = view
    return view


@dataclass
class Entry:
    """A resolved model name: what the scheduler runs and what the prompt is built from."""

    name: str  # as responses show it
    full_name: str  # host/namespace/model:tag (Ollama's errors quote it)
    model: Model
    view: GGUFView
    go_template: GoTemplate | None = None
    system: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    stored: ResolvedModel | None = None
    requested: str = ""  # the name as the request spelled it (Ollama echoes it in responses)

    @property
    def chat_template(self) -> ChatTemplate | None:
        return None if self.go_template is not None else self.view.chat_template

    @property
    def template_text(self) -> str:
        """The template in use, as /api/show reports it."""
        if self.go_template is not None:
            return self.go_template.source
        chat = self.view.chat_template
        return chat.source if chat is not None else DEFAULT_TEMPLATE

    @cached_property
    def capabilities(self) -> list[str]:
        """Ollama's capabilities: completion or embedding (ours: rerank for a reranker), then tools, insert,
        thinking, vision."""
        caps = ["rerank"] if self.view.reranker else ["embedding"] if self.view.embedding_only else ["completion"]
        if self.go_template is not None:
            names = self.go_template.vars()
            caps += [cap for cap, var in (("tools", "tools"), ("insert", "suffix"), ("thinking", "think"))
                     if var in names]
        elif self.view.chat_template is not None:
            caps += template_capabilities(self.view.chat_template.source)
        if self.view.vision or (self.stored is not None and self.stored.projector_paths):
            caps.append("vision")
        return caps


class Catalog:
    """Model names → Entry, over one store (and GGUF paths when `model_paths` allows them)."""

    def __init__(self, store: Store, model_paths: bool = False) -> None:
        self.store = store
        self.model_paths = model_paths

    def resolve(self, name: str) -> Entry:
        """ModelNotFoundError for an unknown (or empty) name, InvalidName for one that cannot be."""
        if not name:
            raise ModelNotFoundError(name)
        path = Path(name).expanduser()
        if self.model_paths and (name.endswith(".gguf") or (os.sep in name and path.is_file())):
            if not _is_gguf(path):  # never parse (and quote in an error) a file that is not a model
                raise ModelNotFoundError(name)
            model = Model(name=name, short_name=path.stem, model_path=str(path.resolve()))
            entry = Entry(name=name, full_name=name, model=model, view=gguf_view(path), requested=name)
            entry.model.capabilities = entry.capabilities
            return entry
        try:
            stored = self.store.resolve(name)
        except (ModelNotFound, InvalidName) as err:
            raise ModelNotFoundError(name) from err
        except StoreError as err:
            raise ModelNotFoundError(name) from err
        if not stored.model_path.is_file():
            raise ModelNotFoundError(name)
        model = Model(
            name=stored.short_name, short_name=stored.short_name, model_path=str(stored.model_path),
            digest=stored.digest, adapter_paths=[str(p) for p in stored.adapter_paths],
            projector_paths=[str(p) for p in stored.projector_paths],
            draft_path=str(stored.draft_path or ""),
            family=str(stored.config.get("model_family", "")),
        )
        entry = Entry(
            name=stored.short_name, full_name=str(stored.name), model=model, view=gguf_view(stored.model_path),
            go_template=parse_go_template(stored.template) if stored.template else None, system=stored.system,
            params=dict(stored.params), messages=list(stored.messages), stored=stored, requested=name,
        )
        model.capabilities = entry.capabilities
        return entry


def _is_gguf(path: Path) -> bool:
    try:
        if not path.is_file():  # not a FIFO or a device: opening one could block
            return False
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def full_name(name: str) -> str:
    """registry.ollama.ai/library/x:latest for `x` (Ollama quotes the full name in some 400s)."""
    parsed = parse_name(name)
    return str(parsed) if parsed.is_valid() else name
