"""Every op the models use, built into a graph, computed on the CPU through ggml_backend_sched, and
compared with numpy. Shapes are given in ggml order; numpy arrays have the reversed shape."""

from __future__ import annotations

import numpy as np
import pytest

from ollama_engine import ggml
from ollama_engine.ml import Backend, DType, RopeOptions, ShapeError

rng = np.random.default_rng(1234)


@pytest.fixture(scope="module")
def backend():
    with Backend(None, num_threads=2) as b:
        yield b


def compute(backend, build):
    """Build a graph with build(ctx) -> output tensor, compute it, return the output as numpy."""
    with backend.new_context() as ctx:
        out = build(ctx)
        ctx.compute(out)
        return out.numpy()


def randn(*numpy_shape, dtype=np.float32):
    return rng.standard_normal(numpy_shape).astype(dtype)


FLOAT_TYPES = [(DType.F32, np.float32, 1e-5), (DType.F16, np.float16, 2e-2)]


# ---------------------------------------------------------------- elementwise


@pytest.mark.parametrize("dtype,np_type,tol", FLOAT_TYPES)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_broadcast(backend, dtype, np_type, tol, op):
    a = randn(3, 5, 8)
    b = randn(1, 5, 8) + (3.0 if op == "div" else 0.0)
    got = compute(backend, lambda ctx: getattr(ctx.from_numpy(a, dtype), op)(ctx.from_numpy(b)))
    want = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[op](
        a.astype(np_type).astype(np.float32), b
    )
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=tol, atol=tol)


def test_scale(backend):
    a = randn(4, 16)
    np.testing.assert_allclose(compute(backend, lambda ctx: ctx.from_numpy(a).scale(0.25)), a * 0.25, rtol=1e-6)


@pytest.mark.parametrize(
    "name,reference",
    [
        ("silu", lambda x: x / (1 + np.exp(-x))),
        ("gelu", lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))),
        ("relu", lambda x: np.maximum(x, 0)),
        ("sigmoid", lambda x: 1 / (1 + np.exp(-x))),
        ("tanh", np.tanh),
        ("exp", np.exp),
        ("sqr", np.square),
        ("neg", np.negative),
    ],
)
def test_unary(backend, name, reference):
    x = randn(6, 32)
    got = compute(backend, lambda ctx: getattr(ctx.from_numpy(x), name)())
    np.testing.assert_allclose(got, reference(x), rtol=2e-3, atol=2e-3)


def test_sqrt_and_clamp(backend):
    x = np.abs(randn(3, 8)) + 0.1
    np.testing.assert_allclose(compute(backend, lambda ctx: ctx.from_numpy(x).sqrt()), np.sqrt(x), rtol=1e-5)
    y = randn(3, 8)
    np.testing.assert_allclose(compute(backend, lambda ctx: ctx.from_numpy(y).clamp(-0.5, 0.5)), np.clip(y, -0.5, 0.5))


