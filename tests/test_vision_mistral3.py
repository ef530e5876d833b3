"""Mistral 3's Pixtral tower against llama.cpp's mtmd (libmtmd, llama-cpp-python 0.3.36) on synthetic weights,
from llama.cpp's mmproj and from Ollama's single file: the image sizes mtmd's dyn_size preprocessing picks,
the embeddings (bitwise: the same ggml operations on the same pixels and threads), then prompts with one and
two images decoded as mtmd_helper_eval_chunks decodes them (logprobs to 1e-4, the same greedy tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from llama_reference import log_softmax
from synthetic.models import write_synthetic
from synthetic.vision_mistral3 import PixtralSpec, add_vision, write_mmproj
from test_vision import IMAGES, MTMD_JPEG, THREADS, png_bytes, smooth_image
from test_vision_text import chunks_of, run

from ollama_engine.fs.gguf_file import GGUFFile
from ollama_engine.image import decode_image
from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.models import load_model
from ollama_engine.models.vision import load_vision
from ollama_engine.runner.images import ImageData, ImageEncoder, prompt_inputs

SPEC = PixtralSpec()
TOLERANCE = 1e-4  # on logprobs; F32 weights
STEPS = 6

# sizes that take each of dyn_size's paths: rounding to the patch x merge grid (36 x 28: 4.5 and 3.5 cells,
# rounded half away from zero), scaled up to 8 tokens (5 x 5, 3 x 40), down to 1024 (400 x 300, 1000 x 90)
SIZES = [(50, 37), (23, 71), (36, 28), (5, 5), (3, 40), (400, 300), (1000, 90), (64, 64)]
TOWER_IMAGES = {
    **{name: IMAGES[name] for name in ("png-wide", "png-tall", "mtmd-jpeg")},
    "png-tiny": lambda: decode_image(png_bytes(smooth_image(5, 5, seed=5))),
    "png-large": lambda: decode_image(png_bytes(smooth_image(400, 300, seed=6))),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vision-mistral3")
    text = write_synthetic(folder / "text.gguf", "tiny-mistral3", weight_type="F32")
    out = {"text": text}
    for weight_type in ("F32", "F16"):
        out[f"mmproj-{weight_type}"] = write_mmproj(folder / f"mmproj-{weight_type}.gguf", text, SPEC,
                                                    weight_type=weight_type)
        out[f"single-{weight_type}"] = add_vision(text, folder / f"single-{weight_type}.gguf", SPEC,
                                                  weight_type=weight_type)
    return out


@pytest.fixture(scope="module")
def img_break(files) -> np.ndarray:
    """[IMG_BREAK]'s embedding as the synthetic mmproj stores it (the text model's token_embd row)."""
    return np.array(GGUFFile.open(files["mmproj-F32"]).tensor_data("v.token_embd.img_break")).view(np.float32)


def our_tower(path: Path, flash: bool = False):
    tower = load_vision(path, num_threads=THREADS, flash_attention=flash)
    assert tower is not None
    tower.backend.load()
    return tower


def test_both_layouts_load_as_the_pixtral_tower(files):
    towers = [load_vision(files[name], allocate=False) for name in ("mmproj-F32", "single-F32")]
    try:
        assert [t.projector for t in towers] == ["pixtral", "mistral3"]
        assert [t.layout for t in towers] == ["mmproj", "ollama"]
        for tower in towers:
            assert (tower.merge, tower.text_embd, tower.image_end) == (SPEC.merge, SPEC.text_embd, "[IMG_END]")
            for field in ("mean", "std"):  # Ollama's file: CLIP's, as the mmproj's (float32, as to_planar uses them)
                ours, theirs = getattr(tower.pixel_spec, field), getattr(towers[0].pixel_spec, field)
                assert np.array_equal(np.float32(ours), np.float32(theirs))
    finally:
        for tower in towers:
            tower.close()


def test_a_too_narrow_image_is_an_image_error(files):
    """10000 x 2 pixels: dyn_size keeps the short side at one cell and scales the long one for the budget, which
    leaves 18096 x 8, above it (llama.cpp would encode 9048 patches, more than the graph reserved at load):
    an ImageError (the runner's 400) before any graph is built."""
    from ollama_engine.image import ImageError

    tower = load_vision(files["single-F32"], allocate=False)
    try:
        image = decode_image(png_bytes(smooth_image(10000, 2)))
        with pytest.raises(ImageError, match="too narrow"):
            tower.tokens(image)
        with pytest.raises(ImageError, match="too narrow"):
            tower.pixels(image)
        assert tower.tokens(decode_image(png_bytes(smooth_image(4000, 5)))) > 0  # long but within the budget
    finally:
        tower.close()


@pytest.mark.parametrize("weight_type", ["F16", "Q8_0", "Q4_0"])
def test_single_file_img_break_is_the_text_models_token_embd_row(tmp_path, weight_type):
    """Ollama's file has no [IMG_BREAK] tensor: the tower's break rows are token_embd's row of that token (id 12
    here), dequantized by ggml as the text model's lookup would (equal to gguf-py's dequantization)."""
    import gguf

    text = write_synthetic(tmp_path / "text.gguf", "tiny-mistral3", weight_type=weight_type)
    single = add_vision(text, tmp_path / "single.gguf", SPEC)
    info = GGUFFile.open(single).tensors["token_embd.weight"]
    assert info.file_type == gguf.GGMLQuantizationType[weight_type]
    rows = np.array(GGUFFile.open(single).tensor_data(info.name)).reshape(info.shape[1], -1)
    expected = gguf.quants.dequantize(rows[12], gguf.GGMLQuantizationType(info.file_type)).reshape(-1)
    tower = our_tower(single)
    try:
        image = IMAGES["png-wide"]()
        out = tower.encode(image)
        breaks = break_rows(tower, image)
        assert len(breaks) == 4
        assert np.array_equal(out[breaks], np.broadcast_to(expected, (len(breaks), SPEC.text_embd)))
    finally:
        tower.close()


@pytest.mark.reference
def test_image_sizes_and_token_counts_are_mtmds(files):
    """mtmd's image chunk of each size has as many tokens as our tower gives it (dyn_size's target size:
    rounding, the 8-token floor, the 1024-token ceiling; one [IMG_BREAK] per row but the last)."""
    from vision_reference import MtmdReference

    reference = MtmdReference(files["text"], files["mmproj-F32"], threads=THREADS, n_ctx=2048, n_batch=2048)
    tower = load_vision(files["mmproj-F32"], allocate=False)
    try:
        marker = reference.mtmd.mtmd_default_marker().decode()
        for width, height in SIZES:
            image = decode_image(png_bytes(smooth_image(width, height)))
            chunks = reference._chunks(marker, [image.pixels])
            try:
                mtmd = reference.mtmd
                counts = [mtmd.mtmd_input_chunk_get_n_tokens(mtmd.mtmd_input_chunks_get(chunks, i))
                          for i in range(mtmd.mtmd_input_chunks_size(chunks))
                          if mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, i))
                          == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE]
            finally:
                reference.mtmd.mtmd_input_chunks_free(chunks)
            assert counts == [tower.tokens(image)], (width, height, tower.size(image))
            across, down = (side // SPEC.patch_size // SPEC.merge for side in tower.size(image))
            assert 8 <= across * down <= 1024
    finally:
        reference.close()
        tower.close()


def break_rows(tower, image) -> np.ndarray:
    """The rows of an image's embeddings that are [IMG_BREAK]: the last of each row of merged patches but the
    last row's."""
    across = tower.size(image)[0] // SPEC.patch_size // SPEC.merge
    return np.arange(across, tower.tokens(image), across + 1)


def assert_llama_cpps(got: np.ndarray, expected: np.ndarray, breaks: np.ndarray, img_break: np.ndarray,
                      what: object) -> None:
    """got == expected bitwise, but where llama.cpp's row is NaN: its pixtral graph writes [IMG_BREAK] as
    ggml_scale(an uninitialised tensor, 0) + the embedding, so a NaN left in its compute buffer (seen with
    flash attention on) makes a break row NaN. Such rows must be break rows; ours there are the embedding."""
    lost = np.flatnonzero(np.isnan(expected).any(axis=1))
    assert set(lost) <= set(breaks), (what, lost, breaks)
    kept = np.setdiff1d(np.arange(len(expected)), lost)
    assert np.array_equal(got[kept], expected[kept]), (what, float(np.abs(got[kept] - expected[kept]).max()))
    if len(breaks):
        assert np.array_equal(got[breaks], np.broadcast_to(img_break, (len(breaks), SPEC.text_embd))), what


@pytest.mark.reference
@pytest.mark.parametrize("flash", [False, True], ids=["plain", "flash"])
@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_pixtral_tower_matches_mtmd(files, img_break, weight_type, flash):
    """Embeddings ([IMG_BREAK] rows included) of PNGs of every path and of mtmd's own JPEG equal
    mtmd_encode_chunk's bitwise, from the mmproj and from Ollama's single file (given the same pixels)."""
    from vision_reference import MtmdReference

    if MTMD_JPEG is None:
        pytest.skip("llama.cpp's source (tools/mtmd/test-1.jpeg) is not under build/src")
    reference = MtmdReference(files["text"], files[f"mmproj-{weight_type}"], flash_attention=flash, threads=THREADS)
    towers = [our_tower(files[f"{layout}-{weight_type}"], flash) for layout in ("mmproj", "single")]
    try:
        for name, make in TOWER_IMAGES.items():
            if name == "png-large" and (weight_type, flash) != ("F32", False):
                continue  # ~4000 patches: once is enough (mtmd's JPEG takes the same path in every case)
            image = make()
            expected = reference.encode(image.pixels)
            assert expected.shape == (towers[0].tokens(image), SPEC.text_embd), name
            breaks = break_rows(towers[0], image)
            for tower in towers:
                got = tower.encode(image)
                assert got.shape == expected.shape, name
                assert_llama_cpps(got, expected, breaks, img_break, (name, tower.layout))
    finally:
        reference.close()
        for tower in towers:
            tower.close()


def warm(reference, images) -> None:
    """Run mtmd's encoder over these images (largest first) until none comes out with a NaN: a fresh compute
    buffer's garbage can make llama.cpp's [IMG_BREAK] rows NaN (see assert_llama_cpps), and NaN embeddings
    would make its logits NaN; a buffer a real graph has written holds finite values."""
    ordered = sorted(images, key=lambda image: -image.pixels.size)
    for _ in range(3):
        if not any(np.isnan(reference.encode(image.pixels)).any() for image in ordered):
            return
    pytest.fail("llama.cpp's encoder keeps writing NaN [IMG_BREAK] rows")


@pytest.mark.reference
@pytest.mark.parametrize("layout", ["single", "mmproj"])
@pytest.mark.parametrize("names", [("png-wide",), ("png-tall", "mtmd-jpeg")], ids=["one-image", "two-images"])
def test_prompt_with_images_matches_mtmd(files, names, layout):
    """Ollama's wire ([img-N] tags) through the runner's prompt_inputs gives mtmd's chunks (each image's
    embeddings with its [IMG_BREAK] rows, then the text [IMG_END]); decoded chunk by chunk, the logprobs and
    greedy tokens are llama.cpp's."""
    from vision_reference import MtmdReference

    if MTMD_JPEG is None and "mtmd-jpeg" in names:
        pytest.skip("llama.cpp's source (tools/mtmd/test-1.jpeg) is not under build/src")
    images = [IMAGES[name]() for name in names]
    encoded = [png_bytes(image.pixels) for image in images]  # lossless: the same pixels again
    reference = MtmdReference(files["text"], files["mmproj-F32"], threads=THREADS, n_ctx=2048, n_batch=1024)
    text_file = files["single-F32"] if layout == "single" else files["text"]
    model = load_model(text_file, num_threads=THREADS)
    model.backend.load()
    model.cache.init(model.backend, cache_dtype("f16"), 1, 2048, 1024)
    tower = our_tower(files[f"{layout}-F32"])
    encoder = ImageEncoder(tower)
    try:
        warm(reference, images)
        marker = reference.mtmd.mtmd_default_marker().decode()
        words = ["Look at ", " and at ", ". What do you see?"]
        theirs, position, expected = reference.eval_prompt(
            words[0] + words[1].join(marker for _ in images) + words[-1], [image.pixels for image in images])
        ours_prompt = words[0] + words[1].join(f"[img-{i}]" for i in range(len(images))) + words[-1]
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
        print(f"{layout}, {len(images)} image(s): largest logprob difference from llama.cpp {worst:.3g}")
    finally:
        reference.close()
        tower.close()
        model.close()


# ------------------------------------------------------------ through the runner subprocess (Ollama's wire)


@pytest.fixture(scope="module", params=[512, 16], ids=["batch-512", "batch-16"])
def runner(files, request):
    """A runner on the single file; at num_batch 16 the image's 34 rows are decoded as views of 16, 16 and 2."""
    from test_runner_e2e import LOAD, Client, free_port, start_runner

    port = free_port()
    proc = start_runner(files["single-F32"], port)
    client = Client(port)
    try:
        client.loads = []
        for operation in (0, 1, 2):  # fit, alloc, commit
            client.loads.append(client.json("POST", "/load", {**LOAD, "Operation": operation, "Parallel": 1,
                                                              "KvSize": 1024, "BatchSize": request.param}))
            assert client.loads[-1]["Success"]
        while client.json("GET", "/health")["status"] != 0:
            pass
        client.batch_size = request.param
        yield client
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.reference
def test_runner_answers_about_an_image_as_llama_cpp(runner, files):
    """Ollama's /completion with [img-0] and ImageData on the single file: llama.cpp's greedy answer (mtmd on
    the mmproj, the same n_batch), the image encoded once (a second request takes it from the cache), fit ==
    alloc == commit."""
    import base64

    from vision_reference import MtmdReference

    from ollama_engine.tokenizer import from_metadata

    image = IMAGES["png-wide"]()
    reference = MtmdReference(files["text"], files["mmproj-F32"], threads=THREADS, n_ctx=1024,
                              n_batch=runner.batch_size)
    try:
        warm(reference, [image])
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
    attached = [{"data": base64.b64encode(png_bytes(image.pixels)).decode(), "id": 0}]
    greedy = {"temperature": 0, "num_predict": 8}
    text, first = runner.complete("Look at [img-0]. What do you see?", options=greedy, Images=attached)
    assert tokens and text == b"".join(tokenizer.token_piece(t) for t in tokens).decode()
    assert first["image_count"] == 1 and first["image_encode_count"] == 1
    again, second = runner.complete("Look at [img-0]. What do you see?", options=greedy, Images=attached)
    assert again == text and second["image_encode_count"] == 0
    fit, alloc, commit = (load["Memory"] for load in runner.loads)
    assert fit == alloc == commit


# ------------------------------------------------------------ through a real serve with the official clients


def test_official_clients_get_answers_about_an_image(files, tmp_path):
    """ollama's generate/chat with images and openai's image_url data URL on the single file; the same model
    made of the text GGUF and the mmproj (Ollama's files map: a projector layer) gives the same greedy answer;
    `vision` in capabilities."""
    import base64

    import ollama
    import openai
    from serve_process import serve_process

    image = png_bytes(smooth_image(50, 37, seed=1))
    greedy = {"temperature": 0, "num_predict": 6}
    (tmp_path / "models").mkdir()
    with serve_process(tmp_path / "models") as url:
        client = ollama.Client(host=url)
        single = files["single-F32"]
        assert client.create(model="single", files={single.name: client.create_blob(single)}).status == "success"
        split = {path.name: client.create_blob(path) for path in (files["text"], files["mmproj-F32"])}
        assert client.create(model="split", files=split).status == "success"
        answers = []
        for name in ("single", "split"):
            assert "vision" in client.show(name).capabilities
            generated = client.generate(model=name, prompt="What is this?", images=[image], options=greedy)
            assert generated.done and generated.response and generated.prompt_eval_count > 34  # 34 image rows
            answers.append(generated.response)
        assert answers[0] == answers[1]
        chat = client.chat(model="single", messages=[{"role": "user", "content": "What is this?", "images": [image]}],
                           options=greedy)
        assert chat.done and chat.message.content and chat.prompt_eval_count > 34
        data_url = "data:image/png;base64," + base64.b64encode(image).decode()
        answer = openai.OpenAI(base_url=f"{url}/v1", api_key="unused").chat.completions.create(
            model="single", max_tokens=6, temperature=0, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_url}}]}])
        assert answer.choices[0].message.content and answer.usage.prompt_tokens > 34


def test_runner_refuses_a_too_narrow_image_and_keeps_serving(runner):
    import base64

    from test_runner_e2e import completion

    narrow = [{"data": base64.b64encode(png_bytes(smooth_image(10000, 2))).decode(), "id": 0}]
    status, body = runner.request("POST", "/completion", completion("look [img-0]", Images=narrow))
    assert status == 400 and b"too narrow" in body, body
    _, done = runner.complete("still here?", options={"num_predict": 2})
    assert done["done"]
