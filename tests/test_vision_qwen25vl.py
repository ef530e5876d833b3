"""Qwen2.5-VL's tower and its text model's multimodal positions against llama.cpp's mtmd (libmtmd,
llama-cpp-python 0.3.36) on synthetic weights, from llama.cpp's mmproj and from Ollama's single file: the
grids mtmd's dyn_size preprocessing picks, the embeddings (bitwise: the same ggml operations on the same
pixels and threads), then prompts with one and two images decoded as mtmd_helper_eval_chunks decodes them
(each image's rows at their 2-D positions, the text after it at p0 + max(rows, columns)): logprobs to 1e-4,
the same greedy tokens. Images are capped at Ollama's 2 << 20 pixels (CAP tokens) where llama.cpp allows 4096
tokens: mtmd runs with image_max_tokens = CAP, which resizes as we do.

The text model's files have RMS epsilon 0, the one the pinned llama.cpp's qwen2vl uses whatever the file says
(see test_qwen2vl). llama.cpp aborts on a Qwen2.5-VL tower without a windowed layer, so every spec has one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from llama_reference import log_softmax
from synthetic.models import write_synthetic
from synthetic.vision_qwen25vl import Qwen25VLSpec, add_vision, write_mmproj
from test_vision import IMAGES, MTMD_JPEG, THREADS, png_bytes, smooth_image
from test_vision_text import chunks_of, run

from ollama_engine.image import decode_image
from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.models import load_model
from ollama_engine.models.vision import load_vision
from ollama_engine.runner.allocate import LoadParams, open_model
from ollama_engine.runner.images import ImageData, ImageEncoder, prompt_inputs
from ollama_engine.runner.positions import rope_positions, text_position

SPEC = Qwen25VLSpec()
CAP = (2 << 20) // (SPEC.patch_size * 2) ** 2  # Ollama's max pixels in whole tokens of 28 x 28 pixels: 2674
TOLERANCE = 1e-4  # on logprobs; F32 weights
STEPS = 6

# sizes that take each of dyn_size's paths (align 28): rounding (50 x 37), scaled up to 8 tokens (5 x 5, 3 x 40),
# down to CAP (2000 x 1500, 3000 x 2000), several attention windows (300 x 200: 11 x 7 merged patches in windows of 4)
SIZES = [(50, 37), (23, 71), (5, 5), (3, 40), (300, 200), (2000, 1500), (3000, 2000), (112, 112)]
TOWER_IMAGES = {
    **{name: IMAGES[name] for name in ("png-wide", "png-tall", "mtmd-jpeg")},
    "png-windows": lambda: decode_image(png_bytes(smooth_image(300, 200, seed=6))),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vision-qwen25vl")
    text = write_synthetic(folder / "text.gguf", "tiny-qwen2vl", weight_type="F32", eps=0.0)
    ollama_text = write_synthetic(folder / "text-ollama.gguf", "tiny-qwen2vl", weight_type="F32", eps=0.0,
                                  layout="ollama")
    out = {"text": text}
    quantized = write_synthetic(folder / "text-ollama-q8.gguf", "tiny-qwen2vl", weight_type="Q8_0", eps=0.0,
                                layout="ollama")
    out["single-Q8_0"] = add_vision(quantized, folder / "single-Q8_0.gguf", SPEC)
    for weight_type in ("F32", "F16"):
        out[f"mmproj-{weight_type}"] = write_mmproj(folder / f"mmproj-{weight_type}.gguf", SPEC,
                                                    weight_type=weight_type)
        out[f"single-{weight_type}"] = add_vision(ollama_text, folder / f"single-{weight_type}.gguf", SPEC,
                                                  weight_type=weight_type)
    return out


def our_tower(path: Path, flash: bool = False):
    tower = load_vision(path, num_threads=THREADS, flash_attention=flash)
    assert tower is not None
    tower.backend.load()
    return tower


def test_both_layouts_load_as_the_qwen25vl_tower(files):
    towers = [load_vision(files[name], allocate=False) for name in ("mmproj-F32", "single-F32")]
    try:
        assert [t.projector for t in towers] == ["qwen2.5vl_merger", "qwen25vl"]
        assert [t.layout for t in towers] == ["mmproj", "ollama"]
        for tower in towers:
            assert (tower.full, tower.window, tower.text_embd) == (frozenset({1, 3}), 4, SPEC.text_embd)
            assert (tower.image_begin, tower.image_end) == ("<|vision_start|>", "<|vision_end|>")
    finally:
        for tower in towers:
            tower.close()


def mtmd_grids(reference, image) -> list[tuple[int, int, int, int]]:
    """mtmd's image chunks of one image: (tokens, rows, columns, positions taken) each."""
    mtmd = reference.mtmd
    chunks = reference._chunks(mtmd.mtmd_default_marker().decode(), [image.pixels])
    try:
        out = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                tokens = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
                out.append((mtmd.mtmd_input_chunk_get_n_tokens(chunk), mtmd.mtmd_image_tokens_get_ny(tokens),
                            mtmd.mtmd_image_tokens_get_nx(tokens), mtmd.mtmd_input_chunk_get_n_pos(chunk)))
        return out
    finally:
        mtmd.mtmd_input_chunks_free(chunks)


