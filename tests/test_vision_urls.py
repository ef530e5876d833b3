"""http(s) image URLs in OpenAI `image_url` parts (api/image_urls.py): a 400 by default, as Ollama answers;
fetched by serve only with OLLAMA_ENGINE_IMAGE_URLS set, within a size limit and a timeout, following http(s)
redirects only. A local HTTP server plays the web; the end-to-end tests use a real serve and the openai client.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from serve_process import serve_process
from synthetic.models import write_synthetic
from synthetic.vision import add_vision
from test_vision import SPEC, png_bytes, smooth_image

from ollama_engine.api.image_urls import MAX_REDIRECTS, ImageFetch, fetch_image, inline_image_urls
from ollama_engine.api.native import ApiError
from ollama_engine.envconfig import EnvConfig

IMAGE = png_bytes(smooth_image(50, 37, seed=1))
LIMITS = ImageFetch(max_bytes=len(IMAGE) + 10, timeout=1.0)


class Web(BaseHTTPRequestHandler):
    """The paths the tests fetch."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path
        if path == "/cat.png":
            self._send(200, IMAGE)
        elif path.startswith("/hop/"):  # /hop/N: N redirects before the image
            left = int(path.rsplit("/", 1)[1])
            self._redirect(f"/hop/{left - 1}" if left > 1 else "/cat.png")
        elif path == "/to-file":
            self._redirect("file:///etc/passwd")
        elif path == "/to-ftp":
            self._redirect("ftp://127.0.0.1/cat.png")
        elif path == "/big":
            self._send(200, b"x" * (LIMITS.max_bytes + 1))
        elif path == "/big-unannounced":  # no Content-Length: the limit holds while reading
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"x" * 4096)
        elif path == "/slow":
            time.sleep(3)
            self._send(200, IMAGE)
        else:
            self._send(404, b"not found")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def web() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Web)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def fetch(url: str) -> bytes:
    return asyncio.run(fetch_image(url, LIMITS))


def refusal(url: str) -> str:
    with pytest.raises(ApiError) as error:
        fetch(url)
    assert error.value.status == 400
    return str(error.value)


# ------------------------------------------------------------ fetching


def test_fetch_follows_http_redirects(web: str):
    assert fetch(f"{web}/cat.png") == IMAGE
    assert fetch(f"{web}/hop/{MAX_REDIRECTS}") == IMAGE


def test_fetch_refuses_what_it_must(web: str):
    assert "more than 5 redirects" in refusal(f"{web}/hop/{MAX_REDIRECTS + 1}")
    assert "only http and https" in refusal(f"{web}/to-file")
    assert "only http and https" in refusal(f"{web}/to-ftp")
    assert "larger than" in refusal(f"{web}/big")
    assert "larger than" in refusal(f"{web}/big-unannounced")
    assert "HTTP 404" in refusal(f"{web}/missing")
    started = time.monotonic()
    assert "no answer within 1 s" in refusal(f"{web}/slow")
    assert time.monotonic() - started < 2.5
    closed = web.rsplit(":", 1)[0] + ":1"  # nothing listens on port 1
    assert "image URL" in refusal(f"{closed}/cat.png")


def part(url: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def test_inline_image_urls(web: str):
    data_url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    plain = [part(data_url), {"role": "user", "content": "hi"}]
    assert asyncio.run(inline_image_urls(plain, None)) is plain  # nothing to fetch: untouched, allowed or not
    with pytest.raises(ApiError) as error:
        asyncio.run(inline_image_urls([part(f"{web}/cat.png")], None))
    assert error.value.status == 400 and "OLLAMA_ENGINE_IMAGE_URLS" in str(error.value)
    messages = [part(f"{web}/cat.png"), part(data_url)]
    inlined = asyncio.run(inline_image_urls(messages, LIMITS))
    url = inlined[0]["content"][1]["image_url"]["url"]
    assert url.startswith("data:;base64,") and base64.b64decode(url.split(",", 1)[1]) == IMAGE
    assert inlined[0]["content"][0] == messages[0]["content"][0] and inlined[1] is messages[1]
    assert messages[0]["content"][1]["image_url"]["url"] == f"{web}/cat.png"  # the request itself not changed


def test_the_environment_variable():
    assert EnvConfig.from_env({}).image_urls is False
    assert EnvConfig.from_env({"OLLAMA_ENGINE_IMAGE_URLS": "1"}).image_urls is True
    assert EnvConfig.from_env({"OLLAMA_ENGINE_IMAGE_URLS": "false"}).image_urls is False


# ------------------------------------------------------------ through serve with the openai client


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-urls")
    text = write_synthetic(folder / "text.gguf", "gemma3", weight_type="F32")
    return folder, add_vision(text, folder / "vision.gguf", SPEC)


def ask(url: str, model: str, image_url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[part(image_url)])
    return answer.choices[0].message.content


def test_serve_refuses_image_urls_by_default(vision_model, web: str):
    folder, model = vision_model
    (folder / "default").mkdir()
    with serve_process(folder / "default") as url:
        with pytest.raises(openai.BadRequestError) as error:
            ask(url, str(model), f"{web}/cat.png")
        assert "OLLAMA_ENGINE_IMAGE_URLS" in str(error.value)


def test_serve_fetches_image_urls_when_allowed(vision_model, web: str):
    """The fetched image answers as the same image sent as a data: URL; a bad URL is a 400 and serving goes on."""
    folder, model = vision_model
    (folder / "allowed").mkdir()
    with serve_process(folder / "allowed", OLLAMA_ENGINE_IMAGE_URLS="1") as url:
        fetched = ask(url, str(model), f"{web}/cat.png")
        assert fetched and fetched == ask(url, str(model), "data:image/png;base64," + base64.b64encode(IMAGE).decode())
        with pytest.raises(openai.BadRequestError) as error:
            ask(url, str(model), f"{web}/to-file")
        assert "only http and https" in str(error.value)
        assert ask(url, str(model), f"{web}/hop/2") == fetched
