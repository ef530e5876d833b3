"""Security properties of serve: loopback by default, nothing outside OLLAMA_MODELS, sandboxed templates, CORS
and the host check as Ollama's, bounded bodies."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from ollama_engine.api import serve as serve_module
from ollama_engine.api.catalog import Catalog, ModelNotFoundError
from ollama_engine.api.middleware import allowed_host, allowed_origins
from ollama_engine.api.serve import create_app
from ollama_engine.envconfig import EnvConfig
from ollama_engine.sched import Scheduler
from ollama_engine.store import Store, StoreError, parse_name
from ollama_engine.template.goexec import MAX_STEPS
from ollama_engine.template.goparse import TemplateError
from ollama_engine.template.gotemplate import GoTemplate
from ollama_engine.template.jinja import ChatTemplate, ChatTemplateError

# ------------------------------------------------------------------------------------------ loopback


def test_serve_and_the_runner_listen_on_loopback_by_default() -> None:
    config = EnvConfig.from_env({})
    assert (config.host, config.port) == ("127.0.0.1", 11434)
    source = (Path(__file__).parents[1] / "server" / "cli.py").read_text()
    assert 'parser.add_argument("--host", default="127.0.0.1"' in source


# ------------------------------------------------------------------------------------------ the store


TRAVERSALS = ["../../etc/passwd", "..", "a/../../b", "/etc/passwd", "x:../y", "registry.ollama.ai/../x",
              "host/ns/../m", "..%2f..%2fx", "a\\..\\b", "model:tag/../..", "./x", "~/x", "ns/.hidden", "a:..",
              "\x00", "ns/m:t\x00/..", "%00"]


@pytest.mark.parametrize("name", TRAVERSALS)
def test_names_that_would_leave_the_store_are_invalid(tmp_path: Path, name: str) -> None:
    store = Store(tmp_path / "models")
    parsed = parse_name(name)
    if parsed.is_valid():  # then every part is a plain file name
        assert store.manifest_path(parsed).resolve().is_relative_to(store.manifests_dir.resolve())
    else:
        for operation in (lambda: store.resolve(name), lambda: store.delete(name),
                          lambda: store.copy("tiny", name), lambda: store.create(name, from_="tiny")):
            with pytest.raises(StoreError):
                operation()
    assert not (tmp_path / "etc").exists() and sorted(p.name for p in tmp_path.iterdir()) in ([], ["models"])


@given(st.text(max_size=40))
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
def test_every_valid_name_maps_inside_the_manifests_folder(name: str) -> None:
    store = Store("/nonexistent/models")
    parsed = parse_name(name)
    if parsed.is_valid():
        path = Path(os.path.normpath(store.manifest_path(parsed)))
        assert path.is_relative_to(store.manifests_dir) and path.parent.parent.parent.parent == store.manifests_dir


@pytest.mark.parametrize("digest", ["sha256:../../etc/passwd", "sha256-" + "0" * 63 + "/", "sha256:" + "0" * 64 + "/..",
                                    "../sha256-" + "0" * 64, "sha256:" + "g" * 64, "md5:" + "0" * 32, ""])
def test_digests_that_are_not_sha256_are_refused(tmp_path: Path, digest: str) -> None:
    store = Store(tmp_path / "models")
    with pytest.raises(StoreError, match="invalid digest"):
        store.blob_path(digest)
    with pytest.raises(StoreError):
        store.write_blob(b"data", digest)


def test_writes_replace_a_symlink_instead_of_following_it(tmp_path: Path) -> None:
    """A manifest or blob path that is a symlink out of the store is replaced (atomic rename), never written
    through: the file outside keeps its bytes."""
    store = Store(tmp_path / "models")
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    data = b"GGUF not really"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob = store.blob_path(digest)
    blob.parent.mkdir(parents=True)
    blob.symlink_to(tmp_path / "dangling")  # a dangling symlink at the blob's name is not the blob
    assert not store.has_blob(digest)
    store.write_blob(data, digest)
    assert not blob.is_symlink() and blob.read_bytes() == data

    from ollama_engine.store.disk import write_atomically

    manifest = store.manifests_dir / "registry.ollama.ai" / "library" / "m" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.symlink_to(outside)
    write_atomically(manifest, [b"{}"])
    assert not manifest.is_symlink() and outside.read_bytes() == b"precious"


def test_model_names_are_not_paths_unless_allowed(tmp_path: Path) -> None:
    """A client cannot make serve open a GGUF file outside OLLAMA_MODELS; OLLAMA_ENGINE_MODEL_PATHS allows it."""
    model = Path(__file__).parent / "data" / "stories260K.gguf"
    with pytest.raises(ModelNotFoundError):
        Catalog(Store(tmp_path)).resolve(str(model))
    assert Catalog(Store(tmp_path), model_paths=True).resolve(str(model)).model.model_path == str(model.resolve())
    assert not EnvConfig.from_env({}).model_paths
    assert EnvConfig.from_env({"OLLAMA_ENGINE_MODEL_PATHS": "1"}).model_paths


def test_create_refuses_file_names_that_leave_the_folder(tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    for path in ("../x.gguf", "/abs.gguf", "a/../../x.gguf", "a\\b.gguf", "a//b.gguf"):
        with pytest.raises(StoreError, match="file path must be relative"):
            store.create("m", files={path: "sha256:" + "0" * 64})


# ------------------------------------------------------------------------------------------ templates


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__.os }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}", "{{ messages.append(1) }}", "{{ messages.__class__ }}",
    "{% include '/etc/passwd' %}", "{% import 'os' as os %}", "{% extends '/etc/passwd' %}",
    "{% for i in range(10**9) %}{% endfor %}", "{{ 'a' * 10**10 }}", "{{ [0] * 10**9 }}", "{{ 7 ** 10**9 }}",
    "{{ config }}{{ self.__init__.__globals__ }}", "{{ namespace.__init__.__globals__ }}",
])
def test_jinja_chat_templates_render_in_a_sandbox(source: str) -> None:
    """No attribute access to Python internals, no file access, no unbounded loop or allocation: a clear
    ChatTemplateError, or harmless text."""
    try:
        text = ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    except ChatTemplateError:
        return
    assert "<class" not in text and "function" not in text and "root:" not in text and len(text) < 1000


@pytest.mark.parametrize("source", [
    "{{ .Messages.__class__ }}", "{{ .Prompt.__len__ }}", "{{ index . \"__class__\" }}", "{{ template \"x\" }}",
    "{{ range 10000000000 }}x{{ end }}", "{{ range 999999 }}{{ range 999999 }}{{ end }}{{ end }}",
    "{{ call .Prompt }}", "{{ printf \"%999999999s\" .Prompt }}",
])
def test_go_templates_are_sandboxed_and_bounded(source: str) -> None:
    """A client's TEMPLATE (create, or generate's `template`) reaches only the template's data, and runs at most
    MAX_STEPS steps."""
    try:
        template = GoTemplate.parse(source)
        text = template.execute({"Messages": [], "Prompt": "hi"})
    except TemplateError:
        return
    assert "<class" not in text and len(text) < 1000 and MAX_STEPS > 0


# ------------------------------------------------------------------------------------------ CORS and hosts


async def _with_app(config: EnvConfig, requests: list[tuple[str, str, dict[str, str]]]) -> list[tuple[int, dict]]:
    server = TestServer(create_app(config, Scheduler(config)))
    await server.start_server()
    try:
        out = []
        async with aiohttp.ClientSession() as session:
            for method, path, headers in requests:
                async with session.request(method, server.make_url(path), headers=headers) as response:
                    await response.read()
                    out.append((response.status, dict(response.headers)))
        return out
    finally:
        await server.close()


def _answers(config: EnvConfig, *requests: tuple[str, str, dict[str, str]]) -> list[tuple[int, dict]]:
    return asyncio.run(asyncio.wait_for(_with_app(config, list(requests)), 60))


def test_allowed_origins_are_ollamas() -> None:
    assert allowed_origins(["https://a.example"]) == [
        "https://a.example",
        "http://localhost", "https://localhost", "http://localhost:*", "https://localhost:*",
        "http://127.0.0.1", "https://127.0.0.1", "http://127.0.0.1:*", "https://127.0.0.1:*",
        "http://0.0.0.0", "https://0.0.0.0", "http://0.0.0.0:*", "https://0.0.0.0:*",
        "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
    ]


def test_cors_for_browser_clients(tmp_path: Path) -> None:
    config = EnvConfig(models=tmp_path, origins=("https://app.example", "https://*.trusted.example"))
    get = "GET", "/api/version"
    answers = _answers(
        config,
        (*get, {"Origin": "http://localhost:3000"}),
        (*get, {"Origin": "https://evil.example"}),
        (*get, {"Origin": "https://app.example"}),
        (*get, {"Origin": "https://x.trusted.example"}),
        (*get, {"Origin": "vscode-webview://abc"}),
        (*get, {"Origin": "chrome-extension://abc"}),
        ("OPTIONS", "/api/chat", {"Origin": "http://127.0.0.1:8080", "Access-Control-Request-Method": "POST"}),
        ("OPTIONS", "/api/chat", {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}),
        (*get, {}),
    )
    (local, evil, listed, wildcard, vscode, extension, preflight, evil_preflight, plain) = answers
    assert local[0] == 200 and local[1]["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert local[1]["Vary"] == "Origin"
    assert evil[0] == 403 and "Access-Control-Allow-Origin" not in evil[1]
    assert listed[0] == wildcard[0] == vscode[0] == 200
    assert extension[0] == 403  # browser extensions only through OLLAMA_ORIGINS, as in Ollama
    assert preflight[0] == 204
    assert preflight[1]["Access-Control-Allow-Methods"] == "GET,POST,PUT,PATCH,DELETE,HEAD,OPTIONS"
    assert "Content-Type" in preflight[1]["Access-Control-Allow-Headers"].split(",")
    assert preflight[1]["Access-Control-Max-Age"] == "43200"
    assert evil_preflight[0] == 403
    assert plain[0] == 200 and "Access-Control-Allow-Origin" not in plain[1]


def test_origins_star_allows_every_origin(tmp_path: Path) -> None:
    [(status, headers)] = _answers(EnvConfig(models=tmp_path, origins=("*",)),
                                   ("GET", "/api/version", {"Origin": "https://anything.example"}))
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"


def test_host_check_stops_dns_rebinding_on_loopback(tmp_path: Path) -> None:
    config = EnvConfig(models=tmp_path, host="127.0.0.1")
    hosts = ["evil.example", "evil.example:11434", "8.8.8.8", "localhost:11434", "127.0.0.1", "[::1]:11434",
             "10.1.2.3", "192.168.0.7:80", "my-box.local", "api.localhost", "svc.internal", "0.0.0.0"]
    answers = _answers(config, *[("GET", "/api/version", {"Host": host}) for host in hosts])
    statuses = dict(zip(hosts, [status for status, _ in answers], strict=True))
    assert [h for h, s in statuses.items() if s == 403] == ["evil.example", "evil.example:11434", "8.8.8.8"]
    # listening on every interface, Ollama checks no Host
    [(status, _)] = _answers(EnvConfig(models=tmp_path, host="0.0.0.0"),
                             ("GET", "/api/version", {"Host": "evil.example"}))
    assert status == 200
    assert allowed_host("") and not allowed_host("localhost.evil.example")


def test_bodies_over_the_limit_get_a_json_413(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_module, "MAX_BODY", 1024)
    config = EnvConfig(models=tmp_path)

    async def post() -> tuple[int, dict]:
        server = TestServer(create_app(config, Scheduler(config)))
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session, session.post(
                    server.make_url("/api/show"), data=b'{"model": "' + b"x" * 4096 + b'"}') as response:
                return response.status, await response.json()
        finally:
            await server.close()

    status, body = asyncio.run(post())
    assert status == 413 and "too large" in body["error"]
