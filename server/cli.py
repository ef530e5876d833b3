"""The `runner` command: `ollama-engine runner --model PATH --port N [--host 127.0.0.1]`.

Ollama's parent starts its runner as `<exe> runner --ollama-engine --model PATH --port N`; the same
command line works here (`--ollama-engine` is accepted and ignored). Without --model only /info works,
which is how Ollama discovers GPUs.
"""

from __future__ import annotations

import argparse

from ollama_engine.server.parent import watch_parent

from .app import serve


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="the GGUF file to serve")
    parser.add_argument("--port", type=int, default=8080, help="TCP port to listen on (default 8080)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--ollama-engine", action="store_true", help=argparse.SUPPRESS)


def add_runner_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `runner` on the `ollama-engine` command's subparsers."""
    parser = subparsers.add_parser("runner", help="serve one model over Ollama's runner protocol")
    add_runner_arguments(parser)
    parser.set_defaults(run=run_runner)


def run_runner(args: argparse.Namespace) -> int:
    watch_parent()  # a runner never outlives the serve that started it
    serve(args.model or None, args.host, args.port)
    return 0
