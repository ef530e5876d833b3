"""Images through a real `serve` with the official clients: `images` on /api/generate and /api/chat
(ollama), `image_url` data URLs (openai); `vision` in /api/show; a corrupt image is a 400 before any model is
loaded and the server keeps serving. Gemma 3 with its tower in Ollama's single file (synthetic weights)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import ollama
import openai
import pytest
from serve_process import serve_process
from synthetic.models import write_synthetic
from synthetic.vision import add_vision, write_mmproj
from test_vision import SPEC, png_bytes, smooth_image

from ollama_engine.api.attach import AttachmentError, attach_images

IMAGE = png_bytes(smooth_image(50, 37, seed=1))
GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-api")
    text = write_synthetic(folder / "text.gguf", "gemma3", weight_type="F32")
    vision = add_vision(text, folder / "vision.gguf", SPEC)
    mmproj = write_mmproj(folder / "mmproj.gguf", SPEC)
    (folder / "models").mkdir()
    with serve_process(folder / "models") as url:
        client = ollama.Client(host=url)
        for name, path in (("vision", vision), ("textonly", text)):
            assert client.create(model=name, files={path.name: client.create_blob(path)}).status == "success"
        # llama.cpp's layout: the text model and its mmproj, two files of one model (a projector layer)
        files = {path.name: client.create_blob(path) for path in (text, mmproj)}
        assert client.create(model="split", files=files).status == "success"
        yield url, "vision", "textonly"


def test_ollama_client_sends_images(served):
    url, vision, text = served
    client = ollama.Client(host=url)
    assert "vision" in client.show(vision).capabilities
    assert "vision" not in client.show(text).capabilities
    generated = client.generate(model=vision, prompt="What is this?", images=[IMAGE], options=GREEDY)
    assert generated.done and generated.response
    assert generated.prompt_eval_count > 16  # the image's 16 embeddings and the text around them
    plain = client.generate(model=vision, prompt="What is this?", options=GREEDY)
    assert plain.prompt_eval_count + 16 <= generated.prompt_eval_count
    chat = client.chat(model=vision, messages=[{"role": "user", "content": "What is this?", "images": [IMAGE]}],
                       options=GREEDY)
    assert chat.done and chat.message.content and chat.prompt_eval_count > 16


def test_openai_client_sends_image_urls(served):
    url, vision, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    data_url = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
    answer = client.chat.completions.create(model=vision, max_tokens=6, temperature=0, messages=[{
        "role": "user", "content": [{"type": "text", "text": "What is this?"},
                                    {"type": "image_url", "image_url": {"url": data_url}}]}])
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > 16


def test_bad_images_are_a_400_and_serving_goes_on(served):
    url, vision, text = served
    client = ollama.Client(host=url)
    for images in ([b"not an image"], [IMAGE[: len(IMAGE) // 2]]):
        with pytest.raises(ollama.ResponseError) as error:
            client.generate(model=vision, prompt="What is this?", images=images, options=GREEDY)
        assert error.value.status_code == 400 and "invalid image" in str(error.value)
    with pytest.raises(ollama.ResponseError) as error:
        client.chat(model=text, messages=[{"role": "user", "content": "hi", "images": [IMAGE]}], options=GREEDY)
    assert error.value.status_code == 400 and "does not support images" in str(error.value)
    assert client.generate(model=vision, prompt="still there?", options=GREEDY).done


def test_a_model_with_a_separate_mmproj_answers_as_the_single_file(served):
    """create with a text GGUF and an mmproj GGUF makes one vision model (the store's projector layer, passed to
    the runner as ProjectorPath); the same weights as the single file give the same greedy answer."""
    url, vision, _ = served
    client = ollama.Client(host=url)
    assert "vision" in client.show("split").capabilities
    split = client.generate(model="split", prompt="What is this?", images=[IMAGE], options=GREEDY)
    single = client.generate(model=vision, prompt="What is this?", images=[IMAGE], options=GREEDY)
    assert split.response == single.response and split.prompt_eval_count == single.prompt_eval_count


def test_attach_images_takes_image_paths_out_of_the_text(tmp_path):
    (tmp_path / "a cat.png").write_bytes(IMAGE)
    (tmp_path / "notes.png").write_bytes(b"not an image")
    text, attached = attach_images(f"what is in {tmp_path}/a\\ cat.png and ./missing.png?")
    assert text == "what is in  and ./missing.png?" and attached == [base64.b64encode(IMAGE).decode()]
    with pytest.raises(AttachmentError, match="invalid file type"):
        attach_images(f"and {tmp_path}/notes.png")


def test_cli_run_attaches_an_image_path(served, tmp_path):
    """`ollama-engine run MODEL "describe ./cat.png"` sends the file as the message's image, as `ollama run`."""
    url, vision, text = served
    (tmp_path / "cat.png").write_bytes(IMAGE)
    env = {**os.environ, "OLLAMA_HOST": url.removeprefix("http://")}

    def run(model: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ollama_engine", "run", model, "describe ./cat.png"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)

    answered = run(vision)
    assert answered.returncode == 0, answered.stderr
    assert "Added image" in answered.stderr and answered.stdout.strip()
    refused = run(text)  # the image did go: a text-only model refuses it
    assert refused.returncode != 0 and "does not support images" in refused.stderr + refused.stdout
