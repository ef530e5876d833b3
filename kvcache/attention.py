"""attention(): scaled dot-product attention over the cache, the one call model layers make.

It stores the batch's keys and values in the cache, reads back each sequence's history and mask, and
runs either ggml's fused flash attention (when the backend enables it) or matmul, softmax and matmul,
once per sequence of the batch, so that a sequence's result does not depend on its company. With a
quantized cache, queries, keys and values are rotated first (see Causal.rotations).
"""

from __future__ import annotations

from ollama_engine.ml import Context, DType, ShapeError, Tensor

from .cache import Cache


def attention(
    ctx: Context, query: Tensor, key: Tensor | None, value: Tensor | None, scale: float, cache: Cache | None = None,
    *, softcap: float = 0.0, sinks: Tensor | None = None, value_projection: Tensor | None = None,
) -> Tensor:
    """query (head_dim, heads, n), key/value (head_dim, kv_heads, n) -> (v_head_dim, heads, n).

    With a cache, key and value join the history first (None: the cache already holds them, as for
    cross-attention states); without one, they are the whole history and nothing is masked.
    softcap > 0 caps the scores at softcap * tanh(q·k / softcap) (Gemma 2); it needs scale 1 (a query
    scaled beforehand, as Gemma's is), since ggml's fused kernel caps scaled scores and llama.cpp's matmul
    path raw ones. sinks (F32, one per query head) join each head's softmax as a logit without a value
    (gpt-oss). value_projection (v_head_dim, out_dim, heads) maps each head's output through its own
    matrix, giving (out_dim, heads, n): multi-head latent attention's attn_v_b, applied where llama.cpp
    applies it (its v_mla), to the same layout, so that the products round alike.
    """
    if softcap and scale != 1.0:
        raise ValueError(f"attention: a softcap ({softcap}) needs scale 1, got {scale}: scale the query instead")
    if key is not None and value is not None:
        if query.ne[0] != key.ne[0] or key.ne[1] != value.ne[1] or key.ne[2] != value.ne[2]:
            raise ShapeError(f"attention: query {query.shape}, key {key.shape}, value {value.shape}")
    if cache is None:
        if key is None or value is None:
            raise ValueError("attention without a cache needs the key and the value")
        return _attend(ctx, query, key, value, None, scale, False, softcap, sinks, value_projection)

    stored = key is not None and value is not None
    if stored:
        key_rotation, value_rotation = cache.rotations(ctx, key.ne[0], value.ne[0])
        if key_rotation is not None:
            query, key = query.hadamard(key_rotation), key.hadamard(key_rotation)
        if value_rotation is not None:
            value = value.hadamard(value_rotation)
        cache.put(ctx, key, value)
    segments = cache.get(ctx)
    if not stored:  # the cache holds them already, rotated as they were stored
        v_dim = segments[0].value.ne[1 if cache.config.permuted_v else 0]
        key_rotation, value_rotation = cache.rotations(ctx, query.ne[0], v_dim)
        if key_rotation is not None:
            query = query.hadamard(key_rotation)
    permuted_v = cache.config.permuted_v
    out = None
    for segment in segments:
        rows = query if len(segments) == 1 else _rows(query, segment.begin, segment.count)
        attend = _attend_apart if segment.apart else _attend
        part = attend(ctx, rows, segment.key, segment.value, segment.mask, scale, permuted_v, softcap, sinks,
                      value_projection)
        out = part if out is None else out.concat(part, 2)
    return out.hadamard(value_rotation) if value_rotation is not None else out


def _rows(x: Tensor, begin: int, count: int) -> Tensor:
    """Rows begin..begin+count of x (d, heads, n) along its last dimension."""
    return x.view(x.strides[2] * begin, (x.ne[0], x.ne[1], count))