@pytest.mark.reference
def test_image_grids_are_mtmds(files):
    """mtmd's image chunk of each size has our tower's grid (dyn_size's target size: rounding, the 8-token
    floor, the CAP-token ceiling) and takes max(rows, columns) text positions, as the runner counts them."""
    from vision_reference import MtmdReference

    reference = MtmdReference(files["text"], files["mmproj-F32"], threads=THREADS, n_ctx=8192, n_batch=512,
                              image_max_tokens=CAP)
    tower = load_vision(files["mmproj-F32"], allocate=False)
    try:
        for width, height in SIZES:
            image = decode_image(png_bytes(smooth_image(width, height)))
            rows, cols = tower.grid(image)
            assert 8 <= rows * cols <= CAP
            run_inputs = prompt_inputs_of(rows, cols)
            assert mtmd_grids(reference, image) == [(rows * cols, rows, cols, text_position(run_inputs))], (
                width, height)
    finally:
        reference.close()
        tower.close()


@pytest.mark.reference
def test_images_over_the_cap_are_resized_down_as_mtmd_capped(files):
    """Both layouts cap images at CAP tokens (Ollama's 2 << 20 pixels); an image over it is resized down, not
    refused: 3000 x 2000 (7597 tokens at its own size, 4056 under llama.cpp's default cap of 4096) becomes
    mtmd's grid with image_max_tokens = CAP (42 x 63 merged patches)."""
    from vision_reference import MtmdReference

    assert CAP == 2674
    towers = [load_vision(files[name], allocate=False) for name in ("mmproj-F32", "single-F32")]
    capped = MtmdReference(files["text"], files["mmproj-F32"], threads=THREADS, n_ctx=8192, image_max_tokens=CAP)
    uncapped = MtmdReference(files["text"], files["mmproj-F32"], threads=THREADS, n_ctx=8192)
    try:
        image = decode_image(png_bytes(smooth_image(3000, 2000)))
        assert image.pixels.shape[:2] == (2000, 3000)
        (llama_default,) = mtmd_grids(uncapped, image)
        assert llama_default[:3] == (4056, 52, 78)  # under llama.cpp's own ceiling of 4096, over ours
        for tower in towers:
            assert tower.max_tokens == CAP
            rows, cols = tower.grid(image)
            assert tower.size(image) == (cols * 28, rows * 28)
            assert (rows, cols) == (42, 63)  # 2646 tokens, the aspect ratio kept
            assert mtmd_grids(capped, image) == [(rows * cols, rows, cols, max(rows, cols))]
    finally:
        capped.close()
        uncapped.close()
        for tower in towers:
            tower.close()


