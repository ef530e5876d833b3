"""An image is never cut by a context shift or by truncation (Ollama's rule for inputs a model says must stay
together): its rows are all in the context or none is. Gemma 3 with a synthetic tower in Ollama's single file;
the image becomes 16 rows between <start_of_image> and <end_of_image>.

What would go wrong otherwise: a shift that drops part of an image leaves rows whose neighbours (they attended
to each other both ways) are gone, and a prompt cut inside an image starts with embeddings no text leads to.
"""

from __future__ import annotations

import base64
import threading
from pathlib import Path

import pytest
from synthetic.models import write_synthetic
from synthetic.vision import add_vision
from test_runner_e2e import Client, free_port, start_runner
from test_vision import SPEC, png_bytes, smooth_image

from ollama_engine.fs.gguf_file import GGUFFile
from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.images import ImageData
from ollama_engine.runner.inputs import Input
from ollama_engine.runner.loop import Runner
from ollama_engine.runner.sequence import SequenceOptions, fit_prompt
from ollama_engine.sample import Sampler
from ollama_engine.tokenizer import from_metadata

IMAGE = png_bytes(smooth_image(50, 37, seed=1))
NUM_CTX = 48
ROWS = 16  # SPEC's image: (image / patch / 4)² tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vision-shift")
    text = write_synthetic(folder / "text.gguf", "gemma3", weight_type="F32")
    return add_vision(text, folder / "vision.gguf", SPEC)


# ------------------------------------------------------------ truncation (unit)


def group(start: int, rows: int, count: int) -> list[Input]:
    """count text inputs with an image's run of `rows` inputs beginning at `start`."""
    inputs = [Input(token=100 + i) for i in range(count)]
    inputs[start].same_batch = rows - 1
    return inputs


def test_num_keep_ending_inside_an_image_ends_before_it():
    """num_keep 4 with an image at 2..17: the kept prefix is the 2 inputs before the image (Ollama refused the
    prompt when it had to be truncated, and its shift dropped the image's last 14 rows)."""
    inputs = group(2, ROWS, 30)
    assert fit_prompt(inputs, NUM_CTX, 4, truncate=True) == (inputs, 2)
    assert fit_prompt(inputs, NUM_CTX, 2, truncate=True) == (inputs, 2)
    assert fit_prompt(inputs, NUM_CTX, 18, truncate=True) == (inputs, 18)  # the whole image kept
    assert fit_prompt(inputs, NUM_CTX, 17, truncate=True) == (inputs, 2)


@pytest.mark.parametrize("length", range(NUM_CTX + 1, NUM_CTX + ROWS + 4))
def test_truncation_keeps_an_image_whole_or_drops_it_whole(length: int):
    """Every cut point around an image at 2..17: the result fits, and holds the image's rows all or none."""
    inputs = group(2, ROWS, length)
    image = set(map(id, inputs[2 : 2 + ROWS]))
    kept, keep = fit_prompt(inputs, NUM_CTX, 4, truncate=True)
    assert keep == 2 and len(kept) <= NUM_CTX
    present = [i for i, inp in enumerate(kept) if id(inp) in image]
    assert present in ([], list(range(2, 2 + ROWS)))
    assert len(kept) == (NUM_CTX if present or length - NUM_CTX >= ROWS else length - ROWS)


# ------------------------------------------------------------ shifts in the batch loop


def rows_of(image: list[Input], inputs: list[Input]) -> list[int]:
    """Where the image's inputs (known by identity) are in a list of inputs."""
    return [i for i, inp in enumerate(inputs) if any(inp is row for row in image)]


