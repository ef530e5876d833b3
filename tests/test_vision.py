"""Images in: llama.cpp's preprocessing arithmetic, bad images refused, and the Gemma 3 (SigLIP) tower
against llama.cpp's mtmd on synthetic weights in both file layouts (mmproj and Ollama's single file).

Tolerance: the tower runs the same ggml operations as clip.cpp on the same pixels and threads, so its
embeddings are compared bitwise (F32 and F16 weights, flash attention on and off).
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from synthetic.models import write_synthetic
from synthetic.vision import VisionSpec, add_vision, write_mmproj

from ollama_engine.image import Filter, ImageError, decode_image, fit_square, resize
from ollama_engine.paths import REPO_ROOT

THREADS = 2
MTMD_JPEG = next(REPO_ROOT.glob("build/src/llama_cpp_python-*/vendor/llama.cpp/tools/mtmd/test-1.jpeg"), None)


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def smooth_image(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A photo-like (smooth, with some noise) RGB image."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / 7 + c) * np.cos(y / 5 - c) for c in range(3)], axis=-1)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


# ------------------------------------------------------------ preprocessing


@pytest.mark.parametrize(("source", "target"), [((50, 37), (64, 47)), ((640, 488), (896, 683)), ((300, 40), (71, 9)),
                                                ((33, 90), (33, 20)), ((90, 33), (20, 33)), ((5, 5), (64, 64))])
@pytest.mark.parametrize("kind", list(Filter))
def test_resize_is_pillows_arithmetic(source, target, kind):
    """llama.cpp's resize_pillow is Pillow's resampling (fixed point, 22 bits); ours is written from
    llama.cpp's source and must give Pillow's bytes, down and up, in one dimension or both."""
    from PIL import Image

    pixels = smooth_image(*source, seed=sum(source))
    ours = resize(pixels, *target, kind)
    pil_filter = {Filter.BILINEAR: Image.BILINEAR, Filter.BICUBIC: Image.BICUBIC, Filter.LANCZOS: Image.LANCZOS}[kind]
    theirs = np.asarray(Image.fromarray(pixels).resize(target, pil_filter))
    assert ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


def test_fit_square_keeps_the_aspect_ratio_and_pads_black():
    pixels = np.full((30, 90, 3), 200, dtype=np.uint8)  # 3:1
    out = fit_square(pixels, 64)
    assert out.shape == (64, 64, 3)
    # 90 -> 64, 30 -> ceil(30 * 64/90) = 22 rows, centred: rows 21..42
    filled = np.flatnonzero(out[:, 32, 0])
    assert (filled[0], filled[-1]) == (21, 42)
    assert not out[:21].any() and not out[43:].any()
    assert np.array_equal(fit_square(smooth_image(64, 64), 64), smooth_image(64, 64))


def test_decode_refuses_bad_images():
    good = png_bytes(smooth_image(20, 10))
    assert decode_image(good).pixels.shape == (10, 20, 3)
    for data, message in [(b"", "empty"), (b"not an image at all", "not a"), (good[: len(good) // 2], "invalid"),
                          (png_header(30000, 30000), "too large"), (png_header(8000, 7000), "too large"),
                          (png_header(0, 10), ".+")]:
        with pytest.raises(ImageError, match=message):
            decode_image(data)


def png_header(width: int, height: int) -> bytes:
    """The start of a PNG that claims width x height: its header and a first (tiny) data chunk."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16))


def test_decode_drops_alpha_and_keeps_the_first_gif_frame():
    """As stb_image asked for 3 channels: alpha dropped (not composited), a GIF's first frame."""
    from PIL import Image

    rgba = np.dstack([smooth_image(8, 8), np.full((8, 8), 7, dtype=np.uint8)])
    out = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(out, format="PNG")
    assert np.array_equal(decode_image(out.getvalue()).pixels, rgba[..., :3])
    frames = [Image.new("RGB", (4, 4), color) for color in ((255, 0, 0), (0, 0, 255))]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    assert tuple(decode_image(gif.getvalue()).pixels[0, 0]) == (255, 0, 0)