@pytest.mark.reference
def test_ollama_files_max_pixels_sets_the_cap(files, tmp_path):
    """Ollama's file may say vision.max_pixels (its process_image.go reads it): 28 x 28 x 1280 caps images at
    1280 tokens, the grid mtmd picks with image_max_tokens 1280."""
    from gguf import GGUFValueType
    from synthetic.vision import _write
    from vision_reference import MtmdReference

    from ollama_engine.fs.gguf_file import GGUFFile

    source = GGUFFile.open(files["single-F32"])
    arch = source.architecture
    keys: list = [(k, v, *source.value_types[k]) for k, v in source.metadata.items()
                  if k not in ("general.architecture", "general.alignment")]
    keys.append((f"{arch}.vision.max_pixels", 28 * 28 * 1280, GGUFValueType.UINT32, None))
    tensors = [(info.name, info.shape, info.file_type, np.array(source.tensor_data(info.name)))
               for info in source.tensors.values()]
    tower = load_vision(_write(tmp_path / "max-pixels.gguf", arch, keys, tensors), allocate=False)
    reference = MtmdReference(files["text"], files["mmproj-F32"], threads=THREADS, n_ctx=4096, image_max_tokens=1280)
    try:
        assert tower.max_tokens == 1280
        image = decode_image(png_bytes(smooth_image(3000, 2000)))
        rows, cols = tower.grid(image)
        assert rows * cols <= 1280
        assert mtmd_grids(reference, image) == [(rows * cols, rows, cols, max(rows, cols))]
    finally:
        reference.close()
        tower.close()


@pytest.mark.parametrize("flash", [False, True], ids=["plain", "flash"])
def test_reserved_image_graph_is_bounded_by_the_cap(files, flash):
    """The memory report's VisionGraph is the graph of a CAP-token image (10 696 patches), not of llama.cpp's
    4096 tokens (16 384 patches): on this 2-head tower 1 398 202 624 bytes instead of 3 260 055 552 (flash:
    711 776 128 instead of 1 649 442 816). It covers the largest image there is (3000 x 2000 resized to the
    cap), and is under half the 4096-token graph."""
    loaded = open_model(str(files["single-F32"]), LoadParams(batch_size=64, kv_size=256, num_threads=THREADS,
                                                             flash_attention=int(flash)), allocate=False)
    try:
        tower = loaded.images.tower
        reserved = loaded.memory.cpu.vision_graph
        assert reserved == max(loaded.image_graph.values()) > 0
        assert reserved < (0.8 if flash else 1.5) * 2**30

        def graph_of(height: int, width: int) -> int:
            with tower.compute_backend.reserving() as needs:
                ctx, _, out = tower._graph_for((3, height, width))
                ctx.reserve(out)
            return max(needs.values())

        width, height = tower.size(decode_image(png_bytes(smooth_image(3000, 2000))))
        assert graph_of(height, width) <= reserved
        assert 2 * reserved < graph_of(64 * 28, 64 * 28)  # llama.cpp's 4096-token worst case
    finally:
        loaded.close()


def prompt_inputs_of(rows: int, cols: int):
    from ollama_engine.runner.images import image_run

    return image_run(np.zeros((rows, cols, 1), dtype=np.float32), digest=0, batch_size=64)


