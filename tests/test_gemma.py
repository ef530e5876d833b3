"""Gemma 2 and Gemma 3 against llama.cpp: synthetic models, and the real Gemma 3 270M (Q4_K_M).

The synthetic presets have an 8-position sliding window and (Gemma 2) small softcaps, so that short
prompts cross the window and the caps change the result. The real model's window is 512 positions:
one test feeds a longer prompt. Each comparison gives both engines the same batches (one KV stream per
sequence in llama.cpp, as our cache has) and checks every logprob and every greedy token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from llama_reference import PROMPTS, Reference, compare_schedule, log_softmax

from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.models import load_model

pytestmark = pytest.mark.reference

# Random weights give sharp logits that magnify last-bit differences (see test_kv_cache_types.py)
SYNTHETIC_TOLERANCE = 2e-3
REAL_TOLERANCE = 1e-4  # on logprobs, as for SmolLM2
THREADS = 2


@pytest.mark.parametrize("sequences", [1, 2], ids=["alone", "batched"])
@pytest.mark.parametrize(("arch", "weight_type"), [("gemma2", "F16"), ("gemma2", "Q8_0"), ("gemma3", "F16"),
                                                   ("gemma3", "Q4_0")])
def test_synthetic_matches_llama_cpp(synthetic_model, arch, weight_type, sequences):
    """Prompts of ~11 tokens and 12 decoded ones: past the 8-position window of the sliding layers."""
    compare_schedule(synthetic_model(arch, weight_type), flash=False, cache_type="f16", sequences=sequences, steps=12,
                     tolerance=SYNTHETIC_TOLERANCE, threads=THREADS)


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_synthetic_flash_attention_matches_llama_cpp(synthetic_model, arch, cache_type):
    """ggml's fused kernel applies Gemma 2's attention softcap itself."""
    compare_schedule(synthetic_model(arch, "F16"), flash=True, cache_type=cache_type, sequences=2, steps=12,
                     tolerance=SYNTHETIC_TOLERANCE, threads=THREADS)


def encode(path: Path, text: str) -> list[int]:
    model = load_model(path, allocate=False)
    try:
        return model.tokenizer.encode(text, add_special=True)
    finally:
        model.close()


def shift_then_decode(path: Path, tokens: list[int], keep: int, discard: int, steps: int, tolerance: float,
                      flash: bool = False) -> None:
    """Prefill, drop positions [keep, keep + discard) and move the rest down in both engines, then decode."""
    model = load_model(path, num_threads=THREADS, flash_attention=flash)
    model.backend.load()
    model.cache.init(model.backend, cache_dtype("f16"), 1, 512, 64)
    reference = Reference(path, n_ctx=512, n_batch=64, threads=THREADS, flash_attention=flash)
    try:
        n = len(tokens)
        ours = model.graphs.compute(Batch(positions=range(n), sequences=[0] * n, outputs=[n - 1], tokens=tokens))
        theirs = reference.decode(tokens, range(n), [0] * n, [n - 1])
        model.cache.remove(0, keep, keep + discard)
        memory = reference.lib.llama_get_memory(reference.ctx)
        assert reference.lib.llama_memory_seq_rm(memory, 0, keep, keep + discard)
        reference.lib.llama_memory_seq_add(memory, 0, keep + discard, -1, -discard)
        position = n - discard
        for step in range(steps):
            difference = float(np.abs(log_softmax(ours) - log_softmax(theirs)).max())
            assert difference < tolerance, f"step {step}: logprobs differ by {difference}"
            token = int(theirs[0].argmax())
            assert int(ours[0].argmax()) == token, f"step {step}: greedy tokens differ"
            ours = model.graphs.compute(Batch(positions=[position], sequences=[0], outputs=[0], tokens=[token]))
            theirs = reference.decode([token], [position], [0], [0])
            position += 1
    finally:
        reference.close()
        model.close()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_synthetic_context_shift_matches_llama_cpp(synthetic_model, arch):
    """Keys are re-rotated with their layer's RoPE base (sliding and global layers differ in Gemma 3)."""
    path = synthetic_model(arch, "F16")
    tokens = encode(path, "In a small village by the sea, there lived a fisherman who had three sons")
    shift_then_decode(path, tokens, keep=3, discard=5, steps=8, tolerance=SYNTHETIC_TOLERANCE)


