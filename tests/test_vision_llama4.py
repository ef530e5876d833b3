"""Llama 4's vision tower against llama.cpp's mtmd on synthetic weights, in llama.cpp's mmproj layout and in
Ollama's single file: tiles as mtmd cuts them, each tile's and the thumbnail's embeddings bitwise equal to
mtmd_encode_chunk's (F32 and F16 weights, flash attention on and off); then prompts with one and two images
through the runner subprocess against mtmd_helper_eval_chunks, with a batch larger than the image's chunks
and one smaller than a tile (each chunk decoded in pieces: the embeddings' views).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from synthetic.models import write_synthetic
from synthetic.vision_llama4 import Llama4VisionSpec, add_llama4_vision, write_llama4_mmproj
from test_vision import IMAGES, MTMD_JPEG, THREADS, png_bytes, smooth_image
from test_vision_views import compare_with_mtmd, start_loaded_runner

from ollama_engine.image import decode_image
from ollama_engine.image.llama4 import best_resolution, tile_count, tiles
from ollama_engine.models.vision import load_vision

SPEC = Llama4VisionSpec()  # 32-pixel tiles of 8 x 8 patches, shuffled to 16 rows each
ROWS = 16

LLAMA4_IMAGES = {
    "png-small": lambda: decode_image(png_bytes(smooth_image(20, 30, seed=5))),  # the thumbnail alone
    **IMAGES,  # 50 x 37, 23 x 71, 300 x 200, mtmd's 640 x 488 JPEG: 2 to 9 tiles and the thumbnail
}


def test_tiles_pick_the_grid_that_keeps_most_of_the_image():
    assert best_resolution(50, 37, 32) == (64, 64)  # 2 x 2 keeps all 1850 pixels; 2 x 1 (64 x 32) would not
    assert best_resolution(300, 200, 32) == (96, 64)  # nothing keeps it all: the 3 x 2 keeps most, wastes least
    assert best_resolution(40, 33, 32) == (64, 64)  # all kept by 2 x 2 and by larger grids: the least waste
    square = smooth_image(32, 32)
    assert len(tiles(square, 32)) == 1 and np.array_equal(tiles(square, 32)[0], square)
    out = tiles(smooth_image(50, 37, seed=1), 32)
    assert len(out) == 5 and all(tile.shape == (32, 32, 3) for tile in out)
    # the 2 x 2 grid holds the image fitted keeping its aspect ratio: 64 x 48 (rounded up), centred, black above
    grid = np.concatenate([np.concatenate(out[0:2], axis=1), np.concatenate(out[2:4], axis=1)], axis=0)
    assert not grid[:8].any() and not grid[56:].any() and grid[8:56].any()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vision-llama4")
    text = write_synthetic(folder / "text.gguf", "tiny-llama4", weight_type="F32")
    out = {"text": text}
    for weight_type in ("F32", "F16"):
        out[f"mmproj-{weight_type}"] = write_llama4_mmproj(folder / f"mmproj-{weight_type}.gguf", SPEC,
                                                           weight_type=weight_type)
        out[f"single-{weight_type}"] = add_llama4_vision(text, folder / f"single-{weight_type}.gguf", SPEC,
                                                         weight_type=weight_type)
    return out


def mtmd_chunks(reference, rgb: np.ndarray) -> list[np.ndarray]:
    """mtmd_encode_chunk's embeddings of each image chunk mtmd makes of one image, in its order."""
    mtmd = reference.mtmd
    chunks = reference._chunks(mtmd.mtmd_default_marker().decode(), [rgb])
    out = []
    try:
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                continue
            if mtmd.mtmd_encode_chunk(reference.vctx, chunk) != 0:
                raise RuntimeError("mtmd_encode_chunk failed")
            n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            pointer = ctypes.cast(mtmd.mtmd_get_output_embd(reference.vctx), ctypes.POINTER(ctypes.c_float))
            out.append(np.ctypeslib.as_array(pointer, shape=(n, reference.n_embd)).copy())
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
    return out