def _attend_apart(
    ctx: Context, query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float, permuted_v: bool,
    softcap: float, sinks: Tensor | None = None, value_projection: Tensor | None = None,
) -> Tensor:
    """Rows (of one sequence, or one each of several: a stacked span), each computed as a one-row batch computes
    it (_attend), all in the same products: each row in a slice of dimension 3 of its own, with its own history
    there (key and value) and its mask, which ggml's matmul takes one row at a time (the dot product a one-row
    batch takes, not the many-row kernel), as its fused kernel does (a row of fewer than 512 history cells)."""
    d, heads, n = query.ne[0], query.ne[1], query.ne[2]
    if ctx.backend.flash_attention:
        q = query.packed().reshape(d, heads, 1, n).permute(0, 2, 1, 3)  # (head_dim, 1, heads, n)
        out = _project(_flash(q, key, value, mask.reshape(mask.ne[0], 1, 1, n), scale, softcap, sinks),
                       value_projection)  # (v_head_dim, heads, 1, n): each row's projection a product of its own
        return out.reshape(out.ne[0], heads, n)
    q = query.packed().reshape(d, 1, heads, n)
    k = key.permute(0, 2, 1, 3)  # (head_dim, history, kv_heads)
    if not permuted_v:
        value = value.permute(1, 2, 0, 3).contiguous()  # (history, v_head_dim, kv_heads)
    scores = k.matmul_full_precision(q)  # (history, 1, heads, n)
    if softcap:
        scores = scores.scale(1.0 / softcap).tanh().scale(softcap)
    scores = scores.softmax(mask.reshape(mask.ne[0], 1, 1, n), scale, sinks)
    out = value.matmul(scores)  # (v_head_dim, 1, heads, n)
    if value_projection is not None:
        out = value_projection.matmul(out)
    return out.permute(0, 2, 1, 3).contiguous().reshape(out.ne[0], heads, n)


def _attend(
    ctx: Context, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float, permuted_v: bool,
    softcap: float, sinks: Tensor | None = None, value_projection: Tensor | None = None,
) -> Tensor:
    """One sequence: query (head_dim, heads, n) against its history -> (v_head_dim, heads, n)."""
    q = query.permute(0, 2, 1, 3)  # (head_dim, n, heads)
    if ctx.backend.flash_attention:
        if permuted_v:
            raise ValueError("flash attention needs a cache that stores V untransposed (permuted_v=False)")
        return _project(_flash(q, key, value, mask, scale, softcap, sinks), value_projection)

    k = key.permute(0, 2, 1, 3)  # (head_dim, history, kv_heads)
    if not permuted_v:
        value = value.permute(1, 2, 0, 3).contiguous()  # (history, v_head_dim, kv_heads)
    scores = k.matmul_full_precision(q)  # (history, n, heads)
    if softcap:
        scores = scores.scale(1.0 / softcap).tanh().scale(softcap)
    scores = scores.softmax(mask, scale, sinks)
    out = value.matmul(scores)  # (v_head_dim, n, heads)
    if value_projection is not None:
        out = value_projection.matmul(out)
    return out.permute(0, 2, 1, 3).contiguous()


def _flash(q: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float, softcap: float,
           sinks: Tensor | None) -> Tensor:
    """ggml's fused kernel: q (head_dim, n_q, heads[, m]) against key/value (head_dim, kv_heads, history[, m])
    -> (v_head_dim, heads, n_q[, m])."""
    if mask is not None and mask.dtype != DType.F16:
        mask = mask.cast(DType.F16)
    k, v = key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)  # (head_dim, history, kv_heads[, m])
    # An encoder's keys and values come straight from the layer (no cache), in F32: llama.cpp casts them
    # to F16 for the fused kernel, so do we (0 instead of 6e-4 apart on BERT embeddings)
    if k.dtype == DType.F32:
        k = k.cast(DType.F16)
    if v.dtype == DType.F32:
        v = v.cast(DType.F16)
    return q.flash_attention(k, v, mask, scale, softcap, sinks)


def _project(out: Tensor, value_projection: Tensor | None) -> Tensor:
    """(v_head_dim, heads, n[, m]) through each head's own matrix, where the model has one (MLA's attn_v_b)."""
    if value_projection is None:
        return out
    return value_projection.matmul(out.permute(0, 2, 1, 3)).permute(0, 2, 1, 3).contiguous()
