"""Images in: decoding (Pillow) and the resizing, padding and normalising llama.cpp's mtmd applies, so the
pixels a vision tower sees are llama.cpp's. Below the models: numpy and Pillow only."""

from .decode import MAX_PIXELS, DecodedImage, ImageError, decode_image, image_hash
from .preprocess import PixelSpec, fit_box, fit_square, size_preserved_ratio, to_planar
from .resize import Filter, resize

__all__ = [
    "MAX_PIXELS", "DecodedImage", "Filter", "ImageError", "PixelSpec", "decode_image", "fit_box", "fit_square",
    "image_hash", "resize", "size_preserved_ratio", "to_planar",
]
