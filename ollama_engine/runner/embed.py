"""Embeddings: one input, one forward pass, the model's pooled vector (Ollama's embedding-only sequences).

An embedding model pools its output (`<arch>.pooling_type` is not 0). The encoders served here (bert)
have no KV cache, so the runner gave them one sequence and a batch as large as the context: the whole
input is always one batch, nothing is cached between requests, and the batch loop is not needed.
Compute is serialised with every other graph by the backend's compute lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ollama_engine.kvcache import Batch
from ollama_engine.models import Model
from ollama_engine.runner.inputs import Input
from ollama_engine.runner.sequence import fit_prompt


def supports_embeddings(model: Model) -> bool:
    """Whether the model pools its output into an embedding (Ollama answers 501 otherwise)."""
    return model.config.get_uint("pooling_type", 0) != 0


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
    if model.cache is not None:
        raise ValueError("embeddings from a model with a KV cache are not supported")
    tokens = model.tokenizer.encode(content, add_special=True)
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