# ---------------------------------------------------------------- the real Gemma 3 270M


def test_real_gemma3_tokenizer_and_end_of_generation(gemma3_path):
    """Gemma's own SPM vocabulary tokenizes as llama.cpp's, and <end_of_turn> ends generation."""
    import llama_cpp

    model = load_model(gemma3_path, allocate=False)
    llm = llama_cpp.Llama(model_path=str(gemma3_path), vocab_only=True, verbose=False)
    try:
        tokenizer = model.tokenizer
        chat = "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
        for text in (chat, "Hello  world!\n\tÜber 1234 naïve café 😀", " leading space"):
            assert tokenizer.encode(text, add_special=True) == llm.tokenize(text.encode(), add_bos=True, special=True)
        end_of_turn = tokenizer.encode("<end_of_turn>", add_special=False)
        assert end_of_turn == [106]
        assert tokenizer.is_eog(106) and tokenizer.is_eog(llm.token_eos())
        assert not tokenizer.is_eog(tokenizer.encode("<start_of_turn>", add_special=False)[0])
    finally:
        llm.close()
        model.close()


@pytest.mark.parametrize(("sequences", "flash"), [(1, False), (2, True)], ids=["alone", "batched-flash"])
def test_real_gemma3_matches_llama_cpp(gemma3_path, sequences, flash):
    """Bitwise equal, alone and batched. Batched runs use flash attention: llama.cpp's matmul path splits
    the two prompts into other ubatches than one alone would, and on this model its own batched logprobs
    differ from its solo ones by up to 0.77 (ours do not: see test_real_gemma3_batched_equals_alone)."""
    compare_schedule(gemma3_path, flash=flash, cache_type="f16", sequences=sequences, steps=4,
                     tolerance=REAL_TOLERANCE, threads=THREADS)


def test_real_gemma3_batched_equals_alone(gemma3_path):
    """Our matmul path: two sequences batched give the logprobs each gives alone, bitwise."""
    model = load_model(gemma3_path, num_threads=THREADS)
    model.backend.load()
    model.cache.init(model.backend, cache_dtype("f16"), 2, 512, 64)
    try:
        texts = [model.tokenizer.encode(prompt, add_special=True) for prompt in PROMPTS]

        def run(sequences: list[int]) -> list[np.ndarray]:
            """The prompts of these sequences in one batch, then three greedy steps; logprobs per step."""
            seqs = {s: list(texts[s]) for s in sequences}
            batch = Batch(positions=[p for s in sequences for p in range(len(seqs[s]))],
                          sequences=[s for s in sequences for _ in seqs[s]],
                          outputs=np.cumsum([len(seqs[s]) for s in sequences]) - 1,
                          tokens=[t for s in sequences for t in seqs[s]])
            steps = []
            for _ in range(4):
                logits = model.graphs.compute(batch)
                steps.append(log_softmax(logits))
                for s, row in zip(sequences, logits, strict=True):
                    seqs[s].append(int(row.argmax()))
                batch = Batch(positions=[len(seqs[s]) - 1 for s in sequences], sequences=sequences,
                              outputs=range(len(sequences)), tokens=[seqs[s][-1] for s in sequences])
            for s in sequences:
                model.cache.remove(s, 0)
            return steps

        both = run([0, 1])
        alone = [np.concatenate(rows) for rows in zip(run([0]), run([1]), strict=True)]
        for step, (x, y) in enumerate(zip(both, alone, strict=True)):
            assert np.array_equal(x, y), f"step {step}: batched differs from alone by {np.abs(x - y).max()}"
    finally:
        model.close()


