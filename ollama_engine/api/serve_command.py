"""`ollama-engine serve`, and the commands that are clients of it (`stop`, `ps`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from ollama_engine import envconfig
from ollama_engine.envconfig import EnvConfig, server_list

from .client_cli import call


def add_serve_commands(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="serve Ollama's API (configured by OLLAMA_* variables)")
    serve.set_defaults(run=run_serve)
    stop = subparsers.add_parser("stop", help="unload a model from a running serve")
    stop.add_argument("model")
    stop.add_argument("--force", action="store_true", help="also end its in-flight requests (with an error)")
    stop.set_defaults(run=run_stop)
    ps = subparsers.add_parser("ps", help="list the models a running serve has loaded")
    ps.set_defaults(run=run_ps)


def run_serve(args: argparse.Namespace) -> int:
    from .serve import serve

    if envconfig.debug() or args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    else:  # scheduling decisions (loads, reloads and why, evictions) are what an operator reads
        logging.getLogger("ollama_engine.sched").setLevel(logging.INFO)
        logging.getLogger("ollama_engine.api").setLevel(logging.INFO)
    config = EnvConfig.from_env()
    if args.rpc_servers:
        config = dataclasses.replace(config, rpc_servers=tuple(server_list(args.rpc_servers)))
    serve(config)
    return 0


def run_stop(args: argparse.Namespace) -> int:
    if args.force:
        call("POST", "/api/stop", {"model": args.model, "force": True})
    else:  # what `ollama stop` sends
        call("POST", "/api/generate", {"model": args.model, "keep_alive": 0})
    return 0


def run_ps(args: argparse.Namespace) -> int:
    models = call("GET", "/api/ps")["models"]
    print(f"{'NAME':<32} {'STATE':<9} {'QUEUE':>5} {'SIZE':>12} {'CONTEXT':>8}  UNTIL")
    for model in models:
        print(f"{model['name']:<32} {model.get('state', ''):<9} {model.get('queue_depth', 0):>5} "
              f"{model['size']:>12} {model.get('context_length', 0):>8}  {model['expires_at']}")
    return 0

