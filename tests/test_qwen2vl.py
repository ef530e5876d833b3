"""qwen2vl (Qwen2-VL and Qwen2.5-VL's text model): multimodal RoPE against llama.cpp, on text and on rows
given as embeddings with their own positions (an image's, laid out as llama.cpp's mtmd lays them out).

The tiny-qwen2vl preset: tiny-qwen2's shapes (2 layers, 4 heads of 16, 2 KV heads, biases on q, k, v) with
rope.dimension_sections 2, 3, 3, 0 over its 8 rotated pairs.

The pinned llama.cpp's qwen2vl loader reads no attention.layer_norm_rms_epsilon (its load_arch_hparams reads
only the sections; qwen2's reads the epsilon), so its RMS norms run with epsilon 0 on every file. We use the
file's (Qwen2.5-VL's 1e-6, as Hugging Face and Ollama do): the comparisons with llama.cpp run on files whose
epsilon is 0, where both agree; test_the_files_epsilon_is_used shows the difference is only that.
"""

from __future__ import annotations

import numpy as np
import pytest
from decoding import greedy
from llama_reference import compare_schedule
from recurrent_checks import prompt_logprob_gap

from ollama_engine.models import ModelError, load_model
from ollama_engine.models.qwen2vl import Qwen2VL

TOLERANCE = 1e-4  # on logprobs, as test_architectures


@pytest.fixture(scope="module")
def synthetic(synthetic_model):
    """synthetic(weight_type="F32", **options) -> the tiny-qwen2vl GGUF."""
    return lambda weight_type="F32", **options: synthetic_model("qwen2vl", weight_type, **options)


@pytest.fixture(scope="module")
def comparable(synthetic):
    """The tiny-qwen2vl GGUF with RMS epsilon 0, the one llama.cpp's qwen2vl uses whatever the file says."""
    return lambda weight_type="F32", **options: synthetic(weight_type, eps=0.0, **options)


def test_loads_with_its_sections(synthetic):
    model = load_model(synthetic(), allocate=False)
    try:
        assert isinstance(model, Qwen2VL) and model.sections == [2, 3, 3, 0]
        assert model.position_components == 4
    finally:
        model.close()


@pytest.mark.parametrize(("sections", "message"), [
    ((0, 0, 0, 0), "1 to 8 in all"), ((4, 4, 4, 0), "1 to 8 in all"), ((2, -1, 3, 0), "non-negative"),
    ((1, 1, 1, 1, 1), "up to 4"),
])
def test_bad_sections_are_refused_before_ggml(synthetic, sections, message):
    """ggml divides by the sections' sum: a file whose sum is 0 must fail at load, not fault in RoPE."""
    with pytest.raises(ModelError, match=message):
        load_model(synthetic(rope_sections=sections), allocate=False)


@pytest.mark.reference
def test_prompt_logits_match(comparable):
    """Every row of a prompt, F32: text tokens rotated by p, p, p, 0 as llama.cpp rotates them."""
    assert prompt_logprob_gap(comparable()) < TOLERANCE


@pytest.mark.reference
def test_the_files_epsilon_is_used(synthetic):
    """On a file with epsilon 1e-6 we differ from llama.cpp (which uses 0), by little: the gap above is then
    the epsilon's alone."""
    assert 1e-5 < prompt_logprob_gap(synthetic()) < 0.05


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), [
    ("F32", 1, False), ("F16", 1, True), ("Q8_0", 2, False), ("Q8_0", 2, True), ("Q4_0", 2, False)])
def test_greedy_decoding_matches(comparable, weight_type, sequences, flash):
    assert compare_schedule(comparable(weight_type), flash=flash, cache_type="f16", sequences=sequences,
                            steps=8, tolerance=TOLERANCE) < TOLERANCE


def test_ollamas_file_computes_what_llama_cpps_does(synthetic):
    """Ollama's qwen25vl file (its architecture name, 3 sections under rope.mrope_section): the same logits."""
    ollama = synthetic(layout="ollama")
    model = load_model(ollama, allocate=False)
    try:
        assert model.config.architecture() == "qwen25vl" and model.sections == [2, 3, 3, 0]
    finally:
        model.close()
    prompts = ("In a small village by the sea, there lived",)
    ours, theirs = greedy(ollama, prompts, [0], 6, False)[0], greedy(synthetic(), prompts, [0], 6, False)[0]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")


