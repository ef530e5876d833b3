"""Embeddings: one input, one forward pass, the model's pooled vector (Ollama's embedding-only sequences).

An embedding model pools its output (`<arch>.pooling_type` is not 0). The encoders served here (bert)
have no KV cache, so the runner gave them one sequence and a batch as large as the context: the whole
input is always one batch, nothing is cached between requests, and the batch loop is not needed.
Compute is serialised with every other graph by the backend's compute lock.

A reranker (pooling type 4, "rank") is such an encoder whose pooled output is n_cls_out scores: it scores
one (query, document) pair, tokenized as llama-server's format_prompt_rerank does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ollama_engine.fs import Config
from ollama_engine.kvcache import Batch
from ollama_engine.models import Model
from ollama_engine.runner.inputs import Input
from ollama_engine.runner.sequence import fit_prompt
from ollama_engine.tokenizer import Tokenizer


def supports_embeddings(model: Model) -> bool:
    """Whether the model pools its output into an embedding (Ollama answers 501 otherwise)."""
    return model.config.get_uint("pooling_type", 0) != 0


RANK = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK
SEP_BY_DEFAULT = ("jina-v1-en", "jina-v2-code", "roberta-bpe")  # BPE pre-tokenizers llama.cpp gives add_sep


def supports_rerank(model: Model) -> bool:
    """Whether the model is a reranker (a classification head on a pooled encoder)."""
    return model.config.get_uint("pooling_type", 0) == RANK


def rerank_tokens(tokenizer: Tokenizer, metadata: Config, query: str, document: str) -> list[int]:
    """The pair as llama-server's format_prompt_rerank tokenizes it.

    With a `tokenizer.chat_template.rerank` in the file: the template with {query} and {document} put in,
    special tokens parsed, none added. Otherwise [BOS] query [EOS] [SEP] document [EOS], each special
    token only where the vocabulary adds it (add_bos, add_eos, add_sep), EOS falling back to SEP; the texts'
    own special-token spellings are not parsed. BERT's vocabulary: [CLS] query [SEP] document.
    """
    template = metadata.get_string("tokenizer.chat_template.rerank")
    if template:
        prompt = template.replace("{query}", query).replace("{document}", document)
        return tokenizer.encode(prompt, add_special=False, parse_special=True)
    vocab = tokenizer.vocab
    add_sep = metadata.value("tokenizer.ggml.add_sep_token")
    if not isinstance(add_sep, bool):
        add_sep = vocab.model == "bert" or (vocab.model == "gpt2" and vocab.pre in SEP_BY_DEFAULT)
    eos = vocab.eos_id if vocab.eos_id is not None else vocab.sep_id
    ids: list[int] = []
    if tokenizer.add_bos and vocab.bos_id is not None:
        ids.append(vocab.bos_id)
    ids += tokenizer.encode(query, add_special=False, parse_special=False)
    if tokenizer.add_eos and eos is not None:
        ids.append(eos)
    if add_sep and vocab.sep_id is not None:
        ids.append(vocab.sep_id)
    ids += tokenizer.encode(document, add_special=False, parse_special=False)
    if tokenizer.add_eos and eos is not None:
        ids.append(eos)
    return ids


@dataclass(frozen=True)
class Embedding:
    vector: np.ndarray
    """float32, every float the model's pooled output holds."""
    prompt_eval_count: int


def embed(model: Model, content: str, num_ctx: int) -> Embedding:
    """The embedding of `content`; never truncated (too long: InputTooLongError from runner.sequence).

    num_ctx is one sequence's context; the model's trained context bounds it too, since an encoder's
    position table has no rows beyond it.
    """
    if not supports_embeddings(model):
        raise ValueError("this model does not support embeddings")
    return embed_tokens(model, model.tokenizer.encode(content, add_special=True), num_ctx)


def rerank(model: Model, query: str, document: str, num_ctx: int) -> Embedding:
    """The reranker's scores (n_cls_out floats, llama-server's relevance_score is the first) for the pair."""
    if not supports_rerank(model):
        raise ValueError("this model does not support reranking")
    return embed_tokens(model, rerank_tokens(model.tokenizer, model.config, query, document), num_ctx)


def embed_tokens(model: Model, tokens: list[int], num_ctx: int) -> Embedding:
    """The pooled output of one forward pass over `tokens` (never truncated)."""
    if model.cache is not None:
        raise ValueError("embeddings from a model with a KV cache are not supported")
    trained = model.config.get_uint("context_length", 0)
    inputs, _ = fit_prompt([Input(token=t) for t in tokens], min(num_ctx, trained or num_ctx), 0, truncate=False)
    n = len(inputs)
    batch = Batch(
        positions=np.arange(n), sequences=np.zeros(n), outputs=np.arange(n),
        tokens=np.array([inp.token for inp in inputs]),
    )
    with model.backend.new_context() as ctx:
        output = model.forward(ctx, batch)
        assert output is not None
        ctx.compute(output)
        vector = output.numpy().astype(np.float32).reshape(-1)
    return Embedding(vector, n)