@pytest.mark.reference
@pytest.mark.parametrize("flash", [False, True], ids=["plain", "flash"])
@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_llama4_tower_matches_mtmd(files, weight_type, flash):
    """Every tile's and the thumbnail's embeddings equal mtmd_encode_chunk's bitwise, in mtmd's order, from the
    mmproj file and from Ollama's single file (the same pixels: decoding is compared in test_vision)."""
    from vision_reference import MtmdReference

    if MTMD_JPEG is None:
        pytest.skip("llama.cpp's source (tools/mtmd/test-1.jpeg) is not under build/src")
    reference = MtmdReference(files["text"], files[f"mmproj-{weight_type}"], flash_attention=flash, threads=THREADS)
    towers = []
    try:
        for layout in ("mmproj", "single"):
            tower = load_vision(files[f"{layout}-{weight_type}"], num_threads=THREADS, flash_attention=flash)
            assert tower is not None
            towers.append(tower)
            tower.backend.load()
        assert [t.layout for t in towers] == ["mmproj", "ollama"]
        for name, make in LLAMA4_IMAGES.items():
            image = make()
            expected = mtmd_chunks(reference, image.pixels)
            counted = tile_count(image.width, image.height, SPEC.image_size)
            assert len(expected) == len(tiles(image.pixels, SPEC.image_size)) == counted, name
            assert all(chunk.shape == (ROWS, SPEC.text_embd) for chunk in expected)
            for tower in towers:
                got = tower.encode_chunks(image)
                assert tower.tokens(image) == ROWS * len(expected)
                assert len(got) == len(expected), (name, tower.layout)
                for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
                    assert np.array_equal(ours, theirs), (name, tower.layout, i, float(np.abs(ours - theirs).max()))
    finally:
        reference.close()
        for tower in towers:
            tower.close()


@pytest.mark.reference
@pytest.mark.parametrize(("layout", "n_batch"), [("single", 512), ("mmproj", 10)])
def test_prompt_with_images_through_the_runner_is_mtmds(files, layout, n_batch):
    """Ollama's wire through the runner: <|image_start|>, each tile's chunk, the thumbnail's, <|image_end|>, each
    chunk decoded in batches of its own (of at most n_batch rows: 10 cuts every 16-row chunk in two views),
    causally; greedy tokens equal llama.cpp's and logprobs within 1e-4, with one image and with two."""
    if MTMD_JPEG is None:
        pytest.skip("llama.cpp's source (tools/mtmd/test-1.jpeg) is not under build/src")
    model, projector = ((files["single-F32"], None) if layout == "single" else (files["text"], files["mmproj-F32"]))
    cases = [("Look at [img-0]. What do you see?", [png_bytes(IMAGES["png-wide"]().pixels)]),
             ("Compare [img-0] with [img-1], please.",
              [png_bytes(IMAGES["png-tall"]().pixels), png_bytes(IMAGES["mtmd-jpeg"]().pixels)])]
    proc, client = start_loaded_runner(model, n_batch, projector)
    try:
        for prompt, encoded in cases:
            worst = compare_with_mtmd(client, files["text"], files["mmproj-F32"], prompt, encoded, n_batch)
            print(f"{layout}, n_batch {n_batch}, {len(encoded)} image(s): largest logprob difference {worst:.3g}")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.reference
def test_serve_answers_about_an_image_with_the_official_client(files, tmp_path):
    """A real serve, the official ollama client: Llama 4 made from the single file and from the text GGUF plus
    its mmproj (two files of one model), `vision` in /api/show, and a raw prompt with an image answered with
    llama.cpp's greedy text."""
    import ollama
    from serve_process import serve_process
    from test_vision_views import mtmd_answer

    from ollama_engine.fs.gguf_file import GGUFFile
    from ollama_engine.tokenizer import from_metadata

    image = IMAGES["png-wide"]()
    prompt = "Look at [img-0]. What do you see?"
    tokenizer = from_metadata(GGUFFile.open(files["text"]).metadata)
    tokens = []
    for token, _ in mtmd_answer(files["text"], files["mmproj-F32"], prompt, [image.pixels], 512, steps=6):
        if tokenizer.is_eog(token):
            break
        tokens.append(token)
    expected = b"".join(tokenizer.token_piece(t) for t in tokens).decode(errors="replace")
    (tmp_path / "models").mkdir()
    with serve_process(tmp_path / "models") as url:
        client = ollama.Client(host=url)
        made = {"scout": [files["single-F32"]], "scout-split": [files["text"], files["mmproj-F32"]]}
        for name, paths in made.items():
            blobs = {path.name: client.create_blob(path) for path in paths}
            assert client.create(model=name, files=blobs).status == "success"
            assert "vision" in client.show(name).capabilities
            answer = client.generate(model=name, prompt=prompt, raw=True, images=[png_bytes(image.pixels)],
                                     options={"temperature": 0, "num_predict": 6})
            assert answer.done and answer.response == expected, (name, answer.response, expected)
            assert answer.prompt_eval_count >= ROWS * 5  # four tiles and the thumbnail
