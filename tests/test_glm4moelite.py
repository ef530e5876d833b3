"""GLM-4.7-Flash: llama.cpp's conversion (deepseek2) against llama.cpp, Ollama's (glm4moelite) against it.

The synthetic preset tiny-glm4moelite is deepseek2 shaped as GLM-4.7-Flash (low-rank query, latent cache, one
dense layer, sigmoid-routed experts with a selection bias, normalised weights scaled by 1.8, a shared expert,
heads whose value is wider than their non-rotary key part, no YaRN). llama.cpp cannot load Ollama's files
(architecture glm4moelite, key lengths swapped with the *_mla ones), so those are checked against the
llama.cpp-named file of the same weights, bitwise, and on their own for batching and memory.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import decoding
import numpy as np
import pytest
from llama_reference import Reference, compare_schedule
from memory_checks import fitted_then_allocated
from synthetic.models import write_synthetic
from test_batch_invariance import logprob_gap, run_prompts

from ollama_engine import diff
from ollama_engine.kvcache import Batch, cache_dtype
from ollama_engine.models import ModelError, load_model
from ollama_engine.models.deepseek2 import OLD_FORMAT, Glm4MoeLite
from ollama_engine.models.moe import Gating
from ollama_engine.runner.allocate import LoadParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import fuzz_gguf  # noqa: E402

TOLERANCE = 1e-4  # largest logprob difference against llama.cpp; measured: 0.0 (bit-identical logits)
PROMPTS = ("In a small village by the sea, there lived", "Once upon a time there was a king who ruled")  # 11 each


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("glm4moelite")

    def write(layout: str = "llama.cpp", weight_type: str = "F16") -> Path:
        path = folder / f"{layout}-{weight_type}.gguf"
        return path if path.exists() else write_synthetic(path, "tiny-glm4moelite", weight_type=weight_type,
                                                          layout=layout)

    return write


def greedy(path: Path, seqs: list[int], steps: int = 6, flash: bool = False) -> dict[int, list[np.ndarray]]:
    """Each sequence's logits over its prompt's last token and `steps - 1` greedy decode steps, the sequences
    prefilled in one batch and decoded together."""
    return decoding.greedy(path, PROMPTS, seqs, steps, flash)


def test_ollama_conversion_reads_as_glm_4_7_flash(synthetic):
    """Ollama's keys (a head's lengths as key/value_length, the latent's as *_mla, all KV heads) read as
    llama.cpp's file of the same weights reads: the latent cache, sigmoid routing, normalised weights."""
    ours, theirs = load_model(synthetic("ollama"), allocate=False), load_model(synthetic(), allocate=False)
    try:
        assert isinstance(ours, Glm4MoeLite) and ours.config.architecture() == "glm4moelite"
        assert ours.options == theirs.options
        o = ours.options
        assert (o.mla, o.k_head, o.v_head, o.kv_lora_rank, o.rope_dims, o.q_lora_rank) == (True, 96, 96, 64, 32, 32)
        assert ours.routing == theirs.routing
        assert (ours.routing.gating, ours.routing.normalize) == (Gating.SIGMOID, True)
        assert ours.backend.model.config.get_uint("attention.head_count_kv") == 4  # as Ollama's converter wrote it
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("weight_type", ["F16", "Q8_0"])
def test_ollama_conversion_equals_llama_cpps(synthetic, weight_type):
    """Ollama's glm4moelite file computes what llama.cpp's deepseek2 file of the same weights computes: two
    sequences prefilled together and decoded, bit-identical logits."""
    ours, theirs = greedy(synthetic("ollama", weight_type), [0, 1]), greedy(synthetic("llama.cpp", weight_type), [0, 1])
    for s in (0, 1):
        for step, (a, b) in enumerate(zip(ours[s], theirs[s], strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"sequence {s}, step {step}")


def load_and_prompt_logits(path: Path) -> float:
    """The largest difference of any prompt row's logits from llama.cpp's (one batch, both engines)."""
    model = load_model(path, num_threads=1)
    reference = Reference(path, n_ctx=512, n_batch=64, threads=1)
    try:
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), 1, 512, 64)
        tokens = model.tokenizer.encode(" ".join(PROMPTS), add_special=True)
        n = len(tokens)
        ours = model.graphs.compute(Batch(positions=range(n), sequences=[0] * n, outputs=range(n), tokens=tokens))
        theirs = reference.decode(tokens, range(n), [0] * n, range(n))
    finally:
        reference.close()
        model.close()
    assert ours.shape == theirs.shape
    return float(np.abs(ours - theirs).max())


