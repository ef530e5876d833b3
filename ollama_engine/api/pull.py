"""POST /api/pull: Ollama's registry protocol (the OCI distribution API) into the store.

GET /v2/<namespace>/<model>/manifests/<tag>, then every blob the manifest lists (config included) from
/v2/<namespace>/<model>/blobs/<digest>, each hashed as it streams and kept only when its sha256 matches;
the manifest is written last, byte for byte as served, so its digest is the registry's. https unless the
request says `insecure`. An unreachable registry ends the stream with a clear error line.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from ollama_engine.store import Layer, Manifest, Store, StoreError, check_digest, layout, parse_name

from .native import ApiError

MANIFEST_ACCEPT = "application/vnd.docker.distribution.manifest.v2+json"
CHUNK = 1 << 20


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
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=15, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
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
            async for status in _pull_blob(session, store, base, layer):
                yield status
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    layout.write_atomically(manifest_path, [raw])
    yield {"status": "success"}


async def _pull_blob(session: aiohttp.ClientSession, store: Store, base: str,
                     layer: Layer) -> AsyncIterator[dict[str, Any]]:
    digest = check_digest(layer.digest)
    status = {"status": f"pulling {digest[7:19]}", "digest": digest, "total": layer.size}
    if store.has_blob(digest):
        yield {**status, "completed": layer.size}
        return
    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    temp = layout.temp_path(store.blobs_dir, f"pull-{digest[7:19]}")  # this pull's own: two pulls of one blob
    sha, done = hashlib.sha256(), 0
    try:
        async with session.get(f"{base}/blobs/{digest}") as response:
            if response.status != 200:
                raise ApiError(500, f"pull blob {digest}: {response.status} {await response.text()}")
            with open(temp, "wb") as f:
                async for chunk in response.content.iter_chunked(CHUNK):
                    f.write(chunk)
                    sha.update(chunk)
                    done += len(chunk)
                    yield {**status, "completed": done}
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
    if done == 0:
        yield {**status, "completed": 0}