def embedding_batch(lib, rows: np.ndarray, positions: np.ndarray, seq: int = 0):
    """A llama_batch of embedding rows with 4 position components each (component-major), as mtmd's
    decode_embd_batch builds one; the arrays it points to are returned with it to keep them alive."""
    import ctypes

    n = len(rows)
    embd = np.ascontiguousarray(rows, dtype=np.float32)
    pos = np.ascontiguousarray(positions.reshape(-1), dtype=np.int32)
    n_seq_id = np.ones(n, dtype=np.int32)
    seq_ids = [np.array([seq], dtype=np.int32) for _ in range(n)]
    pointer = ctypes.POINTER(ctypes.c_int32)
    seq_ptrs = (pointer * n)(*[s.ctypes.data_as(pointer) for s in seq_ids])
    logits = np.zeros(n, dtype=np.int8)
    logits[-1] = 1
    batch = lib.llama_batch()
    batch.n_tokens = n
    batch.token = ctypes.POINTER(ctypes.c_int32)()
    batch.embd = embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    batch.pos = pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    batch.n_seq_id = n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    batch.seq_id = ctypes.cast(seq_ptrs, type(batch.seq_id))
    batch.logits = logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
    return batch, (embd, pos, n_seq_id, seq_ids, seq_ptrs, logits)


def mtmd_layout(p0: int, rows: int, cols: int) -> np.ndarray:
    """(4, rows * cols): llama.cpp's mtmd_image_tokens_get_decoder_pos for MTMD_POS_TYPE_MROPE, written out
    from its source (t = p0, x = p0 + i % cols, y = p0 + i / cols, z = 0) in mtmd-helper's order t, y, x, z."""
    i = np.arange(rows * cols)
    return np.stack([np.full_like(i, p0), p0 + i // cols, p0 + i % cols, np.zeros_like(i)]).astype(np.int32)


@pytest.mark.reference
@pytest.mark.parametrize(("grids", "batch_size"), [([(3, 4)], None), ([(3, 4), (5, 2)], None), ([(5, 3)], 6)])
def test_image_rows_with_their_positions_match_llama_cpp(comparable, grids, batch_size):
    """Text, then grids of embedding rows (an image's, random here) with the runner's positions, then text and
    greedy decode steps: the logits equal llama.cpp's fed mtmd's positions, batch for batch (an image's rows
    in views of batch_size, as mtmd decodes them in n_batch pieces); the text after an image starts at
    p0 + max(rows, cols), llama.cpp's mtmd_image_tokens_get_n_pos."""
    from llama_reference import Reference, log_softmax

    from ollama_engine.kvcache import Batch, cache_dtype
    from ollama_engine.runner.images import image_run
    from ollama_engine.runner.inputs import Input
    from ollama_engine.runner.positions import rope_positions, text_position

    path = comparable()
    model = load_model(path, num_threads=2)
    reference = Reference(path, n_ctx=512, n_batch=64)
    rng = np.random.default_rng(7)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 1, 512, 64)
        lib = reference.lib
        history: list[Input] = []
        their_pos = 0  # llama.cpp's next text position

        def ours(inputs: list[Input], tokens: list[int]) -> np.ndarray:
            start = text_position(history)
            rope = rope_positions(start, inputs)
            first = len(history)
            n = len(inputs)
            embedded = tuple((row, inp.multimodal) for row, inp in enumerate(inputs) if inp.multimodal is not None)
            batch = Batch(positions=range(first, first + n), sequences=[0] * n, outputs=[n - 1],
                          tokens=tokens, embeddings=embedded, rope_positions=rope)
            history.extend(inputs)
            return model.graphs.compute(batch)[0]

        def text(tokens: list[int]) -> int:
            """The tokens at the next positions in both; the greedy token after them."""
            nonlocal their_pos
            mine = ours([Input(token=t) for t in tokens], tokens)
            theirs = reference.decode(tokens, range(their_pos, their_pos + len(tokens)), [0] * len(tokens),
                                      [len(tokens) - 1])[0]
            their_pos += len(tokens)
            compare(mine, theirs)
            return int(mine.argmax())

        def compare(mine: np.ndarray, theirs: np.ndarray) -> None:
            gap = float(np.abs(log_softmax(mine) - log_softmax(theirs)).max())
            assert gap < TOLERANCE and mine.argmax() == theirs.argmax(), gap

        prompt = model.tokenizer.encode("Describe the picture", add_special=True)
        text(prompt)
        for rows, cols in grids:
            grid = rng.standard_normal((rows, cols, model.options.hidden)).astype(np.float32)
            run = image_run(grid, digest=1, batch_size=batch_size)
            layout = mtmd_layout(their_pos, rows, cols)
            flat = grid.reshape(rows * cols, -1)
            done = 0
            while done < len(run):
                n = run[done].same_batch + 1
                mine = ours(run[done : done + n], [0] * n)
                batch, keep = embedding_batch(lib, flat[done : done + n], layout[:, done : done + n])
                assert lib.llama_decode(reference.ctx, batch) == 0
                theirs = np.ctypeslib.as_array(lib.llama_get_logits_ith(reference.ctx, n - 1),
                                               shape=(reference.vocab_size,)).copy()
                compare(mine, theirs)
                done += n
            their_pos += max(rows, cols)
            token = text(model.tokenizer.encode(" and then", add_special=False))
        assert text_position(history) == their_pos
        for _ in range(6):  # greedy decoding after the images
            token = text([token])
    finally:
        reference.close()
        model.close()
