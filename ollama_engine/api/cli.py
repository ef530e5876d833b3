"""`ollama-engine serve`, and the commands that are clients of it (`stop`, `ps`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import urllib.error
import urllib.request
from typing import Any

from ollama_engine.envconfig import EnvConfig


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

    debug = os.environ.get("OLLAMA_DEBUG", "").strip() not in ("", "0", "false")
    if debug or args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    else:  # scheduling decisions (loads, reloads and why, evictions) are what an operator reads
        logging.getLogger("ollama_engine.sched").setLevel(logging.INFO)
        logging.getLogger("ollama_engine.api").setLevel(logging.INFO)
    serve(EnvConfig.from_env())
    return 0


def _client_url(config: EnvConfig) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{config.port}"


def _call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    url = _client_url(EnvConfig.from_env()) + path
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        message = err.read().decode(errors="replace")
        try:
            message = json.loads(message)["error"]
        except (ValueError, KeyError, TypeError):
            pass
        raise RuntimeError(message) from None
    except urllib.error.URLError as err:
        raise RuntimeError(f"could not connect to ollama-engine serve at {url}: {err.reason}") from None


def run_stop(args: argparse.Namespace) -> int:
    if args.force:
        _call("POST", "/api/stop", {"model": args.model, "force": True})
    else:  # what `ollama stop` sends
        _call("POST", "/api/generate", {"model": args.model, "keep_alive": 0})
    return 0


def run_ps(args: argparse.Namespace) -> int:
    models = _call("GET", "/api/ps")["models"]
    print(f"{'NAME':<32} {'STATE':<9} {'QUEUE':>5} {'SIZE':>12} {'CONTEXT':>8}  UNTIL")
    for model in models:
        print(f"{model['name']:<32} {model.get('state', ''):<9} {model.get('queue_depth', 0):>5} "
              f"{model['size']:>12} {model.get('context_length', 0):>8}  {model['expires_at']}")
    return 0

