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

import numpy as np
import pytest
from llama_reference import log_softmax
from synthetic.models import write_synthetic
from synthetic.vision import VisionSpec, add_vision, write_mmproj
from test_runner_e2e import LOAD, Client, completion, free_port, start_runner
from test_vision import png_bytes, smooth_image

from ollama_engine.runner.images import image_run

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


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-views")
    text = write_synthetic(folder / "text.gguf", "gemma3", weight_type="F32")
    return {"text": text, "single": add_vision(text, folder / "single.gguf", SPEC_256),
            "mmproj": write_mmproj(folder / "mmproj.gguf", SPEC_256)}


def mtmd_answer(files, prompt: str, pixels: list[np.ndarray], n_batch: int) -> list[tuple[int, np.ndarray]]:
    """llama.cpp's greedy tokens after the prompt, each with the log-softmax it was picked from."""
    from vision_reference import MtmdReference

    reference = MtmdReference(files["text"], files["mmproj"], threads=2, n_ctx=1024, n_batch=n_batch)
    try:
        marker = reference.mtmd.mtmd_default_marker().decode()
        logits, position, layout = reference.eval_prompt(prompt.replace("[img-0]", marker).replace("[img-1]", marker),
                                                         pixels)
        assert all(n == SPEC_256.image_size ** 2 // (SPEC_256.patch_size * SPEC_256.merge) ** 2
                   for kind, n in layout if kind == "image")
        out = []
        for _ in range(STEPS):
            token = int(logits.argmax())
            out.append((token, log_softmax(logits)))
            logits = reference.decode_token(token, position)
            position += 1
        return out
    finally:
        reference.close()


@pytest.mark.reference
@pytest.mark.parametrize("n_batch", [64, 100])
def test_an_image_larger_than_a_batch_is_mtmds(files, n_batch):
    """One and two 256-row images through the runner with BatchSize n_batch: llama.cpp's greedy tokens and
    logprobs, mtmd decoding each image in n_batch pieces."""
    from test_vision import IMAGES

    port = free_port()
    proc = start_runner(files["single"], port)
    client = Client(port)
    try:
        for operation in (0, 1, 2):
            assert client.json("POST", "/load", {**LOAD, "Operation": operation, "Parallel": 1, "KvSize": 1024,
                                                 "BatchSize": n_batch})["Success"]
        while client.json("GET", "/health")["status"] != 0:
            pass
        other = IMAGES["mtmd-jpeg"]() if IMAGES["mtmd-jpeg"] else None
        cases = [("Look at [img-0]. What do you see?", [IMAGE])]
        if other is not None:  # mtmd's JPEG, given as the same pixels (decoders are compared in test_vision)
            cases.append(("Compare [img-0] with [img-1], please.", [IMAGE, png_bytes(other.pixels)]))
        for prompt, encoded in cases:
            from ollama_engine.image import decode_image

            expected = mtmd_answer(files, prompt, [decode_image(data).pixels for data in encoded], n_batch)
            status, data = client.request("POST", "/completion", completion(
                prompt, options={"temperature": 0, "num_predict": STEPS}, Logprobs=True,
                Images=[{"data": base64.b64encode(data).decode(), "id": i} for i, data in enumerate(encoded)]))
            assert status == 200, data
            lines = [json.loads(line) for line in data.splitlines()]
            assert lines[-1]["done"] and lines[-1]["image_count"] == len(encoded)
            assert lines[-1]["prompt_eval_count"] > 256 * len(encoded)
            ours = [entry["logprob"] for line in lines for entry in line.get("logprobs") or []]
            text = "".join(line["content"] for line in lines)
            pieces = [entry["token"] for line in lines for entry in line.get("logprobs") or []]
            assert "".join(pieces) == text
            assert len(ours) == len(expected), (prompt, text)
            worst = 0.0
            for step, ((token, theirs), logprob) in enumerate(zip(expected, ours, strict=True)):
                difference = abs(float(theirs[token]) - logprob)
                worst = max(worst, difference)
                assert difference < TOLERANCE, (prompt, step, logprob, float(theirs[token]))
            tokenizer_pieces = expected_pieces(files, [token for token, _ in expected])
            assert pieces == tokenizer_pieces, (pieces, tokenizer_pieces)
            print(f"n_batch {n_batch}, {len(encoded)} image(s): largest logprob difference {worst:.3g}")
    finally:
        proc.kill()
        proc.wait()


def expected_pieces(files, tokens: list[int]) -> list[str]:
    from ollama_engine.fs.gguf_file import GGUFFile
    from ollama_engine.tokenizer import from_metadata

    tokenizer = from_metadata(GGUFFile.open(files["text"]).metadata)
    return [tokenizer.token_piece(t).decode(errors="replace") for t in tokens]