@pytest.mark.reference
@pytest.mark.parametrize("flash", [False, True], ids=["plain", "flash"])
@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_tower_matches_mtmd(files, weight_type, flash):
    """Embeddings of PNGs (one window and several) and of mtmd's own JPEG equal mtmd_encode_chunk's bitwise,
    from the mmproj and from Ollama's single file (given the same pixels)."""
    from vision_reference import MtmdReference

    if MTMD_JPEG is None:
        pytest.skip("llama.cpp's source (tools/mtmd/test-1.jpeg) is not under build/src")
    reference = MtmdReference(files["text"], files[f"mmproj-{weight_type}"], flash_attention=flash, threads=THREADS,
                              image_max_tokens=CAP)
    towers = [our_tower(files[f"{layout}-{weight_type}"], flash) for layout in ("mmproj", "single")]
    try:
        for name, make in TOWER_IMAGES.items():
            image = make()
            expected = reference.encode(image.pixels)
            rows, cols = towers[0].grid(image)
            assert expected.shape == (rows * cols, SPEC.text_embd), name
            for tower in towers:
                (got,) = tower.encode_chunks(image)
                assert got.shape == (rows, cols, SPEC.text_embd), name
                got = got.reshape(expected.shape)
                assert np.array_equal(got, expected), (name, tower.layout, float(np.abs(got - expected).max()))
    finally:
        reference.close()
        for tower in towers:
            tower.close()


@pytest.mark.reference
@pytest.mark.parametrize("layout", ["single", "mmproj"])
@pytest.mark.parametrize("names", [("png-windows",), ("png-tall", "mtmd-jpeg")], ids=["one-image", "two-images"])
def test_prompt_with_images_matches_mtmd(files, names, layout):
    """Ollama's wire ([img-N] tags) through the runner's prompt_inputs gives mtmd's chunks; decoded chunk by
    chunk with the runner's positions (runner/positions.py: the image's rows over its grid, the text after
    it at p0 + max(rows, columns)), the logprobs and greedy tokens are llama.cpp's."""
    from vision_reference import MtmdReference

    if MTMD_JPEG is None and "mtmd-jpeg" in names:
        pytest.skip("llama.cpp's source (tools/mtmd/test-1.jpeg) is not under build/src")
    images = [IMAGES[name]() if name in IMAGES else TOWER_IMAGES[name]() for name in names]
    encoded = [png_bytes(image.pixels) for image in images]  # lossless: the same pixels again
    reference = MtmdReference(files["text"], files["mmproj-F32"], threads=THREADS, n_ctx=2048, n_batch=1024,
                              image_max_tokens=CAP)
    text_file = files["single-F32"] if layout == "single" else files["text"]
    model = load_model(text_file, num_threads=THREADS)
    model.backend.load()
    model.cache.init(model.backend, cache_dtype("f16"), 1, 2048, 1024)
    tower = our_tower(files[f"{layout}-F32"])
    encoder = ImageEncoder(tower)
    try:
        marker = reference.mtmd.mtmd_default_marker().decode()
        words = ["Look at ", " and at ", ". What do you see?"]
        theirs, their_next, expected = reference.eval_prompt(
            words[0] + words[1].join(marker for _ in images) + words[-1], [image.pixels for image in images])
        ours_prompt = words[0] + words[1].join(f"[img-{i}]" for i in range(len(images))) + words[-1]
        inputs = prompt_inputs(ours_prompt, [ImageData(i, data) for i, data in enumerate(encoded)],
                               model.tokenizer, encoder)
        chunks = chunks_of(inputs)
        assert [(k, v if k == "text" else len(v)) for k, v in chunks] == expected
        assert text_position(inputs) == their_next  # mtmd's n_past after the prompt
        ours, done = None, 0
        for index, (kind, value) in enumerate(chunks):
            n, last = len(value), index == len(chunks) - 1
            extra = {"embeddings": ((0, value),)} if kind == "image" else {}
            batch = Batch(positions=range(done, done + n), sequences=[0] * n, outputs=[n - 1] if last else [],
                          tokens=value if kind == "text" else [0] * n,
                          rope_positions=rope_positions(text_position(inputs[:done]), inputs[done : done + n]),
                          **extra)
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
            theirs = reference.decode_token(token, their_next + step)
            p = text_position(inputs) + step  # a text row after the prompt: p, p, p, 0
            ours = run(model, Batch(positions=[done], sequences=[0], outputs=[0], tokens=[token],
                                    rope_positions=[[p], [p], [p], [0]]))
            done += 1
        print(f"{layout}, {len(images)} image(s): largest logprob difference from llama.cpp {worst:.3g}")
    finally:
        reference.close()
        tower.close()
        model.close()