def test_real_gemma3_prompt_longer_than_the_window(gemma3_path):
    """A 900-token prompt in chunks of 128, then greedy decoding: past position 511 the sliding layers
    no longer see the first positions (ignoring the window moves the logprobs by up to 8.8), and past
    position 767 their ring of 512 + 128 cells (768 once padded, as llama.cpp's) has wrapped."""
    chunk, n_ctx, n = 128, 2048, 900
    model = load_model(gemma3_path, num_threads=THREADS)
    model.backend.load()
    model.cache.init(model.backend, cache_dtype("f16"), 1, n_ctx, chunk)
    assert [cache.region for cache in model.cache.caches] == [768, n_ctx]
    reference = Reference(gemma3_path, n_ctx=n_ctx, n_batch=chunk, threads=THREADS)
    try:
        text = " ".join(f"Item {i}: the {('red', 'green', 'blue')[i % 3]} box holds {i * 7 % 50} stones."
                        for i in range(100))
        tokens = model.tokenizer.encode(text, add_special=True)[:n]
        assert len(tokens) == n
        worst, start = 0.0, 0
        while start < n + 3:  # the prompt, then three greedy tokens one at a time
            part = tokens[start : start + chunk]
            batch = Batch(positions=range(start, start + len(part)), sequences=[0] * len(part),
                          outputs=[len(part) - 1], tokens=part)
            ours = model.graphs.compute(batch)
            theirs = reference.decode(part, batch.positions, batch.sequences, batch.outputs)
            worst = max(worst, float(np.abs(log_softmax(ours) - log_softmax(theirs)).max()))
            start += len(part)
            if start >= n:
                assert int(ours[0].argmax()) == int(theirs[0].argmax()), f"position {start}: greedy tokens differ"
                tokens.append(int(theirs[0].argmax()))
        assert worst < REAL_TOLERANCE, f"logprobs differ by {worst}"
    finally:
        reference.close()
        model.close()


def test_real_gemma3_context_shift_matches_llama_cpp(gemma3_path):
    tokens = encode(gemma3_path, "In a small village by the sea, there lived a fisherman who had three sons and a "
                                 "very old boat")
    shift_then_decode(gemma3_path, tokens, keep=4, discard=8, steps=4, tolerance=REAL_TOLERANCE)


# ---------------------------------------------------------------- hyper-parameters of the files in the wild


def gemma_options(arch: str, **keys):
    from ollama_engine.fs import Config
    from ollama_engine.models.gemma2 import Gemma2, Gemma3
    from ollama_engine.models.options import Options

    base = {"embedding_length": 640, "block_count": 6, "attention.head_count": 4, "attention.key_length": 256}
    config = Config({"general.architecture": arch, **{f"{arch}.{k}": v for k, v in {**base, **keys}.items()}})
    return {"gemma2": Gemma2, "gemma3": Gemma3}[arch].gemma_options(config, Options.from_config(config))


def test_sliding_layers_and_rope_bases_from_llama_cpp_and_ollama_conversions():
    llama_cpp_file = gemma_options("gemma3", **{"attention.sliding_window": 512, "rope.freq_base": 1e6})
    assert llama_cpp_file.swa == (True,) * 5 + (False,)  # every 6th layer global
    assert (llama_cpp_file.rope_base, llama_cpp_file.rope_base_swa) == (1e6, 10000.0)
    ollama_file = gemma_options("gemma3", **{"attention.sliding_window": 512, "rope.local.freq_base": 20000.0,
                                             "attention.sliding_window_pattern": [True, False] * 3})
    assert ollama_file.swa == (True, False) * 3
    assert (ollama_file.rope_base, ollama_file.rope_base_swa) == (1e6, 20000.0)
    assert gemma_options("gemma3").swa == (False,) * 6  # no window: every layer global
    gemma2 = gemma_options("gemma2", **{"rope.freq_base": 10000.0})
    assert gemma2.swa == (True, False) * 3 and gemma2.window == 4096
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0)
    assert (gemma_options("gemma3").attn_softcap, gemma_options("gemma3").final_softcap) == (0.0, 0.0)
    assert gemma_options("gemma3", **{"attention.sliding_window_pattern": 3, "attention.sliding_window": 8}).swa == (
        True, True, False) * 2
    from ollama_engine.models import ModelError
    with pytest.raises(ModelError, match="6 layers"):
        gemma_options("gemma3", **{"attention.sliding_window": 8, "attention.sliding_window_pattern": [True]})