# ------------------------------------------------------------ the tower against llama.cpp's mtmd

SPEC = VisionSpec()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vision")
    text = write_synthetic(folder / "text.gguf", "gemma3", weight_type="F32")
    out = {"text": text}
    for weight_type in ("F32", "F16"):
        out[f"mmproj-{weight_type}"] = write_mmproj(folder / f"mmproj-{weight_type}.gguf", SPEC,
                                                    weight_type=weight_type)
        out[f"single-{weight_type}"] = add_vision(text, folder / f"single-{weight_type}.gguf", SPEC,
                                                  weight_type=weight_type)
    return out


def our_tower(path: Path, flash: bool):
    from ollama_engine.models.vision import load_vision

    tower = load_vision(path, num_threads=THREADS, flash_attention=flash)
    assert tower is not None
    tower.backend.load()
    return tower



IMAGES = {
    "png-wide": lambda: decode_image(png_bytes(smooth_image(50, 37, seed=1))),
    "png-tall": lambda: decode_image(png_bytes(smooth_image(23, 71, seed=2))),
    "png-large": lambda: decode_image(png_bytes(smooth_image(300, 200, seed=3))),
    "mtmd-jpeg": lambda: decode_image(MTMD_JPEG.read_bytes()),
}


@pytest.mark.reference
@pytest.mark.parametrize("flash", [False, True], ids=["plain", "flash"])
@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_gemma3_tower_matches_mtmd(files, weight_type, flash):
    """Embeddings of PNGs and of mtmd's own JPEG equal mtmd_encode_chunk's bitwise, from the mmproj file
    and from Ollama's single file (both given the same pixels: decoding is compared on its own below)."""
    from vision_reference import MtmdReference

    if MTMD_JPEG is None:
        pytest.skip("llama.cpp's source (tools/mtmd/test-1.jpeg) is not under build/src")
    reference = MtmdReference(files["text"], files[f"mmproj-{weight_type}"], flash_attention=flash, threads=THREADS)
    towers = [our_tower(files[f"{layout}-{weight_type}"], flash) for layout in ("mmproj", "single")]
    try:
        assert [t.layout for t in towers] == ["mmproj", "ollama"]
        for name, make in IMAGES.items():
            image = make()
            expected = reference.encode(image.pixels)
            assert expected.shape == (towers[0].tokens(image), 64), name
            for tower in towers:
                got = tower.encode(image)
                assert got.shape == expected.shape, name
                assert np.array_equal(got, expected), (name, tower.layout, float(np.abs(got - expected).max()))
    finally:
        reference.close()
        for tower in towers:
            tower.close()


@pytest.mark.reference
def test_pillow_decodes_as_stb_image(files):
    """Lossless files decode to stb_image's pixels exactly; for mtmd's JPEG the decoders' difference is
    measured (stb_image's IDCT and chroma upsampling are its own) and bounded."""
    from vision_reference import MtmdReference

    reference = MtmdReference(files["text"], files["mmproj-F32"], threads=THREADS)
    try:
        png = png_bytes(smooth_image(37, 29, seed=4))
        assert np.array_equal(reference.stb_decode(png), decode_image(png).pixels)
        if MTMD_JPEG is not None:
            data = MTMD_JPEG.read_bytes()
            stb, ours = reference.stb_decode(data).astype(int), decode_image(data).pixels.astype(int)
            assert stb.shape == ours.shape
            difference = np.abs(stb - ours)
            print(f"JPEG: max |stb - Pillow| = {difference.max()}, mean {difference.mean():.4f}, "
                  f"{(difference > 0).mean():.2%} of values differ")
            assert difference.mean() < 1.0
    finally:
        reference.close()
