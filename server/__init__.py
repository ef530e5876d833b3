"""The runner subprocess's HTTP API (imported as ollama_engine.server)."""
