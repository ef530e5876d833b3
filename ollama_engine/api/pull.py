"""POST /api/pull: Ollama's registry protocol (the OCI distribution API) into the store.

GET /v2/<namespace>/<model>/manifests/<tag>, then every blob the manifest lists (config included) from
/v2/<namespace>/<model>/blobs/<digest>, each hashed as it streams and kept only when its sha256 matches;
the manifest is written last, byte for byte as served, so its digest is the registry's. https unless the
request says `insecure`. An unreachable registry ends the stream with a clear error line. Concurrent pulls of one
blob share one download (as Ollama's do), each showing its progress.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from ollama_engine.store import Layer, Manifest, Store, StoreError, check_digest, disk, parse_name

from .native import ApiError

MANIFEST_ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
CHUNK = 1 << 20
PROGRESS_INTERVAL = 0.1  # seconds between a pull's progress lines while a blob downloads
TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=15, sock_read=60)


async def pull_model(store: Store, model: str, insecure: bool = False) -> AsyncIterator[dict[str, Any]]:
    """The pull's progress lines; ApiError on failure (after the first line: an error line)."""
    name = parse_name(model)
    if not name.is_valid():
        raise ApiError(400, "invalid model name")
    try:
        manifest_path = store.manifest_path(name)
    except StoreError as err:  # a part too long to be a file name
        raise ApiError(err.status, str(err)) from err
    base = f"{'http' if insecure else 'https'}://{name.host}/v2/{name.namespace}/{name.model}"
    yield {"status": "pulling manifest"}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        try:
            async with session.get(f"{base}/manifests/{name.tag}", headers={"Accept": MANIFEST_ACCEPT}) as response:
                if response.status == 404:
                    raise ApiError(404, "pull model manifest: file does not exist")
                if response.status != 200:
                    raise ApiError(500, f"pull model manifest: {response.status} {await response.text()}")
                raw = await response.read()
        except aiohttp.ClientError as err:
            raise ApiError(500, f"pull model manifest: cannot reach the registry {name.host}: {err}") from err
        try:
            manifest = Manifest.from_bytes(raw)
            layers: list[Layer] = [*manifest.layers, *([manifest.config] if manifest.config.digest else [])]
            for layer in layers:
                check_digest(layer.digest)  # a digest is a file name below blobs/: never `sha256:../..`
        except (ValueError, TypeError, KeyError, StoreError) as err:
            raise ApiError(500, f"pull model manifest: bad manifest: {err}") from err
        for layer in layers:
            async for status in _pull_blob(store, base, layer):
                yield status
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    disk.write_atomically(manifest_path, [raw])
    yield {"status": "success"}


@dataclass
class Download:
    """One blob's download, shared by every pull that needs it while it runs (Ollama's download manager keeps one
    per digest): a task of its own, so a pull whose client goes away does not stop it for the others."""

    task: asyncio.Task[None] | None = None
    completed: int = 0


DOWNLOADS: dict[Path, Download] = {}  # the blob's path -> its download in progress (this event loop's)


async def _pull_blob(store: Store, base: str, layer: Layer) -> AsyncIterator[dict[str, Any]]:
    """Progress lines of one blob: joins the download of the same blob in progress, or starts one."""
    digest = check_digest(layer.digest)
    status = {"status": f"pulling {digest[7:19]}", "digest": digest, "total": layer.size}
    if store.has_blob(digest):
        yield {**status, "completed": layer.size}
        return
    download = _join_download(store, base, digest)
    assert download.task is not None
    shown = -1
    while True:
        done, _ = await asyncio.wait([download.task], timeout=PROGRESS_INTERVAL)  # never cancels the download
        if download.completed != shown:
            shown = download.completed
            yield {**status, "completed": shown}
        if done:
            download.task.result()  # the download's error, for every pull that shared it
            return


def _join_download(store: Store, base: str, digest: str) -> Download:
    target = store.blob_path(digest)
    download = DOWNLOADS.get(target)
    if download is None or download.task is None or download.task.done() \
            or download.task.get_loop() is not asyncio.get_running_loop():  # (a test's earlier event loop)
        download = DOWNLOADS[target] = Download()
        download.task = asyncio.create_task(_download(store, base, digest, download))
        download.task.add_done_callback(lambda task: _forget(target, download, task))
    return download


def _forget(target: Path, download: Download, task: asyncio.Task[None]) -> None:
    if DOWNLOADS.get(target) is download:
        del DOWNLOADS[target]
    if not task.cancelled():
        task.exception()  # read, so that a download nobody waits for any more logs no "never retrieved"


async def _download(store: Store, base: str, digest: str, download: Download) -> None:
    """Fetch one blob into a temp file of its own, hashing as it streams; renamed into place when it matches."""
    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    temp = disk.temp_path(store.blobs_dir, f"pull-{digest[7:19]}")
    sha = hashlib.sha256()
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session, \
                session.get(f"{base}/blobs/{digest}") as response:
            if response.status != 200:
                raise ApiError(500, f"pull blob {digest}: {response.status} {await response.text()}")
            with open(temp, "wb") as f:
                async for chunk in response.content.iter_chunked(CHUNK):
                    f.write(chunk)
                    sha.update(chunk)
                    download.completed += len(chunk)
        if "sha256:" + sha.hexdigest() != digest:
            raise ApiError(500, f"digest mismatch, file must be downloaded again: want {digest}, got "
                                f"sha256:{sha.hexdigest()}")
        os.replace(temp, store.blob_path(digest))
    except aiohttp.ClientError as err:
        raise ApiError(500, f"pull blob {digest}: {err}") from err
    except OSError as err:  # a full disk
        raise ApiError(500, f"pull blob {digest}: {err.strerror or err}") from err
    finally:
        temp.unlink(missing_ok=True)
