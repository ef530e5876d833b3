"""Flash attention "auto" (serve's default): on for every architecture and cache type on the CPU.

Every architecture attends through kvcache.attention, so auto may turn flash attention on everywhere;
this checks that it does with every cache type, and that with an F16 cache each one computes what it
computes without (to F16 rounding: the fused kernel multiplies F16 queries by the F16 cache, the matmul
path F32 queries). Agreement with llama.cpp with flash attention on is in the parity tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from synthetic.models import ARCHITECTURES, write_synthetic

from ollama_engine.kvcache import Batch
from ollama_engine.ml.memory import FlashAttention, resolve_flash_attention
from ollama_engine.runner.allocate import LoadParams, open_model

CACHE_TYPES = ["", "q8_0", "q4_0"]
# the largest logprob difference F16 queries may make; gemma3n's 22 layers and AltUp's streams carry it further
# (0.12 measured; its flash logits equal llama.cpp's flash logits bitwise, see test_gemma3n)
QUERY_ROUNDING = {"gemma3n": 0.2}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """Each architecture's tiny model, and a wide one (head size 32, a whole block of the quantized caches)."""
    folder = tmp_path_factory.mktemp("flash")
    out = {}
    for arch in ARCHITECTURES:
        if "bert" not in arch:
            out[arch, False] = write_synthetic(folder / f"{arch}.gguf", arch)
            for wide in ({"n_embd": 128, "n_head": 4, "n_head_kv": 2}, {"head_dim": 32}, {}):
                try:  # the presets' own constraints decide which override they take
                    out[arch, True] = write_synthetic(folder / f"{arch}-wide.gguf", arch, **wide)
                    break
                except ValueError:
                    continue
    return out


def logprobs(path: Path, flash: int, cache_type: str) -> tuple[bool, np.ndarray]:
    params = LoadParams(batch_size=32, kv_size=256, kv_cache_type=cache_type, flash_attention=flash, num_threads=2)
    loaded = open_model(str(path), params, allocate=True)
    try:
        model = loaded.model
        model.backend.load()
        tokens = list(range(5, 21))
        batch = Batch(positions=range(len(tokens)), sequences=[0] * len(tokens), outputs=range(len(tokens)),
                      tokens=tokens)
        logits = model.graphs.compute(batch)
        shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
        return model.backend.flash_attention, shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    finally:
        loaded.close()


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if "bert" not in a])
def test_auto_turns_it_on_and_computes_what_matmul_attention_does(models: dict[tuple[str, bool], Path], arch: str):
    for cache_type in CACHE_TYPES:
        path = models[arch, cache_type != ""]
        plain_on, plain = logprobs(path, FlashAttention.DISABLED, "")
        assert not plain_on
        on, fused = logprobs(path, FlashAttention.AUTO, cache_type)
        assert on, f"{arch} {cache_type or 'f16'}: auto left flash attention off"
        assert np.isfinite(fused).all()
        if cache_type == "":  # the same F16 cache: F16 rounding of the queries apart, the same result
            worst = float(np.abs(fused - plain).max())
            assert worst < QUERY_ROUNDING.get(arch, 0.1), (arch, worst)
            assert (fused.argmax(axis=-1) == plain.argmax(axis=-1)).mean() > 0.9


def test_the_parent_resolves_auto_as_ollama_does():
    from ollama_engine.ml.memory import DeviceID, DeviceInfo

    def gpu(library: str, major: int = 8, minor: int = 0, driver: int = 12) -> DeviceInfo:
        return DeviceInfo(device_id=DeviceID("GPU-0", library), compute_major=major, compute_minor=minor,
                          driver_major=driver)

    assert resolve_flash_attention(None, []) == (1, "on (auto: supported by every device)")
    assert resolve_flash_attention(None, [gpu("CUDA"), gpu("Metal")])[0] == 1
    assert resolve_flash_attention(None, [gpu("CUDA", 7, 2)]) == (0, "off (not supported by every GPU)")
    assert resolve_flash_attention(True, [gpu("CUDA", driver=6)])[0] == 0  # Ollama: even when asked for
    assert resolve_flash_attention(False, []) == (0, "off (OLLAMA_FLASH_ATTENTION=false)")
    assert resolve_flash_attention(True, []) == (1, "on (OLLAMA_FLASH_ATTENTION=true)")
