"""`python -m ollama_engine` is the `ollama-engine` command."""

from ollama_engine.cli import main

raise SystemExit(main())
