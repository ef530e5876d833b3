"""GGUF model files: metadata (as a typed Config) and the tensor index."""

from ollama_engine.fs.config import Config
from ollama_engine.fs.gguf_file import SUPPORTED_TYPES, GGUFError, GGUFFile, TensorInfo

__all__ = ["Config", "GGUFError", "GGUFFile", "SUPPORTED_TYPES", "TensorInfo"]
