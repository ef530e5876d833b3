"""The BPE model is built at the first encode or by prepare(), not with the tokenizer (issue 33: time to ready).

A runner reports ready once its weights are in and builds the BPE model right after; these tests prove the
deferral changes nothing a caller sees: the same ids whether prepare() ran first, ran beside the encodes, or
never ran, and errors in the vocabulary still surface when the tokenizer is made.
"""

from __future__ import annotations

import threading
from pathlib import Path

import assets
import pytest

from ollama_engine.tokenizer import bpe, from_metadata, read_tokenizer_metadata
from ollama_engine.tokenizer.bpe import BytePairSegmenter

TEXTS = ["Hello world", " leading space and 123456 digits", "naïve café — ünïcödé\n\nnew lines\t tabs",
         "<|begin_of_text|>special<|eot_id|> tokens", "'s 're 've contractions, don't"]


def _metadata(name: str) -> dict:
    return read_tokenizer_metadata(Path(assets.vocab(name)))


@pytest.mark.parametrize("name", ["llama-bpe", "gpt-2", "qwen2"])
def test_construction_defers_the_bpe_model_and_encodes_the_same(name: str) -> None:
    metadata = _metadata(name)
    eager = from_metadata(metadata)
    eager.prepare()
    lazy = from_metadata(metadata)
    segmenter = lazy._segmenter
    assert isinstance(segmenter, BytePairSegmenter)
    assert segmenter._tokenizer is None  # nothing built yet
    assert [lazy.encode(t) for t in TEXTS] == [eager.encode(t) for t in TEXTS]
    assert segmenter._tokenizer is not None  # the first encode built it
    built = segmenter._tokenizer
    lazy.prepare()
    assert segmenter._tokenizer is built  # prepare() after the fact builds nothing again


def test_prepare_beside_encodes_builds_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's prepare thread and a first request's encodes race: one build, the same ids for all."""
    metadata = _metadata("llama-bpe")
    expected = [from_metadata(metadata).encode(t) for t in TEXTS]
    builds: list[int] = []
    build = bpe._bpe_model

    def counted(*args: object) -> object:
        builds.append(1)
        return build(*args)

    monkeypatch.setattr(bpe, "_bpe_model", counted)
    tokenizer = from_metadata(metadata)
    results: list[list[list[int]]] = []
    threads = [threading.Thread(target=tokenizer.prepare)] + [
        threading.Thread(target=lambda: results.append([tokenizer.encode(t) for t in TEXTS])) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [expected] * 3
    assert len(builds) == 1


def test_bad_vocabulary_is_still_an_error_when_made() -> None:
    metadata = {**_metadata("gpt-2"), "tokenizer.ggml.pre": "no-such-pre"}
    with pytest.raises(ValueError, match="unsupported pre-tokenizer"):
        from_metadata(metadata)
