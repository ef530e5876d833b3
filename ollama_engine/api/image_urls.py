"""http(s) image URLs in OpenAI `image_url` parts: fetched by serve only where OLLAMA_ENGINE_IMAGE_URLS allows it.

Ollama refuses them ("image URLs are not currently supported"). Fetching on a client's behalf lets any client
make serve request any address serve can reach (services behind the firewall included), so it stays off unless
the operator turns it on. When on, a fetch follows http and https only (a redirect to another scheme is refused,
and so is a chain of more than MAX_REDIRECTS), reads at most `max_bytes` and gives up after `timeout` seconds;
the bytes then go the way of a `data:` URL's (decoded and checked before any model is loaded).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp

from .native import ApiError

MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})
REFUSED = ("image URLs are not currently supported, please use base64 encoded data instead "
           "(this server fetches http(s) image URLs only when OLLAMA_ENGINE_IMAGE_URLS is set)")


@dataclass(frozen=True)
class ImageFetch:
    """How serve fetches an image URL: at most max_bytes, within timeout seconds in all."""

    max_bytes: int = 20 << 20  # OpenAI's own limit per image
    timeout: float = 30.0


def is_web_url(url: str) -> bool:
    return urlsplit(url).scheme.lower() in ("http", "https")


async def fetch_image(url: str, limits: ImageFetch) -> bytes:
    """The body of an http(s) URL; ApiError 400 saying why when it cannot be had within the limits."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limits.timeout)) as session:
            for _ in range(MAX_REDIRECTS + 1):
                if not is_web_url(url):
                    raise ApiError(400, f"image URL: only http and https can be fetched, not {url[:100]!r}")
                async with session.get(url, allow_redirects=False) as response:
                    if response.status in REDIRECTS and "Location" in response.headers:
                        url = urljoin(url, response.headers["Location"])
                        continue
                    if response.status != 200:
                        raise ApiError(400, f"image URL {url[:200]}: HTTP {response.status}")
                    return await _read_limited(response, limits.max_bytes)
            raise ApiError(400, f"image URL: more than {MAX_REDIRECTS} redirects")
    except TimeoutError as err:
        raise ApiError(400, f"image URL {url[:200]}: no answer within {limits.timeout:g} s") from err
    except (aiohttp.ClientError, ValueError) as err:
        raise ApiError(400, f"image URL {url[:200]}: {err}") from err


async def _read_limited(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    too_large = ApiError(400, f"image URL: the image is larger than {max_bytes} bytes")
    if (response.content_length or 0) > max_bytes:
        raise too_large
    data = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > max_bytes:
            raise too_large
    return bytes(data)


async def inline_image_urls(messages: Any, fetch: ImageFetch | None) -> Any:
    """OpenAI messages with every http(s) `image_url` part fetched into a `data:` URL (fetch None: a 400, as
    Ollama answers); anything else is left for the request's own validation."""
    if not isinstance(messages, list):
        return messages
    urls = [(m, i, url) for m in messages if isinstance(m, Mapping) and isinstance(m.get("content"), list)
            for i, part in enumerate(m["content"]) if (url := _web_url(part)) is not None]
    if not urls:
        return messages
    if fetch is None:
        raise ApiError(400, REFUSED)
    bodies = await asyncio.gather(*(fetch_image(url, fetch) for _, _, url in urls))
    changed = {id(m): list(m["content"]) for m, _, _ in urls}
    for (m, i, _), body in zip(urls, bodies, strict=True):
        url = "data:;base64," + base64.b64encode(body).decode()
        changed[id(m)][i] = {"type": "image_url", "image_url": {"url": url}}
    return [{**m, "content": changed[id(m)]} if id(m) in changed else m for m in messages]


def _web_url(part: Any) -> str | None:
    if not isinstance(part, Mapping) or part.get("type") != "image_url":
        return None
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, Mapping) else url
    return url if isinstance(url, str) and is_web_url(url) else None
