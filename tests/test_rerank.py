"""Rerank: a synthetic BERT reranker (llama.cpp's layout: cls and cls.output heads, pooling type rank) scored
against llama.cpp's own rank pooling, then POST /api/rerank and /v1/rerank through a real `serve` with httpx.

llama.cpp (llama-cpp-python 0.3.36) is driven through its low-level API with embeddings on and pooling type
RANK, fed the pair as llama-server's format_prompt_rerank builds it from llama.cpp's own vocabulary calls
(llama_tokenize without special tokens, llama_vocab_get_add_bos/eos/sep); the score is the sequence's pooled
output, llama-server's relevance_score.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from serve_process import serve_process
from synthetic.models import write_synthetic
from test_embeddings import serve as runner_serve

from ollama_engine.fs import Config, GGUFFile
from ollama_engine.models import load_model
from ollama_engine.runner.embed import rerank, rerank_tokens

httpx = pytest.importorskip("httpx")

CONTEXT = 512
THREADS = 1
QUERY = "What is the giant panda?"
DOCUMENTS = [
    "The giant panda is a bear species endemic to China.",
    "Hello",
    "Pandas is a Python library for data analysis: café, naïve, 3.14159!",
    "a text that spells [SEP] and [CLS] as plain words",  # not parsed as special tokens, as in llama-server
    "The quick brown fox jumps over the lazy dog.",
]
# largest |ours - llama.cpp| over the scores; measured on one thread: 0 for F32, F16 and Q8_0 and for the
# XLM-R vocabulary (the same ggml
# operations in the same order). Flash attention is off on both sides here (with it, both cast an encoder's F32 K
# and V to F16 first, as llm_graph_context::build_attn_mha does: tests/test_embeddings.py compares that way too).
TOLERANCE = 1e-6
# serve's runner computes with its own thread count (and CPU weight layout) where the in-process model uses one
# thread: ggml's kernels may then sum in another order; measured 2e-6 apart, far below the scores' gaps (> 2e-3)
SERVE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("rerank")
    written: dict[tuple[str, str], Path] = {}

    def write(weight_type: str = "F32", vocab: str = "bert-bge") -> Path:
        if (weight_type, vocab) not in written:
            written[weight_type, vocab] = write_synthetic(
                folder / f"reranker-{vocab}-{weight_type}.gguf", "tiny-bert-reranker", weight_type=weight_type,
                vocab=vocab)
        return written[weight_type, vocab]

    return write


class RankReference:
    """llama.cpp with embeddings on and pooling type RANK: one pair per llama_decode, its memory cleared."""

    def __init__(self, path: Path, flash_attention: bool) -> None:
        import llama_cpp

        self.lib = lib = llama_cpp
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = CONTEXT
        params.embeddings = True
        params.pooling_type = 4  # LLAMA_POOLING_TYPE_RANK
        params.flash_attn_type = 1 if flash_attention else 0
        params.n_threads = params.n_threads_batch = THREADS
        self.ctx = lib.llama_init_from_model(self.model, params)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_cls_out = lib.llama_model_n_cls_out(self.model)
        self.batch = lib.llama_batch_init(CONTEXT, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buffer = (self.lib.llama_token * (len(data) + 8))()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buffer, len(buffer), False, False)
        assert n >= 0
        return list(buffer[:n])

    def pair(self, query: str, document: str) -> list[int]:
        """format_prompt_rerank without a rerank template."""
        lib, vocab = self.lib, self.vocab
        eos = lib.llama_vocab_eos(vocab)
        eos = lib.llama_vocab_sep(vocab) if eos == -1 else eos
        tokens = [lib.llama_vocab_bos(vocab)] if lib.llama_vocab_get_add_bos(vocab) else []
        tokens += self.tokenize(query)
        tokens += [eos] if lib.llama_vocab_get_add_eos(vocab) else []
        tokens += [lib.llama_vocab_sep(vocab)] if lib.llama_vocab_get_add_sep(vocab) else []
        tokens += self.tokenize(document)
        tokens += [eos] if lib.llama_vocab_get_add_eos(vocab) else []
        return tokens

    def scores(self, tokens: list[int]) -> np.ndarray:
        batch = self.batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
            batch.seq_id[i][0] = 0
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        assert self.lib.llama_decode(self.ctx, batch) == 0
        pointer = self.lib.llama_get_embeddings_seq(self.ctx, 0)
        return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)),
                                     shape=(self.n_cls_out,)).copy()

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


@pytest.mark.reference
@pytest.mark.parametrize(("weight_type", "vocab"), [
    ("F32", "bert-bge"), ("F16", "bert-bge"), ("Q8_0", "bert-bge"),  # BERT's WordPiece: [CLS] q [SEP] d
    ("F16", "nomic-bert-moe"),  # XLM-R's Unigram (bge-reranker-v2-m3's): <s> q </s> d </s> (add_bos, add_eos)
])
def test_scores_match_llama_cpp(reranker, weight_type, vocab):
    path = reranker(weight_type, vocab)
    model = load_model(path, num_threads=THREADS)
    model.backend.load()
    reference = RankReference(path, flash_attention=False)
    try:
        assert reference.n_cls_out == 1
        ours, theirs = [], []
        for document in DOCUMENTS:
            tokens = reference.pair(QUERY, document)
            assert rerank_tokens(model.tokenizer, model.config, QUERY, document) == tokens
            scored = rerank(model, QUERY, document, CONTEXT)
            assert scored.vector.shape == (1,) and scored.prompt_eval_count == len(tokens)
            ours.append(scored.vector[0])
            theirs.append(reference.scores(tokens)[0])
        difference = np.abs(np.array(ours) - np.array(theirs)).max()
        assert difference <= TOLERANCE, f"scores {ours} vs llama.cpp's {theirs}"
        assert len(set(ours)) == len(DOCUMENTS)  # the head separates the documents: the ordering test means something
    finally:
        reference.close()
        model.close()


@pytest.mark.reference
def test_rerank_template_is_tokenized_as_llama_cpp(reranker):
    """A file's tokenizer.chat_template.rerank: {query} and {document} put in, special tokens parsed, none
    added (format_prompt_rerank's tokenize_input_subprompt(..., false, true))."""
    path = reranker()
    template = "[CLS] query: {query} [SEP] document: {document} [SEP]"
    model = load_model(path, num_threads=THREADS, allocate=False)
    reference = RankReference(path, flash_attention=False)
    try:
        config = Config({**GGUFFile.open(path).metadata, "tokenizer.chat_template.rerank": template})
        for document in DOCUMENTS:
            prompt = template.replace("{query}", QUERY).replace("{document}", document).encode()
            buffer = (reference.lib.llama_token * (len(prompt) + 8))()
            n = reference.lib.llama_tokenize(reference.vocab, prompt, len(prompt), buffer, len(buffer), False, True)
            assert rerank_tokens(model.tokenizer, config, QUERY, document) == list(buffer[:n])
    finally:
        reference.close()
        model.close()


def test_pair_is_cls_query_sep_document(reranker):
    """BERT's vocabulary: [CLS] query [SEP] document (add_bos, add_sep; no EOS), as llama-server builds it."""
    model = load_model(reranker(), num_threads=THREADS, allocate=False)
    try:
        tokenizer = model.tokenizer
        tokens = rerank_tokens(tokenizer, model.config, "hi", "hello [SEP]")
        plain = tokenizer.encode("hello [SEP]", add_special=False, parse_special=False)
        assert tokens == [tokenizer.vocab.bos_id, *tokenizer.encode("hi", add_special=False),
                          tokenizer.vocab.sep_id, *plain]
        assert tokens.count(tokenizer.vocab.sep_id) == 1  # the document's "[SEP]" stays text
    finally:
        model.close()


def test_runner_rerank_route(reranker, tmp_path):
    """The runner's /rerank (ours): the in-process scores; a bad body is a 400; a non-reranker a 501."""
    path = reranker()
    model = load_model(path, num_threads=THREADS)
    model.backend.load()
    try:
        want = rerank(model, QUERY, DOCUMENTS[0], CONTEXT)
    finally:
        model.close()
    pair = json.dumps({"query": QUERY, "document": DOCUMENTS[0]}).encode()
    (status, body), bad = runner_serve(path, [("/rerank", pair), ("/rerank", b'{"query": 1}')])
    assert status == 200 and json.loads(body)["prompt_eval_count"] == want.prompt_eval_count
    np.testing.assert_array_equal(np.array(json.loads(body)["embedding"], dtype=np.float32), want.vector)
    assert bad[0] == 400 and bad[1].startswith(b"bad request: query")
    bert = write_synthetic(tmp_path / "bert.gguf", "tiny-bert")
    assert runner_serve(bert, [("/rerank", pair)]) == [(501, b"this model does not support reranking\n")]


# ---------------------------------------------------------------- through serve


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    with serve_process(tmp_path_factory.mktemp("serve") / "models") as url:
        yield url


@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def expected(reranker) -> list[float]:
    """Our in-process scores of DOCUMENTS (equal to llama.cpp's: test_scores_match_llama_cpp)."""
    model = load_model(reranker(), num_threads=THREADS, flash_attention=True)  # serve's default: auto, on
    model.backend.load()
    try:
        return [float(rerank(model, QUERY, d, CONTEXT).vector[0]) for d in DOCUMENTS]
    finally:
        model.close()


def order_of(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -scores[i])


@pytest.mark.parametrize("route", ["/api/rerank", "/v1/rerank"])
def test_rerank_scores_ordering_and_usage(http, reranker, expected, route):
    model = str(reranker())
    response = http.post(route, json={"model": model, "query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == model and body["object"] == "list"
    results = body["results"]
    assert [r["index"] for r in results] == order_of(expected)
    for r in results:
        assert set(r) == {"index", "relevance_score"}
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=SERVE_TOLERANCE)
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    model_file = load_model(reranker(), num_threads=THREADS, allocate=False)
    try:
        tokens = sum(len(rerank_tokens(model_file.tokenizer, model_file.config, QUERY, d)) for d in DOCUMENTS)
    finally:
        model_file.close()
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_top_n_and_return_documents(http, reranker, expected):
    model = str(reranker())
    best = order_of(expected)
    body = http.post("/api/rerank", json={"model": model, "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                          "return_documents": True}).json()
    assert [r["index"] for r in body["results"]] == best[:2]
    assert [r["document"] for r in body["results"]] == [{"text": DOCUMENTS[i]} for i in best[:2]]
    # top_n above the number of documents returns them all (llama-server, Jina and Cohere do the same)
    body = http.post("/v1/rerank", json={"model": model, "query": QUERY, "documents": DOCUMENTS,
                                         "top_n": 10**30, "return_documents": False}).json()
    assert [r["index"] for r in body["results"]] == best
    assert all("document" not in r for r in body["results"])


def test_one_document_and_an_empty_query(http, reranker):
    body = http.post("/api/rerank", json={"model": str(reranker()), "query": "", "documents": ["x"]}).json()
    assert [r["index"] for r in body["results"]] == [0] and isinstance(body["results"][0]["relevance_score"], float)


def create(http: httpx.Client, name: str, path: Path) -> None:
    """A stored model from an uploaded GGUF, as `ollama create` does for FROM ./file.gguf."""
    digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert http.post(f"/api/blobs/{digest}", content=path.read_bytes()).status_code in (200, 201)
    response = http.post("/api/create", json={"model": name, "files": {path.name: digest}, "stream": False})
    assert response.status_code == 200, response.text


def test_capabilities_and_a_stored_reranker(http, reranker, expected, tmp_path):
    create(http, "reranker", reranker())
    create(http, "bert", write_synthetic(tmp_path / "bert.gguf", "tiny-bert"))
    assert http.post("/api/show", json={"model": "reranker"}).json()["capabilities"] == ["rerank"]
    assert http.post("/api/show", json={"model": "bert"}).json()["capabilities"] == ["embedding"]
    body = http.post("/api/rerank", json={"model": "reranker", "query": QUERY, "documents": DOCUMENTS}).json()
    assert body["model"] == "reranker" and [r["index"] for r in body["results"]] == order_of(expected)
    response = http.post("/api/rerank", json={"model": "bert", "query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 400 and response.json()["error"].startswith('"bert" does not support rerank')


@pytest.mark.parametrize(("change", "message"), [
    ({"query": None}, "query is required"),
    ({"query": 3}, "query must be a string, got int"),
    ({"documents": []}, "documents must be a non-empty array of strings"),
    ({"documents": None}, "documents is required"),
    ({"documents": "one document"}, "documents must be a non-empty array of strings"),
    ({"documents": ["fine", {"text": "an object"}]}, "documents[1] must be a string, got dict"),
    ({"top_n": -1}, "top_n must be a positive integer, got -1"),
    ({"top_n": 0}, "top_n must be a positive integer, got 0"),
    ({"top_n": "2"}, "top_n must be a positive integer, got '2'"),
    ({"top_n": True}, "top_n must be a positive integer, got True"),
    ({"return_documents": "yes"}, "return_documents must be a boolean, got 'yes'"),
    ({"documents": ["d"] * 1001}, "at most 1000 documents per request, got 1001"),
    ({"model": None}, "model is required"),
])
def test_bad_input_is_400(http, reranker, change, message):
    body = {"model": str(reranker()), "query": QUERY, "documents": DOCUMENTS, **change}
    native = http.post("/api/rerank", json=body)
    assert native.status_code == 400 and native.json() == {"error": message}
    openai = http.post("/v1/rerank", json=body)
    assert openai.status_code == 400
    assert openai.json()["error"]["message"] == message and openai.json()["error"]["type"] == "invalid_request_error"


def test_not_a_reranker_or_missing(http, tmp_path):
    bert = str(write_synthetic(tmp_path / "bert.gguf", "tiny-bert"))
    response = http.post("/api/rerank", json={"model": bert, "query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 400
    assert response.json()["error"].startswith(f'"{bert}" does not support rerank: it is not a reranker')
    response = http.post("/v1/rerank", json={"model": "no-such-model", "query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    response = http.post("/api/rerank", content=b"{not json")
    assert response.status_code == 400 and "error" in response.json()


def test_embed_on_a_reranker_is_400(http, reranker):
    model = str(reranker())
    message = f'"{model}" is a reranker, not an embedding model: use /api/rerank or /v1/rerank'
    response = http.post("/api/embed", json={"model": model, "input": "hello"})
    assert response.status_code == 400 and response.json() == {"error": message}
    response = http.post("/v1/embeddings", json={"model": model, "input": "hello"})
    assert response.status_code == 400 and response.json()["error"]["message"] == message


def test_too_long_pair_is_400(http, reranker):
    response = http.post("/api/rerank", json={"model": str(reranker()), "query": QUERY,
                                              "documents": ["word " * 600], "options": {"num_ctx": 512}})
    assert response.status_code == 400
    assert response.json() == {"error": "the input length exceeds the context length"}