@pytest.mark.reference
def test_prompt_logits_match(synthetic):
    """Every row of the prompt (F16), against llama.cpp's."""
    assert load_and_prompt_logits(synthetic()) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "sequences", "flash"), [
    ("F16", 1, False),
    ("F16", 2, True),
    ("Q8_0", 2, False),
    ("Q4_0", 2, False),  # repacked on the CPU where it can be, as llama.cpp repacks it
])
def test_matches_llama_cpp(synthetic, weight_type, sequences, flash):
    """Prompts prefilled in one batch, then six batches decoding a token for each: every logprob within the
    tolerance and the same greedy tokens as llama.cpp at every step."""
    worst = compare_schedule(synthetic("llama.cpp", weight_type), flash=flash, cache_type="f16", sequences=sequences,
                             steps=6, tolerance=TOLERANCE, threads=1, prompts=PROMPTS)
    assert worst < TOLERANCE


def test_the_batch_loop_gives_batched_the_solo_logprobs(synthetic):
    """Through the runner's batch loop (prompts longer than a batch, shared prefixes, two slots): the
    completions one after the other, then two at a time; the same greedy tokens and logprobs, exactly."""
    solo = run_prompts(synthetic("ollama", "Q8_0"), 2, False, concurrent=False)
    batched = run_prompts(synthetic("ollama", "Q8_0"), 2, False, concurrent=True)
    assert max(logprob_gap(a, b) for a, b in zip(solo, batched, strict=True)) == 0.0


@pytest.mark.parametrize("flash", [False, True])
def test_batched_equals_solo(synthetic, flash):
    """On Ollama's file, a sequence's logits do not depend on another sequence sharing its batches."""
    path = synthetic("ollama", "Q8_0")
    together = greedy(path, [0, 1], flash=flash)
    for s in (0, 1):
        for step, (a, b) in enumerate(zip(greedy(path, [s], flash=flash)[s], together[s], strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"sequence {s}, step {step}")


@pytest.mark.parametrize("layout", ["ollama", "llama.cpp"])
def test_fit_equals_alloc(synthetic, layout):
    """fit reports what alloc allocates (one latent key per token and layer), and inference adds nothing."""
    params = LoadParams(parallel=2, batch_size=32, kv_size=256, num_threads=1)
    with fitted_then_allocated(str(synthetic(layout)), params) as loaded:
        o = loaded.model.options
        cells = loaded.model.cache.cells
        assert sum(loaded.memory.cpu.cache) == (o.kv_lora_rank + o.rope_dims) * 2 * o.block_count * cells
        graphs = loaded.model.graphs
        graphs.compute(Batch(positions=range(32), sequences=[0] * 32, outputs=[31], tokens=np.arange(32) + 100))
        for step in range(3):
            graphs.compute(Batch(positions=[32 + step] * 2, sequences=[0, 1], outputs=[0, 1], tokens=[7, 8]))


@pytest.mark.reference
def test_diff_finds_every_tensor_equal_to_llama_cpps(synthetic):
    """ollama-engine diff on llama.cpp's conversion: every tensor named alike is llama.cpp's, bitwise."""
    result = diff.run_diff(synthetic(), PROMPTS[0], threads=1, generate=2)
    assert result.first_over is None and not result.departs
    assert all(t.max_abs == 0 for t in result.tensors), [t for t in result.tensors if t.max_abs != 0]
    assert {"kv_cmpr-1", "k_pe-1", "q_pe-2", "Qcur-1", "kqv_out-1", "ffn_moe_probs_biased-1", "ffn_shexp-2",
            "l_out-2", "result_output"} <= {t.name for t in result.tensors}


BAD = {  # Ollama's file with a key removed or changed -> the error
    "a conversion before MLA absorption": ("glm4moelite.attention.key_length_mla", None, OLD_FORMAT),
    "latent key length off by 32": ("glm4moelite.attention.key_length_mla", 64,
                                    "key_length_mla 64 and value_length_mla 64 must be"),
    "head key length missing": ("glm4moelite.attention.key_length", None, "must be set together"),
    "k_b for 2 heads": ("blk.2.attn_k_b.weight", [64, 64, 2], "expected [64, 64, 4]"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_files_are_refused_with_a_model_error(synthetic, tmp_path, case):
    """Inconsistent or old keys and shapes raise ModelError at load, before any ggml op could abort."""
    name, value, message = BAD[case]
    model = fuzz_gguf.Model.read(synthetic("ollama"))
    if name.startswith("blk."):
        next(t for t in model.tensors if t.name == name).shape = value
    elif value is None:
        del model.metadata[name]
    else:
        model.metadata[name] = (4, None, value)  # UINT32
    path = tmp_path / "bad.gguf"
    path.write_bytes(model.to_bytes())
    with pytest.raises(ModelError, match=re.escape(message)):
        load_model(path).close()
