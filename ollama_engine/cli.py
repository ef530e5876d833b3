"""The `ollama-engine` command. Output meant for people goes to stdout; logs go to stderr."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ollama_engine.envconfig import server_list

# Modules that register commands, with the commands each one registers. Only the module of the command
# being run is imported (every one for help or an unknown name): `runner` starts at every model load, and
# importing serve's, the client's, diff's and plan's modules cost it a third of its import time.
# A command missing from its set here still works: it is unknown, so every module is imported.
COMMAND_MODULES: tuple[tuple[str, str, frozenset[str]], ...] = (
    ("ollama_engine.server.cli", "add_runner_command", frozenset({"runner"})),
    ("ollama_engine.llm.plan", "add_plan_command", frozenset({"plan"})),
    ("ollama_engine.diff", "add_diff_command", frozenset({"diff"})),
    ("ollama_engine.api.serve_command", "add_serve_commands", frozenset({"serve", "stop", "ps"})),
    ("ollama_engine.api.client_cli", "add_client_commands",
     frozenset({"run", "list", "show", "create", "cp", "rm", "pull"})),
)
LOCAL_COMMANDS = frozenset({"devices", "generate", "rpc-server", "demo"})  # registered below


def configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        stream=sys.stderr,
        format="time=%(asctime)s level=%(levelname)s source=%(name)s msg=%(message)r",
    )


def devices_command(args: argparse.Namespace) -> int:
    from ollama_engine import ggml
    from ollama_engine.ml import devices
    from ollama_engine.ml.memory import human_bytes2

    print(f"ggml {ggml.version()}")
    for device in devices():
        print(f"{device.library:>6} {device.id:<14} {device.name:<10} {device.kind:<5} "
              f"{human_bytes2(device.free_memory()):>10} free of {human_bytes2(device.total_memory):>10}  "
              f"{device.description}")
    return 0


def rpc_server_command(args: argparse.Namespace) -> int:
    from ollama_engine.ml.device import serve_rpc

    serve_rpc(args.host, args.port, args.threads)
    return 1


def demo_command(args: argparse.Namespace) -> int:
    from ollama_engine.demo import run_demo

    return run_demo(args.model)


def generate_command(args: argparse.Namespace) -> int:
    from ollama_engine.generate import generate

    generate(args.model, args.prompt, args.n, args.temperature, args.seed, out=sys.stdout)
    return 0


def command_name(argv: list[str]) -> str | None:
    """The command an argument list runs (the first argument not an option: -v takes no value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line parser; with `command`, only that command's module is imported when it names one."""
    known = set().union(LOCAL_COMMANDS, *(names for _, _, names in COMMAND_MODULES))
    parser = argparse.ArgumentParser(prog="ollama-engine", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("devices", help="list the ggml devices and their memory").set_defaults(run=devices_command)
    gen = commands.add_parser("generate", help="complete a prompt in-process, printing only the generated text")
    gen.add_argument("--model", required=True, help="a GGUF file")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("-n", type=int, default=128, help="tokens to generate at most (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--seed", type=int, default=-1, help="sampling seed; -1 draws one")
    gen.set_defaults(run=generate_command)
    for module, register, names in COMMAND_MODULES:
        if command not in known or command in names:
            getattr(importlib.import_module(module), register)(commands)
    rpc_server = commands.add_parser("rpc-server", help="serve this machine's ggml devices to other hosts (RPC)")
    rpc_server.add_argument("--host", default="127.0.0.1",
                            help="IPv4 address to listen on (default: loopback only; 0.0.0.0: every interface)")
    rpc_server.add_argument("--port", type=int, default=50052, help="TCP port (default 50052)")
    rpc_server.add_argument("--threads", type=int, default=0, help="CPU threads (default: every core)")
    rpc_server.set_defaults(run=rpc_server_command)
    for name in ("serve", "runner", "plan"):  # serve passes them on to its runners
        if name not in commands.choices:
            continue
        commands.choices[name].add_argument(
            "--rpc-servers", metavar="HOST:PORT,...",
            help="ggml RPC servers whose devices take layers like GPUs (instead of OLLAMA_RPC_SERVERS)")
    demo = commands.add_parser("demo", help="the end-to-end demo")
    demo.add_argument("--model", help="a GGUF file (default: a generated synthetic model)")
    demo.set_defaults(run=demo_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    command = command_name(sys.argv[1:] if argv is None else argv)
    if command == "runner":  # set before numpy loads OpenBLAS, whose threads spun 0.07 s of CPU at import
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # and then sat idle: ggml does the runner's math
        # The runner speaks plain HTTP on loopback: without the ssl module aiohttp skips the two TLS contexts
        # it builds at import (4 MiB of resident memory and 0.05 s of every start).
        sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]
    args = build_parser(command).parse_args(argv)
    configure_logging(args.verbose)
    if getattr(args, "rpc_servers", None) and args.command != "serve":  # serve passes them to its runners
        from ollama_engine.ml.device import use_rpc_servers

        use_rpc_servers(server_list(args.rpc_servers))
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # the command line reports, it does not dump a traceback
        if args.verbose:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1
