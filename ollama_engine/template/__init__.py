"""Chat prompts: GGUF Jinja chat templates, Ollama Go templates, stop tokens, tool-call parsing."""
