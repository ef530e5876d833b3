"""Image embeddings larger than a batch: the runner cuts an image's run into views of at most num_batch rows,
each decoded in a batch of its own, as llama.cpp's mtmd_helper_decode_image_chunk decodes an image chunk in
n_batch pieces. Gemma 3 with a 256-token tower (synthetic weights, Ollama's single file) through the runner
subprocess, against mtmd_helper_eval_chunks with the same n_batch: the same greedy tokens, logprobs within
1e-4. Gemma 3's image rows attend both ways within a piece, so a run decoded whole (the runner's behaviour
before views) gives other logprobs: the comparison can fail.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from llama_reference import log_softmax
from synthetic.models import write_synthetic
from synthetic.vision import VisionSpec, add_vision, write_mmproj
from test_runner_e2e import LOAD, Client, completion, free_port, start_runner
from test_vision import png_bytes, smooth_image

from ollama_engine.fs.gguf_file import GGUFFile
from ollama_engine.runner.images import image_run
from ollama_engine.runner.inputs import Input, kept_together
from ollama_engine.runner.prompt_cache import InputCache
from ollama_engine.runner.sequence import fit_prompt
from ollama_engine.tokenizer import from_metadata

SPEC_256 = VisionSpec(image_size=64, patch_size=2, merge=2)  # 32 patches a side pooled by 2: 16 x 16 = 256 rows
TOLERANCE = 1e-4  # on logprobs; F32 weights
STEPS = 8
IMAGE = png_bytes(smooth_image(50, 37, seed=1))


def test_a_run_is_cut_into_views_of_a_batch():
    rows = np.arange(256 * 3, dtype=np.float32).reshape(256, 3)
    run = image_run(rows, 7, 100)
    assert len(run) == 256
    heads = [(i, inp) for i, inp in enumerate(run) if inp.multimodal is not None]
    assert [(i, inp.same_batch, len(inp.multimodal)) for i, inp in heads] == [(0, 99, 100), (100, 99, 100),
                                                                             (200, 55, 56)]
    assert all(np.shares_memory(inp.multimodal, rows) and inp.multimodal_hash == 7 for _, inp in heads)  # views
    assert np.array_equal(np.concatenate([inp.multimodal for _, inp in heads]), rows)
    assert [len(inp.multimodal) for inp in image_run(rows, 7, None) if inp.multimodal is not None] == [256]
    assert [len(inp.multimodal) for inp in image_run(rows, 7, 256) if inp.multimodal is not None] == [256]


def viewed_prompt(length: int, start: int = 2, rows: int = 16, batch: int = 10) -> tuple[list[Input], list[Input]]:
    """length inputs: text, and at `start` an image of `rows` rows cut into views of `batch` (10 + 6), then a
    second run of the same image right after it (as Llama 4's next tile): the prompt and the image's inputs."""
    embeddings = np.zeros((rows, 4), dtype=np.float32)
    image = image_run(embeddings, 7, batch) + image_run(embeddings, 7, batch)
    inputs = [Input(token=100 + i) for i in range(start)] + image
    inputs += [Input(token=200 + i) for i in range(length - len(inputs))]
    return inputs, image


def test_an_image_in_views_stays_whole_through_truncation_and_shifts():
    """Views (and further tiles) of one image are separate same-batch groups, yet kept together: a num_keep that
    ends inside any of them ends before the image; truncation and a shift's discard take all its rows or none."""
    inputs, image = viewed_prompt(40)
    assert [kept_together(inputs, i) for i in (2, 12, 18, 28, 34)] == [31, 21, 15, 5, 0]
    for keep in range(3, 34):
        assert fit_prompt(inputs, 48, keep, truncate=True)[1] == 2, keep
    assert fit_prompt(inputs, 48, 34, truncate=True)[1] == 34
    rows = {id(inp) for inp in image}
    for length in range(49, 49 + 40):
        inputs, image = viewed_prompt(length)
        rows = {id(inp) for inp in image}
        kept, keep = fit_prompt(inputs, 48, 2, truncate=True)
        present = [i for i, inp in enumerate(kept) if id(inp) in rows]
        assert keep == 2 and len(kept) <= 48 and present in ([], list(range(2, 34))), length
    cache = InputCache(None, 48, 1, 1, multi_user=False, remove_errors=ValueError)
    inputs, _ = viewed_prompt(48)
    for keep in (0, 1, 2):  # the discard reaches into the image: it takes it all (up to 34 from 0..2 kept)
        assert cache.shift_discard(inputs, keep) == 34 - keep
    other = image_run(np.zeros((16, 4), dtype=np.float32), 8, 10)  # another image right after: not kept with it
    assert kept_together(image + other, 0) == 31


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-views")
    text = write_synthetic(folder / "text.gguf", "gemma3", weight_type="F32")
    return {"text": text, "single": add_vision(text, folder / "single.gguf", SPEC_256),
            "mmproj": write_mmproj(folder / "mmproj.gguf", SPEC_256)}


def mtmd_answer(text, mmproj, prompt: str, pixels: list[np.ndarray], n_batch: int,
                steps: int = STEPS) -> list[tuple[int, np.ndarray]]:
    """llama.cpp's greedy tokens after the prompt ([img-N] at mtmd's marker), each with the log-softmax it was
    picked from: the prompt decoded by mtmd_helper_eval_chunks with n_batch."""
    from vision_reference import MtmdReference

    reference = MtmdReference(text, mmproj, threads=2, n_ctx=1024, n_batch=n_batch)
    try:
        marker = reference.mtmd.mtmd_default_marker().decode()
        logits, position, _ = reference.eval_prompt(re.sub(r"\[img-\d+\]", marker, prompt), pixels)
        out = []
        for _ in range(steps):
            token = int(logits.argmax())
            out.append((token, log_softmax(logits)))
            logits = reference.decode_token(token, position)
            position += 1
        return out
    finally:
        reference.close()


def start_loaded_runner(model: Path, n_batch: int, projector: Path | None = None) -> tuple[subprocess.Popen, Client]:
    """A runner subprocess on model (and a separate projector), loaded as a scheduler loads it, one slot."""
    port = free_port()
    proc = start_runner(model, port)
    client = Client(port)
    try:
        load = {**LOAD, "Parallel": 1, "KvSize": 1024, "BatchSize": n_batch, "ProjectorPath": str(projector or "")}
        for operation in (0, 1, 2):
            assert client.json("POST", "/load", {**load, "Operation": operation})["Success"]
        while client.json("GET", "/health")["status"] != 0:
            pass
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, client


def compare_with_mtmd(client: Client, text: Path, mmproj: Path, prompt: str, encoded: list[bytes], n_batch: int,
                      tolerance: float = TOLERANCE, steps: int = STEPS) -> float:
    """The runner's greedy answer to prompt with these images against llama.cpp's: the same tokens, each
    logprob within tolerance. Returns the largest difference."""
    from ollama_engine.image import decode_image

    expected = mtmd_answer(text, mmproj, prompt, [decode_image(data).pixels for data in encoded], n_batch, steps)
    status, data = client.request("POST", "/completion", completion(
        prompt, options={"temperature": 0, "num_predict": steps}, Logprobs=True,
        Images=[{"data": base64.b64encode(data).decode(), "id": i} for i, data in enumerate(encoded)]))
    assert status == 200, data
    lines = [json.loads(line) for line in data.splitlines()]
    assert lines[-1]["done"] and lines[-1]["image_count"] == len(encoded)
    entries = [entry for line in lines for entry in line.get("logprobs") or []]
    assert "".join(entry["token"] for entry in entries) == "".join(line["content"] for line in lines)
    tokenizer = from_metadata(GGUFFile.open(text).metadata)
    assert [entry["token"] for entry in entries] == [
        tokenizer.token_piece(token).decode(errors="replace") for token, _ in expected], prompt
    worst = 0.0
    for step, ((token, theirs), entry) in enumerate(zip(expected, entries, strict=True)):
        difference = abs(float(theirs[token]) - entry["logprob"])
        worst = max(worst, difference)
        assert difference < tolerance, (prompt, step, entry["logprob"], float(theirs[token]))
    return worst


@pytest.mark.reference
@pytest.mark.parametrize("n_batch", [64, 100])
def test_an_image_larger_than_a_batch_is_mtmds(files, n_batch):
    """One and two 256-row images through the runner with BatchSize n_batch: llama.cpp's greedy tokens and
    logprobs, mtmd decoding each image in n_batch pieces."""
    from test_vision import IMAGES, MTMD_JPEG

    cases = [("Look at [img-0]. What do you see?", [IMAGE])]
    if MTMD_JPEG is not None:  # mtmd's JPEG, given as the same pixels (decoders are compared in test_vision)
        cases.append(("Compare [img-0] with [img-1], please.", [IMAGE, png_bytes(IMAGES["mtmd-jpeg"]().pixels)]))
    proc, client = start_loaded_runner(files["single"], n_batch)
    try:
        for prompt, encoded in cases:
            worst = compare_with_mtmd(client, files["text"], files["mmproj"], prompt, encoded, n_batch)
            print(f"n_batch {n_batch}, {len(encoded)} image(s) of 256 rows: largest logprob difference {worst:.3g}")
    finally:
        proc.kill()
        proc.wait()
