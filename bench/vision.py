"""Image encode time and time to first token with an image: our Gemma 3 tower and runner against llama.cpp's mtmd.

Usage (on a quiet machine: /tmp/mine/quiet.sh for RESULTS.md):
    .venv/bin/python bench/vision.py [--sizes small,medium] [--rounds 7] [--threads 2]

Both engines load the same files (a synthetic Gemma 3 text GGUF and its mmproj, F16, written into bench/out/)
in one process and take turns, round by round, the order swapped every round, so that the machine's drift hits
both sides of a round alike; the ratio reported is the median over rounds of llama.cpp's time / ours (above 1.00
we are faster), flash attention off and on. The image is mtmd's own test-1.jpeg.

- **encode**: the decoded image's pixels to embeddings: our tower's encode (preprocessing included) against
  mtmd_tokenize + mtmd_encode_chunk (preprocessing included).
- **ttft**: the image file's bytes and a prompt to the first greedy token: our runner's batch loop (decode,
  tokenize, encode, prompt batches, sample; the embedding and prompt caches emptied before each round) against
  stb decoding, mtmd_tokenize, mtmd_helper_eval_chunks and an argmax of the last logits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from bench import log  # noqa: E402

PROMPT = "<start_of_turn>user\nDescribe this image in detail: <__media__><end_of_turn>\n<start_of_turn>model\n"
# (layers, width, heads, ffn, image side, patch) of the tower; the text model is as wide
SIZES = {
    "small": (6, 384, 6, 1536, 224, 14),  # 256 patches -> 16 tokens (the rough measurement of session 9)
    "medium": (12, 768, 12, 3072, 448, 14),  # 1024 patches -> 64 tokens
}
_KEEP_ALIVE: list[object] = []  # llama.cpp's objects hold ggml's log callback: they outlive every ggml call


def files(size: str) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) of this size in bench/out/, written on first use."""
    from synthetic.models import write_synthetic
    from synthetic.vision import VisionSpec, write_mmproj

    layers, width, heads, ffn, side, patch = SIZES[size]
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    text, mmproj = out / f"vision-{size}-text.gguf", out / f"vision-{size}-mmproj.gguf"
    if not text.exists():
        write_synthetic(text, "gemma3", weight_type="F16", n_layer=6, n_embd=width, n_head=width // 64,
                        n_head_kv=max(width // 256, 1), n_ff=2 * width, head_dim=64, context_length=4096,
                        sliding_window=512)
    if not mmproj.exists():
        spec = VisionSpec(n_layer=layers, n_embd=width, n_head=heads, n_ff=ffn, image_size=side, patch_size=patch,
                          text_embd=width)
        write_mmproj(mmproj, spec, weight_type="F16")
    return text, mmproj


class Ours:
    """Our runner in this process: open_model with the mmproj as ProjectorPath, the batch loop started."""

    def __init__(self, text: Path, mmproj: Path, threads: int, flash: bool):
        from ollama_engine.runner.allocate import LoadParams, open_model
        from ollama_engine.runner.loop import Runner

        params = LoadParams(parallel=1, batch_size=512, kv_size=2048, num_threads=threads,
                            flash_attention=int(flash), projector_path=str(mmproj))
        self.loaded = open_model(str(text), params, allocate=True)
        self.loaded.load()
        self.errors: list[BaseException] = []
        self.runner = Runner(self.loaded, self.errors.append)
        self.runner.start()

    def encode(self, image) -> float:
        started = time.perf_counter()
        self.loaded.images.tower.encode(image)
        return time.perf_counter() - started

    def ttft(self, data: bytes) -> float:
        from ollama_engine.runner.images import ImageData
        from ollama_engine.runner.prompt_cache import TO_END
        from ollama_engine.runner.sequence import SequenceOptions
        from ollama_engine.sample import Sampler

        self.loaded.images._cache.clear()  # a cold image: encoded again
        cache = self.loaded.input_cache
        for slot in cache.slots:  # a cold prompt: nothing reused
            cache.kv_cache.remove(slot.id, 0, TO_END)
            slot.inputs, slot.kernels = [], bytearray()
        done = threading.Event()
        started = time.perf_counter()
        options = SequenceOptions(sampler=Sampler(temperature=0), num_predict=1)
        seq = self.runner.new_sequence(PROMPT.replace("<__media__>", "[img-0]"), options,
                                       images=[ImageData(id=0, data=data)])
        self.runner.add(seq, lambda piece: done.set() if piece is None else None)
        done.wait()
        seconds = time.perf_counter() - started
        assert not self.errors and seq.images.encoded == 1 and seq.num_predicted == 1
        return seconds

    def close(self) -> None:
        self.runner.close()
        self.loaded.close()


class Theirs:
    """llama.cpp's context and mtmd on the same files (tests/vision_reference.py)."""

    def __init__(self, text: Path, mmproj: Path, threads: int, flash: bool):
        from vision_reference import MtmdReference

        self.ref = MtmdReference(text, mmproj, flash_attention=flash, threads=threads, n_ctx=2048, n_batch=512)
        _KEEP_ALIVE.append(self.ref)

    def encode(self, rgb: np.ndarray) -> float:
        started = time.perf_counter()
        self.ref.encode(rgb)
        return time.perf_counter() - started

    def ttft(self, data: bytes) -> float:
        started = time.perf_counter()
        rgb = self.ref.stb_decode(data)
        logits, _, _ = self.ref.eval_prompt(PROMPT, [rgb])
        int(np.argmax(logits))
        return time.perf_counter() - started


def measure(size: str, flash: bool, threads: int, rounds: int, jpeg: bytes) -> dict[str, list[float]]:
    from ollama_engine.image import decode_image

    text, mmproj = files(size)
    ours, theirs = Ours(text, mmproj, threads, flash), Theirs(text, mmproj, threads, flash)
    image = decode_image(jpeg)
    rgb = theirs.ref.stb_decode(jpeg)
    times: dict[str, list[float]] = {"encode ours": [], "encode llama.cpp": [], "ttft ours": [], "ttft llama.cpp": []}
    try:
        ours.encode(image), theirs.encode(rgb), ours.ttft(jpeg), theirs.ttft(jpeg)  # warm-up
        for round_ in range(rounds):
            order = [("ours", ours), ("llama.cpp", theirs)]
            if round_ % 2:
                order.reverse()
            for name, engine in order:
                times[f"encode {name}"].append(engine.encode(image if engine is ours else rgb))
            for name, engine in order:
                times[f"ttft {name}"].append(engine.ttft(jpeg))
            log(f"{size} flash {flash} round {round_ + 1}/{rounds}: encode "
                f"{times['encode llama.cpp'][-1] / times['encode ours'][-1]:.2f}x, ttft "
                f"{times['ttft llama.cpp'][-1] / times['ttft ours'][-1]:.2f}x")
    finally:
        ours.close()
    return times


HEADER = ("| tower | flash | encode ours ms | encode llama.cpp ms | ratio (quartiles) | ttft ours ms | "
          "ttft llama.cpp ms | ratio (quartiles) |\n|---|---|---|---|---|---|---|---|")


def arguments(description: str, **defaults: object) -> argparse.Namespace:
    """The options every vision benchmark takes (each script adds its defaults)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash", default="off,on")
    parser.set_defaults(**defaults)
    return parser.parse_args()


def mtmd_jpeg() -> bytes:
    from test_vision import MTMD_JPEG

    if MTMD_JPEG is None:
        sys.exit("mtmd's test-1.jpeg is not under build/src (run dev.py to unpack llama.cpp's source)")
    return MTMD_JPEG.read_bytes()


def row(label: str, size: str, flash: bool, args: argparse.Namespace, jpeg: bytes) -> str:
    """One table row: medians of both engines and the ratio llama.cpp / ours with its quartiles."""
    times = measure(size, flash, args.threads, args.rounds, jpeg)
    cells = []
    for what in ("encode", "ttft"):
        ours, theirs = times[f"{what} ours"], times[f"{what} llama.cpp"]
        ratios = sorted(t / o for o, t in zip(ours, theirs, strict=True))
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        cells += [f"{1000 * statistics.median(ours):.1f}", f"{1000 * statistics.median(theirs):.1f}",
                  f"{statistics.median(ratios):.2f} ({quartiles[0]:.2f}-{quartiles[2]:.2f})"]
    return f"| {label} | {'on' if flash else 'off'} | " + " | ".join(cells) + " |"


def main() -> None:
    args = arguments(__doc__)
    jpeg = mtmd_jpeg()
    print(HEADER)
    for size in args.sizes.split(","):
        layers, width, _, _, side, patch = SIZES[size]
        for flash in (f == "on" for f in args.flash.split(",")):
            print(row(f"{layers}×{width}, {side}² ({(side // patch) ** 2} patches)", size, flash, args, jpeg),
                  flush=True)


if __name__ == "__main__":
    main()
