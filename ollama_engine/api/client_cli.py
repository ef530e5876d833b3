"""The commands that are clients of a running `serve` (like `ollama run/list/show/create/cp/rm/pull`).

OLLAMA_HOST says where serve listens (the same variable serve reads). Streams are read line by line, so
`run` prints tokens as they come and `create`/`pull` show progress. Only the standard library: the CLI
must work in the base install.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from ollama_engine.envconfig import EnvConfig
from ollama_engine.store import parse_modelfile

from .attach import AttachmentError, attach_images

UPLOAD_CHUNK = 1 << 20


class ClientError(RuntimeError):
    """What serve answered with an error (or that it could not be reached)."""


def base_url() -> str:
    config = EnvConfig.from_env()
    host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{config.port}"


def request(method: str, path: str, body: Any = None, data: bytes | BinaryIO | Iterable[bytes] | None = None,
            timeout: float | None = None, headers: dict[str, str] | None = None) -> Any:
    """Open a request to serve; the response object (a context manager), errors as ClientError. `data` may be
    an iterable of chunks (streamed; give its Content-Length in `headers`, else it goes chunked)."""
    url = base_url() + path
    if body is not None:
        data = json.dumps(body).encode()
    headers = {**({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)  # type: ignore[arg-type]
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as err:
        message = err.read().decode(errors="replace")
        try:
            message = json.loads(message)["error"]
        except (ValueError, KeyError, TypeError):
            pass
        raise ClientError(message or f"HTTP {err.code}") from None
    except urllib.error.URLError as err:
        raise ClientError(f"could not connect to ollama-engine serve at {url}: {err.reason} "
                          "(start it with `ollama-engine serve`, or set OLLAMA_HOST)") from None


def call(method: str, path: str, body: Any = None) -> Any:
    with request(method, path, body) as response:
        raw = response.read()
    return json.loads(raw) if raw.strip() else None


def stream(path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """NDJSON lines of a streamed POST; an `error` line raises."""
    with request("POST", path, body) as response:
        for line in response:
            if not line.strip():
                continue
            item = json.loads(line)
            if "error" in item:
                raise ClientError(item["error"])
            yield item


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# ---------------------------------------------------------------- commands


def run_list(args: argparse.Namespace) -> int:
    models = call("GET", "/api/tags")["models"]
    print(f"{'NAME':<40} {'ID':<14} {'SIZE':>10}  MODIFIED")
    for m in models:
        print(f"{m['name']:<40} {m['digest'][:12]:<14} {human_size(m['size']):>10}  {m['modified_at'][:19]}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    info = call("POST", "/api/show", {"model": args.model})
    if args.modelfile:
        print(info["modelfile"])
        return 0
    if args.template:
        print(info.get("template", ""))
        return 0
    details, model_info = info.get("details") or {}, info.get("model_info") or {}
    arch = model_info.get("general.architecture", details.get("family", ""))
    print("  Model")
    for key, value in (("architecture", arch), ("parameters", details.get("parameter_size", "")),
                       ("context length", model_info.get(f"{arch}.context_length", "")),
                       ("embedding length", model_info.get(f"{arch}.embedding_length", "")),
                       ("quantization", details.get("quantization_level", ""))):
        print(f"    {key:<20}{value}")
    print("\n  Capabilities")
    for cap in info.get("capabilities") or []:
        print(f"    {cap}")
    if info.get("parameters"):
        print("\n  Parameters")
        for line in info["parameters"].splitlines():
            print(f"    {line}")
    if info.get("system"):
        print(f"\n  System\n    {info['system']}")
    return 0


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(UPLOAD_CHUNK):
            sha.update(chunk)
    return "sha256:" + sha.hexdigest()


class UploadProgress:
    """`copying file sha256:… 42% (1.2 GB/2.8 GB)` on stderr: redrawn in place on a terminal, otherwise one line
    at the end (logs stay short)."""

    def __init__(self, digest: str, total: int, out: TextIO | None = None) -> None:
        self.digest, self.total, self.out = digest, total, out or sys.stderr
        self.interactive = self.out.isatty()
        self.last_draw = 0.0

    def update(self, done: int) -> None:
        now = time.monotonic()
        if self.interactive and (now - self.last_draw >= 0.1 or done >= self.total):
            self.last_draw = now
            print(f"\r{self.line(done)}", end="", file=self.out, flush=True)

    def finish(self) -> None:
        print(f"\r{self.line(self.total)}" if self.interactive else self.line(self.total), file=self.out)

    def line(self, done: int) -> str:
        percent = 100 * done // self.total if self.total else 100
        return f"copying file {self.digest} {percent}% ({human_size(done)}/{human_size(self.total)})"


def file_chunks(path: Path, progress: UploadProgress | None = None) -> Iterator[bytes]:
    """The file 1 MiB at a time (never read whole), reporting how much went out."""
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(UPLOAD_CHUNK):
            done += len(chunk)
            yield chunk
            if progress is not None:
                progress.update(done)


def upload_blob(path: Path, show_progress: bool = False) -> str:
    """POST /api/blobs/<digest> unless serve already has it (HEAD), streaming the file with its length; the
    digest."""
    digest = _digest(path)
    try:
        with request("HEAD", f"/api/blobs/{digest}"):
            return digest
    except ClientError:
        pass
    size = path.stat().st_size
    progress = UploadProgress(digest, size) if show_progress else None
    with request("POST", f"/api/blobs/{digest}", data=file_chunks(path, progress),
                 headers={"Content-Length": str(size)}) as response:
        response.read()
    if progress is not None:
        progress.finish()
    return digest


def run_create(args: argparse.Namespace) -> int:
    path = Path(args.file)
    modelfile = parse_modelfile(path.read_bytes())
    body, uploads = modelfile.create_request(path.parent)
    for digest, file in uploads.items():
        print(f"uploading {file}", file=sys.stderr)
        uploaded = upload_blob(Path(file), show_progress=True)
        if uploaded != digest:
            raise ClientError(f"{file} changed while uploading")
    body.update(model=args.model, stream=True)
    for status in stream("/api/create", body):
        print(status["status"], file=sys.stderr)
    return 0


def run_cp(args: argparse.Namespace) -> int:
    call("POST", "/api/copy", {"source": args.source, "destination": args.destination})
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    for model in args.models:
        call("DELETE", "/api/delete", {"model": model})
        print(f"deleted '{model}'")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    last = ""
    for status in stream("/api/pull", {"model": args.model, "insecure": args.insecure, "stream": True}):
        text = status["status"]
        if status.get("total"):
            text += f" {100 * status.get('completed', 0) // max(status['total'], 1)}%"
        if text != last:
            print(text, file=sys.stderr)
            last = text
    return 0


def chat_once(model: str, messages: list[dict[str, Any]], out: Any = sys.stdout) -> str:
    """Stream one assistant answer to `out`; the whole answer."""
    pieces = []
    for chunk in stream("/api/chat", {"model": model, "messages": messages, "stream": True}):
        piece = (chunk.get("message") or {}).get("content", "")
        pieces.append(piece)
        print(piece, end="", file=out, flush=True)
    print(file=out)
    return "".join(pieces)


def user_message(text: str) -> dict[str, Any]:
    """A user message, with the image files its text names attached (see attach.py)."""
    content, images = attach_images(text)
    for _ in images:
        print("Added image", file=sys.stderr)
    return {"role": "user", "content": content, "images": images} if images else {"role": "user", "content": text}


def run_run(args: argparse.Namespace) -> int:
    if args.prompt:
        try:
            message = user_message(" ".join(args.prompt))
        except AttachmentError as err:
            print(f"Error: {err}", file=sys.stderr)
            return 1
        chat_once(args.model, [message])
        return 0
    call("POST", "/api/generate", {"model": args.model})  # load first, as `ollama run` does
    messages: list[dict[str, Any]] = []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            return 0
        if line.strip() in ("/bye", "/exit"):
            return 0
        if not line.strip():
            continue
        try:
            messages.append(user_message(line))
        except AttachmentError as err:
            print(f"Error: {err}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": chat_once(args.model, messages)})


def add_client_commands(subparsers: argparse._SubParsersAction) -> None:
    """run, list, show, create, cp, rm, pull (ps and stop are in cli.py)."""
    run = subparsers.add_parser("run", help="chat with a model (interactive without a prompt)")
    run.add_argument("model")
    run.add_argument("prompt", nargs="*")
    run.set_defaults(run=run_run)
    subparsers.add_parser("list", help="list the models in the store").set_defaults(run=run_list)
    show = subparsers.add_parser("show", help="show a model's details")
    show.add_argument("model")
    show.add_argument("--modelfile", action="store_true", help="print its Modelfile")
    show.add_argument("--template", action="store_true", help="print its template")
    show.set_defaults(run=run_show)
    create = subparsers.add_parser("create", help="create a model from a Modelfile")
    create.add_argument("model")
    create.add_argument("-f", "--file", default="Modelfile", help="the Modelfile (default ./Modelfile)")
    create.set_defaults(run=run_create)
    cp = subparsers.add_parser("cp", help="copy a model")
    cp.add_argument("source")
    cp.add_argument("destination")
    cp.set_defaults(run=run_cp)
    rm = subparsers.add_parser("rm", help="remove models (unloading them)")
    rm.add_argument("models", nargs="+")
    rm.set_defaults(run=run_rm)
    pull = subparsers.add_parser("pull", help="pull a model from a registry")
    pull.add_argument("model")
    pull.add_argument("--insecure", action="store_true", help="plain http (a local registry)")
    pull.set_defaults(run=run_pull)
