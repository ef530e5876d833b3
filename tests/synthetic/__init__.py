"""Synthetic GGUF models for the tests and benchmarks: every architecture in llama.cpp's tensor layout (and
Ollama's own where it wrote files differently), with random weights and a real tokenizer copied from one of
llama.cpp's vocab-only files. Not part of the installed engine: it needs llama.cpp's source tree.

Scripts outside tests/ (bench/, tools/, dev.py) put this folder's parent on sys.path to import it.
"""
