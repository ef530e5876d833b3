"""Every tensor type ggml computes with loads, runs and matches llama.cpp; the others are refused.

One table row per type: a one-layer llama whose matrices are all of that type (rows of 256, the K and IQ
block size), quantized by ggml's own quantizers as llama-quantize does, run by both engines on the same
prompt (every logprob of the prompt's last token and of 2 greedy steps within TOLERANCE, identical greedy
tokens). Both engines multiply by the same ggml kernels, so no type needs a looser bound: measured, the
largest difference is 1.3e-6 (F32, Q6_K, IQ4_XS), every other type is bitwise equal.

Quantizing, not computing, sets two constraints. IQ1_S, IQ2_XXS and IQ2_XS need an importance matrix
(ggml_quantize_requires_imatrix; llama-quantize refuses them without --imatrix): the synthetic writer
gives a uniform one. The IQ1 and IQ2 quantizers first build large grid tables (seconds each, once per
process) and then search them, so their rows keep token_embd in Q8_0 (as llama-quantize's own mixes keep
the embeddings in a larger type); every other type has its token_embd, which is also the output matrix,
in the type itself (get_rows and the 32000-row output matmul). Q2_0 is not here: ggml computes it, but
gguf-py 0.19 (our writer and our reader's type table) does not know it yet, so reading a file with it
fails with "unknown ggml type id 42".
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from llama_reference import compare_schedule
from synthetic.models import WEIGHT_TYPES, write_synthetic
from test_fs import damaged_copy, tensor_info_fields

from ollama_engine.fs import SUPPORTED_TYPES, GGUFError, GGUFFile
from ollama_engine.ggml import GGMLType, quantize, requires_importance

TOLERANCE = 1e-4
SHAPE = {"n_layer": 1, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 256}

# weight type -> token_embd's type where it differs (the IQ1/IQ2/IQ3 quantizers are slow on 32000 rows)
TYPES: dict[str, str | None] = {
    "F32": None, "F16": None, "BF16": None,
    "Q8_0": None, "Q4_0": None, "Q4_1": None, "Q5_0": None, "Q5_1": None,
    "Q2_K": None, "Q3_K": None, "Q4_K": None, "Q5_K": None, "Q6_K": None,
    "IQ4_NL": None, "IQ4_XS": None,
    "IQ3_XXS": "Q8_0", "IQ3_S": "Q8_0", "IQ2_XXS": "Q8_0", "IQ2_XS": "Q8_0", "IQ2_S": "Q8_0",
    "IQ1_S": "Q8_0", "IQ1_M": "Q8_0",
    "TQ1_0": None, "TQ2_0": None, "MXFP4": None, "NVFP4": None, "Q1_0": None,
}


def test_the_table_covers_every_supported_type() -> None:
    assert set(TYPES) == set(WEIGHT_TYPES) == {t.name for t in SUPPORTED_TYPES}


@pytest.mark.reference
@pytest.mark.parametrize("weight_type", TYPES)
def test_type_matches_llama_cpp(tmp_path: Path, weight_type: str) -> None:
    path = write_synthetic(tmp_path / f"{weight_type}.gguf", "llama", weight_type=weight_type,
                           embedding_type=TYPES[weight_type], **SHAPE)
    tensors = GGUFFile.open(path).tensors
    assert tensors["blk.0.ffn_down.weight"].ggml_type.name == weight_type
    assert tensors["token_embd.weight"].ggml_type.name == (TYPES[weight_type] or weight_type)
    compare_schedule(path, flash=False, cache_type="f16", sequences=1, steps=2, tolerance=TOLERANCE)


@pytest.mark.parametrize("ggml_type", sorted(set(gguf.GGMLQuantizationType) - SUPPORTED_TYPES, key=int))
def test_a_type_no_kernel_multiplies_by_is_refused(tmp_path: Path, ggml_type: gguf.GGMLQuantizationType) -> None:
    """Q8_1 and Q8_K only hold activations, the integer and F64 types indices: refused at load."""
    source = write_synthetic(tmp_path / "tiny.gguf", "llama", weight_type="Q8_0", n_layer=1)

    def retype(data: bytearray) -> None:
        type_pos, _ = tensor_info_fields(data, "blk.0.attn_k.weight")
        data[type_pos : type_pos + 4] = struct.pack("<I", ggml_type)

    with pytest.raises(GGUFError, match=f"'blk.0.attn_k.weight' has type {ggml_type.name}, which this engine "
                                        "does not support"):
        GGUFFile.open(damaged_copy(source, tmp_path, retype))


def test_quantizing_without_a_required_importance_matrix_is_an_error() -> None:
    rows = np.zeros((1, 256), dtype=np.float32)
    needs = [t.name for t in GGMLType if t.name in TYPES and requires_importance(t)]
    assert needs == ["IQ2_XXS", "IQ2_XS", "IQ1_S"]
    for name in needs:
        with pytest.raises(ValueError, match="needs an importance matrix"):
            quantize(GGMLType[name], rows)
    with pytest.raises(ValueError, match="cannot quantize to q8_K"):
        quantize(GGMLType.Q8_K, rows)
    with pytest.raises(ValueError, match="importance matrix for rows of 256"):
        quantize(GGMLType.IQ2_XXS, rows, np.ones(128, dtype=np.float32))
