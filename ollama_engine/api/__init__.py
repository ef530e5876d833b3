"""`ollama-engine serve`: Ollama's HTTP API on the scheduler."""
