"""Image encode time and time to first token with an image for the Mistral 3 (Pixtral) tower against llama.cpp's
mtmd: bench/vision.py's interleaved rounds (its Ours and Theirs, its ratio: llama.cpp's time / ours, above 1.00
we are faster) on a synthetic mistral3 text GGUF and a Pixtral mmproj (F16, with Mistral Small 3.1's 2 x 2 patch
merger). The image is mtmd's test-1.jpeg: 640 x 488, resized by dyn_size to 644 x 476 at patch 14 (1564 patches,
391 merged, 407 tokens with the [IMG_BREAK] rows).

Usage (on a quiet machine: /tmp/mine/quiet.sh for RESULTS.md):
    .venv/bin/python bench/vision_mistral3.py [--rounds 5] [--threads 2] [--flash off,on]
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import vision  # noqa: E402 - bench/vision.py: the engines and the interleaved rounds

# (layers, width, heads, ffn, patch) of the tower; the text model is as wide
LAYERS, WIDTH, HEADS, FFN, PATCH = 6, 384, 6, 1536, 14
vision.PROMPT = "[INST]Describe this image in detail: <__media__>[/INST]"  # Mistral's turn, mtmd's marker

LABEL = f"Pixtral {LAYERS}×{WIDTH}, patch {PATCH}, 644×476 (1564 patches, 407 tokens)"


def files(size: str) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) in bench/out/, written on first use (size: bench/vision.py's argument, unused)."""
    from synthetic.models import write_synthetic
    from synthetic.vision_mistral3 import PixtralSpec, write_mmproj

    out = HERE / "out"
    out.mkdir(exist_ok=True)
    text, mmproj = out / "vision-mistral3-text.gguf", out / "vision-mistral3-mmproj.gguf"
    if not text.exists():  # F32: the mmproj copies [IMG_BREAK] from an F32 token_embd
        write_synthetic(text, "tiny-mistral3", weight_type="F32", n_layer=6, n_embd=WIDTH, n_head=WIDTH // 64,
                        n_head_kv=2, n_ff=2 * WIDTH, head_dim=64, context_length=4096)
    if not mmproj.exists():
        spec = PixtralSpec(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_ff=FFN, image_size=1540, patch_size=PATCH,
                           text_embd=WIDTH)
        write_mmproj(mmproj, text, spec, weight_type="F16")
    return text, mmproj


def main() -> None:
    args = vision.arguments(__doc__, rounds=5)
    jpeg = vision.mtmd_jpeg()
    vision.files = files
    print(vision.HEADER)
    for flash in (f == "on" for f in args.flash.split(",")):
        print(vision.row(LABEL, "mistral3", flash, args, jpeg), flush=True)


if __name__ == "__main__":
    main()
