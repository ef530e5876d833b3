"""Ollama's model store under $OLLAMA_MODELS: names, sha256 blobs, manifests, Modelfiles, and the
operations behind /api/tags, show, create, copy, delete and /api/blobs. A store written by Ollama
works here and one written here works in Ollama (same paths, JSON bytes and digests)."""

from ollama_engine.store.disk import (
    BadRequest,
    BlobNotFound,
    DigestMismatch,
    InvalidDigest,
    InvalidName,
    Layer,
    Manifest,
    ModelNotFound,
    NotFound,
    StoreError,
    check_digest,
    file_digest,
)
from ollama_engine.store.modelfile import Command, Modelfile, ModelfileError, parse_modelfile
from ollama_engine.store.names import Name, parse_name, parse_name_bare
from ollama_engine.store.params import ParameterError, format_param, parameter_lines
from ollama_engine.store.store import ResolvedModel, Store, default_root, human_number, model_info

__all__ = [
    "BadRequest", "BlobNotFound", "Command", "DigestMismatch", "InvalidDigest", "InvalidName", "Layer", "Manifest",
    "Modelfile", "ModelfileError", "ModelNotFound", "Name", "NotFound", "ParameterError", "ResolvedModel", "Store",
    "StoreError", "check_digest", "default_root", "file_digest", "format_param", "human_number", "model_info",
    "parameter_lines", "parse_modelfile", "parse_name", "parse_name_bare",
]