# ------------------------------------------------------------ through the runner subprocess (Ollama's wire)


def start(path: Path):
    from test_runner_e2e import LOAD, Client, free_port, start_runner

    port = free_port()
    proc = start_runner(path, port)
    client = Client(port)
    try:
        client.loads = []
        for operation in (0, 1, 2):  # fit, alloc, commit
            client.loads.append(client.json("POST", "/load", {**LOAD, "Operation": operation, "Parallel": 2,
                                                              "KvSize": 2048, "BatchSize": 64}))
            assert client.loads[-1]["Success"]
        while client.json("GET", "/health")["status"] != 0:
            pass
        yield client
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def runner(files):
    yield from start(files["single-F32"])


@pytest.fixture(scope="module")
def quantized_runner(files):
    """Q8_0 text weights: ggml's F32 matmuls round a batch of two rows differently from one row (a decode step
    batched with another sequence), quantized ones do not (as test_batch_invariance)."""
    yield from start(files["single-Q8_0"])


@pytest.mark.reference
@pytest.mark.parametrize("names", [("png-windows",), ("png-tall", "png-wide")], ids=["one-image", "two-images"])
def test_runner_answers_about_images_as_llama_cpp(runner, files, names):
    """Ollama's /completion with [img-N] and ImageData on the single file: llama.cpp's greedy answer (mtmd on
    the mmproj, n_batch 64 as the runner's BatchSize: the 77-row image is decoded in views of 64 rows by
    both), so the batch loop gives image rows and the text after them their multimodal positions; a second
    request takes the image from the cache; fit == alloc == commit."""
    import base64

    from vision_reference import MtmdReference

    from ollama_engine.fs.gguf_file import GGUFFile
    from ollama_engine.tokenizer import from_metadata

    images = [IMAGES[name]() if name in IMAGES else TOWER_IMAGES[name]() for name in names]
    reference = MtmdReference(files["text"], files["mmproj-F32"], threads=THREADS, n_ctx=1024, n_batch=64,
                              image_max_tokens=CAP)
    prompt = "Look at " + " and ".join("{}" for _ in images) + ". What do you see?"
    try:
        marker = reference.mtmd.mtmd_default_marker().decode()
        logits, position, _ = reference.eval_prompt(prompt.format(*[marker] * len(images)),
                                                    [image.pixels for image in images])
        tokenizer = from_metadata(GGUFFile.open(files["text"]).metadata)
        tokens = []
        while len(tokens) < 8 and not tokenizer.is_eog(token := int(logits.argmax())):
            tokens.append(token)
            logits = reference.decode_token(token, position)
            position += 1
    finally:
        reference.close()
    attached = [{"data": base64.b64encode(png_bytes(image.pixels)).decode(), "id": i} for i, image in enumerate(images)]
    greedy = {"temperature": 0, "num_predict": 8}
    ours_prompt = prompt.format(*[f"[img-{i}]" for i in range(len(images))])
    text, first = runner.complete(ours_prompt, options=greedy, Images=attached)
    assert tokens and text == b"".join(tokenizer.token_piece(t) for t in tokens).decode()
    assert first["image_count"] == first["image_encode_count"] == len(images)
    again, second = runner.complete(ours_prompt, options=greedy, Images=attached)
    assert again == text and second["image_encode_count"] == 0
    fit, alloc, commit = (load["Memory"] for load in runner.loads)
    assert fit == alloc == commit