@pytest.mark.parametrize("name,act", [("silu", lambda x: x / (1 + np.exp(-x))), ("gelu", None)])
def test_gated_activations(backend, name, act):
    gate, up = randn(5, 64), randn(5, 64)
    if act is None:
        act = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))  # noqa: E731
    got = compute(backend, lambda ctx: getattr(ctx.from_numpy(gate), name)(ctx.from_numpy(up)))
    np.testing.assert_allclose(got, act(gate) * up, rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------- matmul


@pytest.mark.parametrize("dtype,np_type,tol", FLOAT_TYPES)
def test_matmul(backend, dtype, np_type, tol):
    w, x = randn(48, 64), randn(7, 64)  # ggml: w (64, 48), x (64, 7) -> (48, 7)
    got = compute(backend, lambda ctx: ctx.from_numpy(w, dtype).matmul(ctx.from_numpy(x)))
    want = x @ w.astype(np_type).astype(np.float32).T
    np.testing.assert_allclose(got, want, rtol=tol * 5, atol=tol * 5)


@pytest.mark.parametrize("qtype,tol", [(DType.Q8_0, 0.02), (DType.Q4_0, 0.15)])
def test_matmul_quantized(backend, qtype, tol):
    w, x = randn(32, 128), randn(5, 128)
    blocks = ggml.quantize(qtype, w)
    got = compute(backend, lambda ctx: ctx.from_bytes(qtype, blocks, 128, 32).matmul(ctx.from_numpy(x)))
    want = x @ w.T
    assert np.abs(got - want).max() / np.abs(want).max() < tol


def test_matmul_batched_broadcast(backend):
    a, b = randn(2, 16, 8), randn(4, 5, 8)  # ggml a (8, 16, 2), b (8, 5, 4): b's batch 4 is 2 x a's
    got = compute(backend, lambda ctx: ctx.from_numpy(a).matmul(ctx.from_numpy(b)))
    want = np.stack([b[i] @ a[i // 2].T for i in range(4)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_matmul_id(backend):
    experts = randn(4, 6, 16)  # ggml (16, 6, 4): 4 experts of 16 -> 6
    x = randn(3, 1, 16)  # 3 tokens, 1 row each, broadcast to the used experts
    ids = np.array([[0, 3], [2, 2], [1, 0]], dtype=np.int32)  # (tokens, used)
    got = compute(
        backend, lambda ctx: ctx.from_numpy(experts).matmul_id(ctx.from_numpy(x), ctx.from_numpy(ids))
    )
    want = np.stack([[experts[e] @ x[t, 0] for e in ids[t]] for t in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_matmul_shape_error_is_python(backend):
    with backend.new_context() as ctx, pytest.raises(ShapeError):
        ctx.from_numpy(randn(4, 8)).matmul(ctx.from_numpy(randn(4, 9)))


# ---------------------------------------------------------------- rows


@pytest.mark.parametrize("dtype,np_type,tol", FLOAT_TYPES + [(DType.Q8_0, None, 0.02)])
def test_get_rows(backend, dtype, np_type, tol):
    table = randn(10, 32)
    idx = np.array([3, 0, 9, 3], dtype=np.int32)

    def build(ctx):
        if np_type is None:
            source = ctx.from_bytes(dtype, ggml.quantize(dtype, table), 32, 10)
        else:
            source = ctx.from_numpy(table, dtype)
        return source.rows(ctx.from_numpy(idx))

    np.testing.assert_allclose(compute(backend, build), table[idx], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(DType.F32, 0), (DType.F16, 1e-3)])
def test_set_rows(backend, dtype, tol):
    dest = np.zeros((6, 8), dtype=np.float32)
    src = randn(2, 8)
    idx = np.array([4, 1], dtype=np.int64)
    got = compute(
        backend, lambda ctx: ctx.from_numpy(dest, dtype).set_rows(ctx.from_numpy(src), ctx.from_numpy(idx))
    )
    want = dest.copy()
    want[idx] = src
    np.testing.assert_allclose(got.astype(np.float32), want, atol=tol)


# ---------------------------------------------------------------- norms


def test_rms_norm(backend):
    x, w = randn(4, 64), randn(64)
    got = compute(backend, lambda ctx: ctx.from_numpy(x).rms_norm(ctx.from_numpy(w), 1e-5))
    want = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_layer_norm(backend):
    x, w, b = randn(4, 64), randn(64), randn(64)
    got = compute(backend, lambda ctx: ctx.from_numpy(x).layer_norm(ctx.from_numpy(w), ctx.from_numpy(b), 1e-5))
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- rope


def rope_reference(x, positions, dims, base, neox, factors=None):
    """x numpy (tokens, heads, head_dim)."""
    out = x.copy()
    half = dims // 2
    theta = base ** (-np.arange(half) * 2.0 / dims)
    if factors is not None:
        theta = theta / factors[:half]
    angles = positions[:, None].astype(np.float64) * theta[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    if neox:
        a, b = x[..., :half], x[..., half:dims]
        out[..., :half] = a * cos - b * sin
        out[..., half:dims] = a * sin + b * cos
    else:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2] = a * cos - b * sin
        out[..., 1:dims:2] = a * sin + b * cos
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("with_factors", [False, True])
def test_rope(backend, neox, with_factors):
    x = randn(5, 3, 16)  # ggml (16 head_dim, 3 heads, 5 tokens)
    positions = np.array([0, 1, 2, 7, 100], dtype=np.int32)
    factors = (1.0 + rng.random(8)).astype(np.float32) if with_factors else None

    def build(ctx):
        f = ctx.from_numpy(factors) if factors is not None else None
        return ctx.from_numpy(x).rope(ctx.from_numpy(positions), 16, 10000.0, factors=f, options=RopeOptions(neox=neox))

    want = rope_reference(x, positions, 16, 10000.0, neox, factors)
    np.testing.assert_allclose(compute(backend, build), want, rtol=1e-4, atol=1e-4)


def test_rope_partial_dims(backend):
    x = randn(4, 2, 32)
    positions = np.arange(4, dtype=np.int32) * 3
    got = compute(backend, lambda ctx: ctx.from_numpy(x).rope(ctx.from_numpy(positions), 16, 500.0))
    np.testing.assert_allclose(got, rope_reference(x, positions, 16, 500.0, False), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- softmax and attention


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def causal_mask(n_q, n_kv, pad_to=1):
    rows = -(-n_q // pad_to) * pad_to
    mask = np.full((rows, n_kv), -np.inf, dtype=np.float32)
    for i in range(n_q):
        mask[i, : n_kv - n_q + i + 1] = 0
    return mask


def test_softmax_with_mask_and_scale(backend):
    scores = randn(2, 4, 6)  # heads, queries, keys
    mask = causal_mask(4, 6)
    got = compute(backend, lambda ctx: ctx.from_numpy(scores).softmax(ctx.from_numpy(mask), 0.5))
    np.testing.assert_allclose(got, softmax(scores * 0.5 + mask), rtol=1e-5, atol=1e-6)


def attention_reference(q, k, v, mask, scale):
    """q numpy (heads, n_q, d), k/v (kv_heads, n_kv, d) -> (n_q, heads, d)."""
    group = q.shape[0] // k.shape[0]
    out = []
    for h in range(q.shape[0]):
        weights = softmax(q[h] @ k[h // group].T * scale + mask[: q.shape[1]])
        out.append(weights @ v[h // group])
    return np.stack(out, axis=1)


def test_attention_matmul_softmax(backend):
    q, k, v = randn(4, 3, 16), randn(2, 8, 16), randn(2, 8, 16)
    mask = causal_mask(3, 8)

    def build(ctx):
        kq = ctx.from_numpy(k).matmul(ctx.from_numpy(q))  # (n_kv, n_q, heads)
        weights = kq.softmax(ctx.from_numpy(mask), 0.25)
        vt = ctx.from_numpy(v).permute(1, 0, 2, 3).contiguous()  # (n_kv, d, kv_heads)
        return vt.matmul(weights).permute(0, 2, 1, 3).contiguous()  # (d, heads, n_q)

    np.testing.assert_allclose(compute(backend, build), attention_reference(q, k, v, mask, 0.25), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_type,tol", [(DType.F16, 5e-3), (DType.F32, 5e-3)])
def test_flash_attention(backend, kv_type, tol):
    q, k, v = randn(4, 3, 16), randn(2, 8, 16), randn(2, 8, 16)
    mask = causal_mask(3, 8, pad_to=64)

    def build(ctx):
        return ctx.from_numpy(q).flash_attention(
            ctx.from_numpy(k, kv_type), ctx.from_numpy(v, kv_type), ctx.from_numpy(mask, DType.F16), 0.25
        )

    got = compute(backend, build)  # ggml (d, heads, n_q)
    np.testing.assert_allclose(got, attention_reference(q, k, v, mask, 0.25), rtol=tol, atol=tol)


# ---------------------------------------------------------------- layout ops


def test_view_reshape_permute_transpose_cont(backend):
    x = randn(2, 3, 4, 5)  # ggml (5, 4, 3, 2)
    got = compute(backend, lambda ctx: ctx.from_numpy(x).permute(1, 0, 2, 3).contiguous())
    np.testing.assert_array_equal(got, x.transpose(0, 1, 3, 2))
    got = compute(backend, lambda ctx: ctx.from_numpy(x).reshape(20, -1))
    np.testing.assert_array_equal(got, x.reshape(6, 20))
    got = compute(backend, lambda ctx: ctx.from_numpy(x[0, 0]).transpose().contiguous())
    np.testing.assert_array_equal(got, x[0, 0].T)
    rows = randn(6, 8)
    got = compute(backend, lambda ctx: ctx.from_numpy(rows).view(2 * 8 * 4, (8, 3)).contiguous())
    np.testing.assert_array_equal(got, rows[2:5])


def test_layout_errors_are_python(backend):
    with backend.new_context() as ctx:
        x = ctx.from_numpy(randn(3, 4))
        with pytest.raises(ShapeError):
            x.reshape(5, -1)
        with pytest.raises(ShapeError):
            x.view(0, (4, 4))
        with pytest.raises(ShapeError):
            x.permute(0, 0, 1, 2)
        with pytest.raises(ShapeError):
            x.concat(ctx.from_numpy(randn(2, 5)), 1)


@pytest.mark.parametrize("dtype,np_type", [(DType.F32, np.float32), (DType.F16, np.float16)])
def test_cast_and_copy(backend, dtype, np_type):
    x = randn(3, 8)
    got = compute(backend, lambda ctx: ctx.from_numpy(x).cast(dtype))
    np.testing.assert_array_equal(got, x.astype(np_type))
    got = compute(backend, lambda ctx: ctx.from_numpy(x).copy_to(ctx.empty(dtype, 8, 3)))
    np.testing.assert_array_equal(got, x.astype(np_type))


def test_concat_and_pad(backend):
    a, b = randn(2, 3), randn(2, 5)
    got = compute(backend, lambda ctx: ctx.from_numpy(a).concat(ctx.from_numpy(b), 0))
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=1))
    got = compute(backend, lambda ctx: ctx.from_numpy(a).pad(2, 1))
    np.testing.assert_array_equal(got, np.pad(a, ((0, 1), (0, 2))))


# ---------------------------------------------------------------- reductions and sorting


def test_sum_rows_and_mean(backend):
    x = randn(3, 7)
    got = compute(backend, lambda ctx: ctx.from_numpy(x).sum_rows())
    np.testing.assert_allclose(got, x.sum(-1, keepdims=True), rtol=1e-5)
    got = compute(backend, lambda ctx: ctx.from_numpy(x).mean())
    np.testing.assert_allclose(got, x.mean(-1, keepdims=True), rtol=1e-5)


def test_argsort_and_top_k(backend):
    x = rng.permutation(40).astype(np.float32).reshape(2, 20)
    got = compute(backend, lambda ctx: ctx.from_numpy(x).argsort(descending=True))
    np.testing.assert_array_equal(got, np.argsort(-x, axis=-1))
    got = compute(backend, lambda ctx: ctx.from_numpy(x).top_k(5))
    for row, idx in zip(x, got, strict=True):
        assert set(idx.tolist()) == set(np.argsort(-row)[:5].tolist())


# ---------------------------------------------------------------- devices and the bindings


def test_devices_have_a_cpu():
    from ollama_engine.ml import cpu_device, devices

    cpu = cpu_device()
    assert cpu.kind == "CPU" and cpu.library == "CPU"
    assert cpu.total_memory > 0
    assert cpu in devices()


def test_pinned_ggml_version():
    import json

    from ollama_engine.paths import REPO_ROOT

    pin = json.loads((REPO_ROOT / "vendor" / "ggml-source.json").read_text())
    assert ggml.version() == pin["ggml_version"]


def test_every_bound_function_exists():
    """Fails loudly if the pinned headers drift away from what the engine calls."""
    import re

    from ollama_engine.paths import REPO_ROOT

    used = set()
    for path in (REPO_ROOT / "ollama_engine" / "ggml").glob("*.py"):
        used.update(re.findall(r"lib\.(ggml_\w+|gguf_\w+)", path.read_text()))
    missing = sorted(name for name in used if not hasattr(ggml.lib, name))
    assert not missing, f"functions the bindings call but the compiled module lacks: {missing}"
    assert len(used) > 80
