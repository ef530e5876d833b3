"""The CLI's image attachments, as Ollama's `ollama run` finds them: paths of image files written in the prompt
(`./cat.png`, `/tmp/a b.jpg` with an escaped space) are read, sent base64 as the message's images, and taken
out of the text; a path that names no file stays in the text."""

from __future__ import annotations

import base64
import re
from pathlib import Path

IMAGE_PATH = re.compile(r"(?:[a-zA-Z]:)?(?:\./|/|\\)[\S\\ ]+?\.(?i:jpg|jpeg|png|webp)\b")
MAX_BYTES = 100 << 20  # Ollama's CLI limit
SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")  # JPEG, PNG; WebP: RIFF....WEBPVP


class AttachmentError(ValueError):
    """A named file that is not an image the CLI sends."""


def _unescape(path: str) -> str:
    for escaped, plain in (("\\ ", " "), ("\\(", "("), ("\\)", ")"), ("\\[", "["), ("\\]", "]"), ("\\'", "'"),
                           ('\\"', '"'), ("\\&", "&"), ("%20", " ")):
        path = path.replace(escaped, plain)
    return path


def _is_image(head: bytes) -> bool:
    return head.startswith(SIGNATURES) or (head[:4] == b"RIFF" and head[8:14] == b"WEBPVP")


def attach_images(text: str) -> tuple[str, list[str]]:
    """The text without the image paths it names, and those images base64-encoded, in order."""
    images: list[str] = []
    for written in IMAGE_PATH.findall(text):
        path = Path(_unescape(written))
        if not path.is_file():
            continue
        if path.stat().st_size > MAX_BYTES:
            raise AttachmentError(f"{path}: file size exceeds maximum limit (100MB)")
        data = path.read_bytes()
        if not _is_image(data[:16]):
            raise AttachmentError(f"{path}: invalid file type: not a JPEG, PNG or WebP image")
        images.append(base64.b64encode(data).decode())
        text = text.replace(f"'{path}'", "").replace(f"'{written}'", "").replace(written, "")
    return text.strip(), images
