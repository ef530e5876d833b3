"""Images through the runner subprocess, over Ollama's wire: `[img-N]` in the prompt and ImageData
({"data": base64, "id": N}) on /completion, driven as Ollama's scheduler drives a runner. Gemma 3 with its
tower in Ollama's single file (synthetic weights)."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from synthetic.models import write_synthetic
from synthetic.vision import add_vision, write_mmproj
from test_runner_e2e import LOAD, Client, completion, free_port, start_runner
from test_vision import SPEC, png_bytes, smooth_image

from ollama_engine.fs.gguf_file import GGUFFile
from ollama_engine.models import load_model
from ollama_engine.tokenizer import from_metadata

IMAGE = png_bytes(smooth_image(50, 37, seed=1))
OTHER = png_bytes(smooth_image(30, 60, seed=2))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-runner")
    text = write_synthetic(folder / "text.gguf", "gemma3", weight_type="F32")
    return {"text": text, "single": add_vision(text, folder / "vision.gguf", SPEC),
            "mmproj": write_mmproj(folder / "mmproj.gguf", SPEC)}


@pytest.fixture(scope="module")
def runner(files):
    model = files["single"]
    port = free_port()
    proc = start_runner(model, port)
    client = Client(port)
    try:
        client.loads = []
        for operation in (0, 1, 2):
            client.loads.append(client.json("POST", "/load", {**LOAD, "Operation": operation, "Parallel": 2,
                                                              "KvSize": 512, "BatchSize": 64}))
            assert client.loads[-1]["Success"]
        while client.json("GET", "/health")["status"] != 0:
            pass
        yield client
    finally:
        proc.kill()
        proc.wait()


def images(*pairs: tuple[int, bytes]) -> list[dict]:
    return [{"data": base64.b64encode(data).decode(), "id": n} for n, data in pairs]


def test_completion_with_an_image_encodes_it_once(runner):
    """The second question on the same image takes its embeddings from the cache: no encode, and the same
    greedy answer as the first (the prompt cache off, so the prompt is evaluated again)."""
    greedy = {"temperature": 0, "num_predict": 8}
    text, first = runner.complete("Describe [img-0] please", options=greedy, Images=images((0, IMAGE)))
    assert first["image_count"] == 1 and first["image_encode_count"] == 1 and first["image_encode_duration"] > 0
    assert first["prompt_eval_count"] > 16  # the image's 16 rows and the text around them
    again, second = runner.complete("Describe [img-0] please", options=greedy, Images=images((0, IMAGE)))
    assert second["image_count"] == 1 and second["image_encode_count"] == 0
    assert again == text
    _, both = runner.complete("[img-1] or [img-0]?", options=greedy, Images=images((0, IMAGE), (1, OTHER)))
    assert both["image_count"] == 2 and both["image_encode_count"] == 1


def test_bad_images_are_a_400_and_the_runner_keeps_serving(runner):
    for prompt, attached in [("look [img-0]", images((0, b"not an image"))),
                             ("look [img-0]", images((0, IMAGE[: len(IMAGE) // 2]))),
                             ("look [img-7]", images((0, IMAGE)))]:
        status, body = runner.request("POST", "/completion", completion(prompt, Images=attached))
        assert status == 400, body
    status, body = runner.request("POST", "/completion", json.dumps(
        {**completion("look [img-0]"), "Images": [{"data": "%%% not base64", "id": 0}]}).encode())
    assert status == 400
    text, done = runner.complete("still here?", options={"num_predict": 4})
    assert done["done"] and "image_count" not in done


@pytest.mark.reference
def test_greedy_answer_about_an_image_is_llama_cpps(runner, files):
    """The runner decodes an image in a batch of its own (its rows see no later text, as mtmd decodes it) even
    where the batch has room for the text after it: its greedy answer is llama.cpp's."""
    from test_vision import IMAGES
    from vision_reference import MtmdReference

    image = IMAGES["png-wide"]()
    reference = MtmdReference(files["text"], files["mmproj"], threads=2, n_ctx=512, n_batch=512)
    try:
        marker = reference.mtmd.mtmd_default_marker().decode()
        logits, position, _ = reference.eval_prompt(f"Look at {marker}. What do you see?", [image.pixels])
        tokenizer = from_metadata(GGUFFile.open(files["text"]).metadata)
        tokens = []
        while len(tokens) < 8 and not tokenizer.is_eog(token := int(logits.argmax())):
            tokens.append(token)
            logits = reference.decode_token(token, position)
            position += 1
    finally:
        reference.close()
    text, _ = runner.complete("Look at [img-0]. What do you see?", options={"temperature": 0, "num_predict": 8},
                              Images=images((0, png_bytes(image.pixels))))
    assert tokens and text == b"".join(tokenizer.token_piece(t) for t in tokens).decode()  # the runner's pieces


def test_batched_with_and_without_images_equals_solo(runner):
    """A prompt with an image and one without, decoded together (one batch loop, two slots), give the tokens each
    gives alone and its logprobs to 2e-3 (random weights give sharp logits, as in test_gemma.py). Not bit for bit:
    two text-only prompts are not either on this model here (measured: 2e-4), which is the batch loop's, not the
    images'."""
    requests = [("Tell me about [img-0] now", images((0, OTHER))), ("Tell me a story about a cat", [])]

    def run(prompt: str, attached: list[dict]) -> list[tuple[str, float]]:
        status, data = runner.request("POST", "/completion", completion(
            prompt, options={"temperature": 0, "num_predict": 12}, Images=attached, Logprobs=True))
        assert status == 200, data
        lines = [json.loads(line) for line in data.splitlines()]
        assert lines[-1]["done"]
        return [(entry["token"], entry["logprob"]) for line in lines for entry in line.get("logprobs") or []]

    solo = [run(*request) for request in requests]
    assert [run(*request) for request in requests] == solo  # alone again (the prompts now cached): bit for bit
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda request: run(*request), requests))
    assert all(len(result) == 12 for result in solo)
    for alone, batched in zip(solo, together, strict=True):
        assert [token for token, _ in batched] == [token for token, _ in alone]
        assert max(abs(a - b) for (_, a), (_, b) in zip(alone, batched, strict=True)) < 2e-3


def test_the_tower_is_in_the_memory_report_and_fit_equals_alloc(runner, files):
    """As Ollama's Go engine counted a tower: its weights with the output layer, the larger of the text and the
    image graph; what fit reports, alloc and commit report too."""
    from ollama_engine.models.vision import load_vision

    fit, alloc, commit = (load["Memory"] for load in runner.loads)
    assert fit == alloc == commit
    tower = load_vision(files["single"], allocate=False)
    text = load_model(files["text"], allocate=False)
    try:
        tower_bytes = sum(tower.backend.memory.cpu.weights) + tower.backend.memory.input_weights
        assert tower_bytes > 0
        assert fit["CPU"]["Weights"][-1] == text.backend.memory.cpu.weights[-1] + tower_bytes
        assert fit["CPU"]["Weights"][:-1] == text.backend.memory.cpu.weights[:-1]
    finally:
        tower.close()
        text.close()