@pytest.mark.parametrize(("prompt", "num_keep"), [
    ("[img-0] Describe it", 12),  # num_keep ends inside the image (at 8..23): it ends before it
    ("[img-0] Describe it", 4),  # the first shift's cut falls inside the image
    ("Look at this: [img-0] Describe it", 0),
    ("[img-0] Describe it", 24),  # the image inside the kept prefix: it stays through every shift
])
def test_shifts_keep_an_image_whole_or_drop_it_whole(model: Path, prompt: str, num_keep: int):
    """A 90-token generation in a 48-token context shifts several times; after each shift the slot holds the
    image's 16 rows together or none of them, and the KV cache holds exactly what the slot records."""
    loaded = open_model(str(model), LoadParams(parallel=1, batch_size=32, kv_size=NUM_CTX, num_threads=2),
                        allocate=True)
    loaded.load()
    errors: list[BaseException] = []
    runner = Runner(loaded, errors.append)
    shifts: list[tuple[int, list[int]]] = []
    image: list[Input] = []
    shift_slot = runner.cache.shift_slot

    def recording(slot, keep):
        shift_slot(slot, keep)
        shifts.append((len(slot.inputs), rows_of(image, slot.inputs)))

    runner.cache.shift_slot = recording
    runner.start()
    try:
        done = threading.Event()
        options = SequenceOptions(sampler=Sampler(temperature=0), num_predict=90, num_keep=num_keep)
        seq = runner.new_sequence(prompt, options, images=[ImageData(id=0, data=IMAGE)])
        start = next(i for i, inp in enumerate(seq.inputs) if inp.multimodal is not None)
        image.extend(seq.inputs[start : start + ROWS])
        assert seq.inputs[start].same_batch == ROWS - 1
        runner.add(seq, lambda piece: done.set() if piece is None else None)
        assert done.wait(120)
    finally:
        runner.close()
        loaded.close()
    assert not errors and seq.num_predicted == 90
    assert len(shifts) >= 3
    whole = list(range(start, start + ROWS))
    kept = seq.num_keep > start
    assert seq.num_keep == (start if start < num_keep < start + ROWS else num_keep)
    for length, rows in shifts:
        assert length < NUM_CTX
        assert rows == (whole if kept else []), (start, seq.num_keep, shifts)


# ------------------------------------------------------------ through the runner subprocess


def test_through_the_runner(model: Path):
    """Ollama's wire on a 48-token slot: a prompt cut inside its image is evaluated without the image's rows,
    a generation shifts past the image and ends normally, and the runner keeps serving."""
    tokenizer = from_metadata(GGUFFile.open(model).metadata)
    port = free_port()
    proc = start_runner(model, port)
    client = Client(port)
    try:
        for operation in (0, 1, 2):
            assert client.json("POST", "/load", {
                "Operation": operation, "LoraPath": None, "Parallel": 1, "BatchSize": 32, "FlashAttention": 0,
                "KvSize": NUM_CTX, "KvCacheType": "", "NumThreads": 2, "GPULayers": None, "MultiUserCache": False,
                "ProjectorPath": "", "MainGPU": 0, "UseMmap": False})["Success"]
        while client.json("GET", "/health")["status"] != 0:
            pass
        attached = [{"data": base64.b64encode(IMAGE).decode(), "id": 0}]
        before = 1 + len(tokenizer.encode("<start_of_image>", add_special=False))  # <bos> and the begin text
        after = len(tokenizer.encode("<end_of_image>", add_special=False))
        words, length = "", 0
        while 4 + length - NUM_CTX <= before + ROWS // 2:  # until the cut falls in the image's middle
            words += f" w{len(words)}"
            length = before + ROWS + after + len(tokenizer.encode(words, add_special=False))
        assert 4 + length - NUM_CTX < before + ROWS
        _, done = client.complete("[img-0]" + words, options={"num_predict": 1, "num_keep": 4, "temperature": 0},
                                  Images=attached)
        assert done["prompt_eval_count"] == 4 + length - before - ROWS  # the 4 kept, what follows the image
        _, done = client.complete("[img-0] Describe it", options={"num_predict": 90, "num_keep": 4,
                                                                  "temperature": 0}, Images=attached)
        assert done["eval_count"] == 90
        _, done = client.complete("still serving?", options={"num_predict": 3})
        assert done["eval_count"] == 3
    finally:
        proc.kill()
        proc.wait()
