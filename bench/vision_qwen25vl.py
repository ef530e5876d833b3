"""Image encode time and time to first token with an image for the Qwen2.5-VL tower against llama.cpp's mtmd:
bench/vision.py's interleaved rounds (its Ours and Theirs, its ratio: llama.cpp's time / ours, above 1.00 we are
faster) on a synthetic qwen2vl text GGUF and a Qwen2.5-VL mmproj (F16; 14-pixel patches, 2 x 2 merge, windows of
112 pixels with full attention every 2nd layer). The image is mtmd's test-1.jpeg, 640 x 488: under the 2674-token
cap, so both sides resize it alike (644 x 476: 46 x 34 patches, 391 tokens).

Usage (on a quiet machine: /tmp/mine/quiet.sh for RESULTS.md):
    .venv/bin/python bench/vision_qwen25vl.py [--rounds 5] [--threads 2] [--flash off,on]
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import vision  # noqa: E402 - bench/vision.py: the engines and the interleaved rounds

# (layers, width, heads, ffn) of the tower; the text model is as wide
LAYERS, WIDTH, HEADS, FFN = 6, 384, 6, 1536
LABEL = f"Qwen2.5-VL {LAYERS}×{WIDTH}, patch 14, 640×488 (1564 patches, 391 tokens)"
vision.PROMPT = "<|im_start|>user\nDescribe this image in detail: <__media__><|im_end|>\n<|im_start|>assistant\n"


def files(size: str) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) in bench/out/, written on first use (size: bench/vision.py's argument, unused)."""
    from synthetic.models import write_synthetic
    from synthetic.vision_qwen25vl import Qwen25VLSpec, write_mmproj

    out = HERE / "out"
    out.mkdir(exist_ok=True)
    text, mmproj = out / "vision-qwen25vl-text.gguf", out / "vision-qwen25vl-mmproj.gguf"
    if not text.exists():  # epsilon 0: the pinned llama.cpp's qwen2vl reads none (see models/qwen2vl.py)
        write_synthetic(text, "tiny-qwen2vl", weight_type="F16", eps=0.0, n_layer=6, n_embd=WIDTH,
                        n_head=WIDTH // 64, n_head_kv=2, n_ff=2 * WIDTH, head_dim=64, rope_sections=(8, 12, 12, 0),
                        context_length=4096)
    if not mmproj.exists():
        spec = Qwen25VLSpec(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_ff=FFN, text_embd=WIDTH)
        write_mmproj(mmproj, spec, weight_type="F16")
    return text, mmproj


def main() -> None:
    args = vision.arguments(__doc__, rounds=5)
    jpeg = vision.mtmd_jpeg()
    vision.files = files
    print(vision.HEADER)
    for flash in (f == "on" for f in args.flash.split(",")):
        print(vision.row(LABEL, "qwen25vl", flash, args, jpeg), flush=True)


if __name__ == "__main__":
    main()
