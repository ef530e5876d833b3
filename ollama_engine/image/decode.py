"""Bytes to RGB pixels, refusing what is not a sane image before any large buffer is made.

llama.cpp decodes with stb_image asking for 3 channels: alpha is dropped (not composited), grey is
repeated, a GIF gives its first frame and EXIF orientation is ignored. Pillow's convert("RGB") does the
same for those cases, so we decode with Pillow and do not rotate by EXIF either. Lossless formats give
the same pixels as stb_image; JPEG decoders may differ by a level here and there (stb_image has its own
IDCT and chroma upsampling; see the README's Vision section for the measured difference).
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

import numpy as np

MAX_PIXELS = 50_000_000  # a 30 000 x 30 000 image (2.7 GB as RGB) is refused from its header
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(ValueError):
    """Data that is not an image this engine accepts: the API answers it with a 400."""


@dataclass(frozen=True)
class DecodedImage:
    pixels: np.ndarray  # (height, width, 3) uint8, rows top to bottom
    digest: str  # sha256 of the encoded bytes, as llama.cpp's mtmd helper ids an image

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])


def image_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_image(data: bytes, max_pixels: int = MAX_PIXELS) -> DecodedImage:
    """The image in `data` as RGB; ImageError for anything else, checked from the header before decoding."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("image data is empty")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        except UnidentifiedImageError as err:
            raise ImageError(f"image data is not a {', '.join(FORMATS)} image") from err
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise ImageError(f"image is too large: {err}") from err
        except (OSError, ValueError, SyntaxError) as err:
            raise ImageError(f"invalid image: {err}") from err
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageError(f"image has no pixels ({width}x{height})")
        if width * height > max_pixels:
            raise ImageError(f"image is too large: {width}x{height} is more than {max_pixels} pixels")
        try:
            image.load()  # a truncated file fails here
            rgb = image.convert("RGB")
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise ImageError(f"invalid {image.format} image: {err}") from err
    return DecodedImage(np.asarray(rgb, dtype=np.uint8).copy(), image_hash(data))