@pytest.mark.parametrize("other", ["text", "image"])
def test_batched_with_images_equals_solo(quantized_runner, other):
    """A prompt with an image decoded together with another (text only, or another image) in one batch loop:
    each gets the tokens and logprobs it gets alone, bit for bit (the image's rows and the text after it keep
    their multimodal positions in a shared batch); so does a request resumed from the prompt cache, which
    never resumes inside an image (the exact cache's resume point fell inside one: the rows after it were
    decoded as text placeholders)."""
    import base64
    import json
    from concurrent.futures import ThreadPoolExecutor

    from test_runner_e2e import completion

    def attach(name: str) -> list[dict]:
        image = IMAGES[name]() if name in IMAGES else TOWER_IMAGES[name]()
        return [{"data": base64.b64encode(png_bytes(image.pixels)).decode(), "id": 0}]

    second = ("Tell me a story about a cat", []) if other == "text" else ("And [img-0]?", attach("png-tall"))
    requests = [("Tell me about [img-0] now", attach("png-windows")), second]

    def run(prompt: str, attached: list[dict]) -> list[tuple[str, float]]:
        status, data = quantized_runner.request("POST", "/completion", completion(
            prompt, options={"temperature": 0, "num_predict": 10}, Images=attached, Logprobs=True))
        assert status == 200, data
        lines = [json.loads(line) for line in data.splitlines()]
        assert lines[-1]["done"]
        return [(entry["token"], entry["logprob"]) for line in lines for entry in line.get("logprobs") or []]

    solo = [run(*request) for request in requests]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda request: run(*request), requests))
    assert all(len(result) == 10 for result in solo)
    assert [run(*request) for request in requests] == solo  # alone again, resumed from the prompt cache
    for alone, batched in zip(solo, together, strict=True):
        assert [token for token, _ in batched] == [token for token, _ in alone]
        gap = max(abs(a - b) for (_, a), (_, b) in zip(alone, batched, strict=True))
        assert gap == 0.0


# ------------------------------------------------------------ through serve, with the official clients


@pytest.fixture(scope="module")
def served(files, tmp_path_factory):
    import ollama
    from serve_process import serve_process

    folder = tmp_path_factory.mktemp("vision-qwen25vl-serve")
    with serve_process(folder) as url:
        client = ollama.Client(host=url)
        single = files["single-F32"]
        assert client.create(model="qwen-single", files={single.name: client.create_blob(single)}).status == "success"
        split = {path.name: client.create_blob(path) for path in (files["text"], files["mmproj-F32"])}
        assert client.create(model="qwen-split", files=split).status == "success"
        yield url


def test_official_clients_send_images(served):
    """ollama's generate and chat with images, openai's image_url data URL: answers, the image's 77 rows counted
    in the prompt; llama.cpp's layout (text + mmproj, one model) answers as Ollama's single file."""
    import base64

    import ollama
    import openai

    image = png_bytes(TOWER_IMAGES["png-windows"]().pixels)  # 11 x 7 merged patches
    greedy = {"temperature": 0, "num_predict": 6}
    client = ollama.Client(host=served)
    assert "vision" in client.show("qwen-single").capabilities
    answers = {}
    for model in ("qwen-single", "qwen-split"):
        generated = client.generate(model=model, prompt="What is this?", images=[image], options=greedy)
        plain = client.generate(model=model, prompt="What is this?", options=greedy)
        assert generated.done and generated.response
        assert generated.prompt_eval_count >= plain.prompt_eval_count + 77
        answers[model] = generated.response
    assert answers["qwen-single"] == answers["qwen-split"]
    chat = client.chat(model="qwen-single", options=greedy,
                       messages=[{"role": "user", "content": "What is this?", "images": [image]}])
    assert chat.done and chat.message.content and chat.prompt_eval_count > 77
    openai_client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused")
    data_url = "data:image/png;base64," + base64.b64encode(image).decode()
    answer = openai_client.chat.completions.create(model="qwen-single", max_tokens=6, temperature=0, messages=[{
        "role": "user", "content": [{"type": "text", "text": "What is this?"},
                                    {"type": "image_url", "image_url": {"url": data_url}}]}])
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > 77
