"""Image encode time and time to first token with an image for the Llama 4 tower against llama.cpp's mtmd:
bench/vision.py's interleaved rounds (its Ours and Theirs, its ratio: llama.cpp's time / ours, above 1.00 we are
faster) on a synthetic llama4 text GGUF and a Llama 4 mmproj (F16; Llama 4's 336-pixel tiles of 14-pixel patches,
pixel shuffle by 2: 144 tokens a tile). The image is mtmd's test-1.jpeg: 640 x 488, a 2 x 2 grid of tiles and the
thumbnail, so 5 chunks of 577 positions each encoded, 720 tokens. Encoding is all of an image's chunks on both
sides (mtmd_encode_chunk on each of mtmd's image chunks, preprocessing included).

Usage (on a quiet machine: /tmp/mine/quiet.sh for RESULTS.md):
    .venv/bin/python bench/vision_llama4.py [--rounds 5] [--threads 2] [--flash off,on]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import vision  # noqa: E402 - bench/vision.py: the engines and the interleaved rounds

# (layers, width, heads, ffn, tile, patch) of the tower; the text model is as wide
LAYERS, WIDTH, HEADS, FFN, TILE, PATCH = 6, 384, 6, 1536, 336, 14
vision.PROMPT = "Describe this image in detail: <__media__>"

LABEL = f"Llama 4 {LAYERS}×{WIDTH}, tiles {TILE}/{PATCH}, 640×488 (2×2 tiles + thumbnail, 720 tokens)"


def files(size: str) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) in bench/out/, written on first use (size: bench/vision.py's argument, unused)."""
    from synthetic.models import write_synthetic
    from synthetic.vision_llama4 import Llama4VisionSpec, write_llama4_mmproj

    out = HERE / "out"
    out.mkdir(exist_ok=True)
    text, mmproj = out / "vision-llama4-text.gguf", out / "vision-llama4-mmproj.gguf"
    if not text.exists():
        write_synthetic(text, "tiny-llama4", weight_type="F16", n_embd=WIDTH, n_head=WIDTH // 64, n_head_kv=2,
                        head_dim=64, n_ff=2 * WIDTH, n_ff_exp=WIDTH, context_length=4096)
    if not mmproj.exists():
        spec = Llama4VisionSpec(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_ff=FFN, image_size=TILE,
                                patch_size=PATCH, merge=2, adapter=WIDTH, text_embd=WIDTH)
        write_llama4_mmproj(mmproj, spec, weight_type="F16")
    return text, mmproj


def encode_all_chunks(self: vision.Theirs, rgb: np.ndarray) -> float:
    """mtmd's encode of every image chunk of the image (the tiles and the thumbnail), as ours encodes them."""
    from test_vision_llama4 import mtmd_chunks

    started = time.perf_counter()
    mtmd_chunks(self.ref, rgb)
    return time.perf_counter() - started


def main() -> None:
    args = vision.arguments(__doc__, rounds=5)
    jpeg = vision.mtmd_jpeg()
    vision.files = files
    vision.Theirs.encode = encode_all_chunks  # type: ignore[method-assign]
    print(vision.HEADER)
    for flash in (f == "on" for f in args.flash.split(",")):
        print(vision.row(LABEL, "llama4", flash, args, jpeg), flush=True)


if __name__ == "__main__":
    main()
