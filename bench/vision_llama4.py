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

import argparse
import statistics
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
    from test_vision import MTMD_JPEG

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash", default="off,on")
    args = parser.parse_args()
    if MTMD_JPEG is None:
        sys.exit("mtmd's test-1.jpeg is not under build/src (run dev.py to unpack llama.cpp's source)")
    vision.files = files
    vision.Theirs.encode = encode_all_chunks  # type: ignore[method-assign]
    jpeg = MTMD_JPEG.read_bytes()
    print("| tower | flash | encode ours ms | encode llama.cpp ms | ratio (quartiles) | ttft ours ms | "
          "ttft llama.cpp ms | ratio (quartiles) |\n|---|---|---|---|---|---|---|---|")
    for flash in (f == "on" for f in args.flash.split(",")):
        times = vision.measure("llama4", flash, args.threads, args.rounds, jpeg)
        cells = []
        for what in ("encode", "ttft"):
            ours, theirs = times[f"{what} ours"], times[f"{what} llama.cpp"]
            ratios = sorted(t / o for o, t in zip(ours, theirs, strict=True))
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            cells += [f"{1000 * statistics.median(ours):.1f}", f"{1000 * statistics.median(theirs):.1f}",
                      f"{statistics.median(ratios):.2f} ({quartiles[0]:.2f}-{quartiles[2]:.2f})"]
        print(f"| Llama 4 {LAYERS}×{WIDTH}, tiles {TILE}/{PATCH}, 640×488 (2×2 tiles + thumbnail, 720 tokens) | "
              f"{'on' if flash else 'off'} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
