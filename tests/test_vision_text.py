"""Gemma 3 prompts with images against llama.cpp's mtmd_helper_eval_chunks: the same chunks (mtmd's own
tokens around each image), our tower's embeddings in place of the image's placeholder tokens, image tokens
attending to each other both ways; then greedy decoding. Synthetic weights, F32, one and two images."""

from __future__ import annotations

import numpy as np
import pytest
from llama_reference import log_softmax
from synthetic.models import write_synthetic
from synthetic.vision import add_vision, write_mmproj
from test_vision import IMAGES, MTMD_JPEG, SPEC, THREADS, png_bytes

from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.models import Graph, load_model
from ollama_engine.models.vision import load_vision
from ollama_engine.runner.images import ImageData, ImageEncoder, prompt_inputs

pytestmark = pytest.mark.reference

TOLERANCE = 1e-4  # on logprobs; F32 weights
STEPS = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-text")
    text = write_synthetic(folder / "text.gguf", "gemma3", weight_type="F32")
    return {"text": text, "mmproj": write_mmproj(folder / "mmproj.gguf", SPEC),
            "single": add_vision(text, folder / "single.gguf", SPEC)}


def run(model, batch: Batch) -> np.ndarray | None:
    """One forward pass in a graph of its own (never reused)."""
    model.cache.prepare(batch)
    graph = Graph(model, None, batch)
    try:
        return graph.run()
    finally:
        graph.ctx.close()


def chunks_of(inputs) -> list[tuple[str, list]]:
    """Our inputs as mtmd's chunks: ("text", tokens) runs and ("image", embeddings)."""
    out: list[tuple[str, list]] = []
    skip = 0
    for inp in inputs:
        if skip:
            skip -= 1
        elif inp.multimodal is not None:
            out.append(("image", inp.multimodal))
            skip = inp.same_batch
        elif out and out[-1][0] == "text":
            out[-1][1].append(inp.token)
        else:
            out.append(("text", [inp.token]))
    return out


@pytest.mark.parametrize("names", [("png-wide",), ("png-tall", "mtmd-jpeg")], ids=["one-image", "two-images"])
def test_prompt_with_images_matches_mtmd(files, names):
    """Ollama's wire ([img-N] tags) through prompt_inputs gives mtmd's tokens around each image; decoded in
    mtmd's chunks (text, then each image alone, non-causal), the logprobs and greedy tokens are llama.cpp's."""
    from vision_reference import MtmdReference

    if MTMD_JPEG is None and "mtmd-jpeg" in names:
        pytest.skip("llama.cpp's source (tools/mtmd/test-1.jpeg) is not under build/src")
    images = [IMAGES[name]() for name in names]
    encoded = [png_bytes(image.pixels) for image in images]  # lossless: the same pixels again
    reference = MtmdReference(files["text"], files["mmproj"], threads=THREADS, n_ctx=512, n_batch=512)
    model = load_model(files["single"], num_threads=THREADS)  # the text model beside its tower, one file
    model.backend.load()
    model.cache.init(model.backend, cache_dtype("f16"), 1, 512, 512)
    tower = load_vision(files["single"], num_threads=THREADS)
    assert tower is not None
    tower.backend.load()
    encoder = ImageEncoder(tower)
    try:
        marker = reference.mtmd.mtmd_default_marker().decode()
        words = ["Look at ", " and at ", ". What do you see?"]
        theirs, position, expected = reference.eval_prompt(
            words[0] + " and at ".join(marker for _ in images) + words[-1], [image.pixels for image in images])
        ours_prompt = words[0] + " and at ".join(f"[img-{i}]" for i in range(len(images))) + words[-1]
        inputs = prompt_inputs(ours_prompt, [ImageData(i, data) for i, data in enumerate(encoded)],
                               model.tokenizer, encoder)
        chunks = chunks_of(inputs)
        assert [(k, v if k == "text" else len(v)) for k, v in chunks] == expected
        assert len(inputs) == position
        ours, done = None, 0
        for index, (kind, value) in enumerate(chunks):
            n, last = len(value), index == len(chunks) - 1
            extra = {"embeddings": ((0, value),)} if kind == "image" else {}
            batch = Batch(positions=range(done, done + n), sequences=[0] * n, outputs=[n - 1] if last else [],
                          tokens=value if kind == "text" else [0] * n, **extra)
            ours = run(model, batch)
            done += n
        assert ours is not None
        worst = 0.0
        for step in range(STEPS + 1):
            difference = float(np.abs(log_softmax(ours[0]) - log_softmax(theirs)).max())
            worst = max(worst, difference)
            assert difference < TOLERANCE, f"step {step}: logprobs differ by {difference}"
            token = int(theirs.argmax())
            assert int(ours[0].argmax()) == token, f"step {step}: greedy tokens differ"
            theirs = reference.decode_token(token, done)
            ours = run(model, Batch(positions=[done], sequences=[0], outputs=[0], tokens=[token]))
            done += 1
        print(f"{len(images)} image(s): largest logprob difference from llama.cpp {worst:.3g}")
        # a second prompt on the same image does not encode it again
        before = encoder.encoded
        prompt_inputs("[img-0]", [ImageData(0, encoded[0])], model.tokenizer, encoder)
        assert encoder.encoded == before
    finally:
        reference.close()
        tower.close()
        model.close()


def test_bad_image_and_missing_tag_are_image_errors(files):
    from ollama_engine.image import ImageError

    model = load_model(files["single"], num_threads=THREADS, allocate=False)
    tower = load_vision(files["single"], num_threads=THREADS, allocate=False)
    try:
        encoder = ImageEncoder(tower)
        with pytest.raises(ImageError):
            prompt_inputs("[img-0]", [ImageData(0, b"\x89PNG broken")], model.tokenizer, encoder)
        with pytest.raises(ImageError, match="invalid image index: 3"):
            prompt_inputs("[img-3]", [ImageData(0, b"")], model.tokenizer, encoder)
        with pytest.raises(ImageError, match="no vision tower"):
            prompt_inputs("hi", [ImageData(0, b"")], model.tokenizer, None)
        assert encoder.encoded == 0
    finally:
        tower.close()
        model.close()
