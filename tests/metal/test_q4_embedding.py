"""The one-launch 4-bit embedding lookup (metal/q4_embedding.py) against MLX's QuantizedEmbedding: bitwise."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from lattice_mlx.metal.q4_embedding import q4_embedding, q4_embedding_kernel, rounding_for, supported
from lattice_mlx.models.layers import Q4Embedding, route_quantized

needs_gpu = pytest.mark.kernels  # a GPU backend, or the CPU render (tests/conftest.py)


def table(V, K, group_size, dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((V, K)).astype(np.float32) * 0.5).astype(dtype)
    return mx.quantize(w, group_size=group_size, bits=4)


def mlx_lookup(ids, w, s, b, group_size):
    return mx.dequantize(w[ids], scales=s[ids], biases=b[ids], group_size=group_size, bits=4)


def test_dispatch_is_mlx_lookup_off_the_gpu(monkeypatch):
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    w, s, b = table(50, 64, 32, mx.float32)
    ids = mx.array([[3, 49, 3, 0]])
    assert mx.array_equal(q4_embedding(ids, w, s, b, group_size=32, bits=4), mlx_lookup(ids, w, s, b, 32))


def test_supported_refuses_what_the_body_would_misread():
    w, s, b = table(50, 64, 32, mx.bfloat16)
    ids = mx.array([1, 2])
    assert supported(ids, w, s, b, 32, 4, "affine")
    assert not supported(ids, w, s, None, 32, 4, "affine")
    assert not supported(ids, w, s, b, 32, 8, "affine")
    assert not supported(ids, w, s, b.astype(mx.float32), 32, 4, "affine")
    assert not supported(ids, w, s, b, 64, 4, "affine")  # scales say group 32
    assert not supported(ids.astype(mx.float32), w, s, b, 32, 4, "affine")
    assert not supported(mx.zeros((0,), dtype=mx.int32), w, s, b, 32, 4, "affine")


def test_model_embedding_takes_the_dispatcher():
    emb = nn.Embedding(40, 64)
    model = nn.Sequential(emb)
    nn.quantize(model, group_size=64, bits=4)
    route_quantized(model)
    q = model.layers[0]
    assert type(q) is Q4Embedding
    ids = mx.array([[7, 0, 39]])
    assert mx.array_equal(q(ids), nn.QuantizedEmbedding.__call__(q, ids))


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("shape", [(1,), (1, 4), (2, 3), (37,)])
def test_kernel_is_bitwise_mlx_lookup(dtype, group_size, shape):
    assert rounding_for(dtype) is not None, "neither rounding form of the body matches MLX's dequantize here"
    V, K = 300, 1024 if group_size == 128 else 256
    w, s, b = table(V, K, group_size, dtype, seed=group_size)
    rng = np.random.default_rng(len(shape))
    ids = mx.array(rng.integers(0, V, size=shape).astype(np.int32))
    ids = mx.where(mx.arange(ids.size).reshape(shape) == 0, V - 1, ids)  # the last row too
    got = q4_embedding_kernel(ids, w, s, b, group_size=group_size, init_value=float("nan"))
    expect = mlx_lookup(ids, w, s, b, group_size)
    assert got.shape == (*shape, K) and got.dtype == dtype
    assert mx.array_equal(got, expect), f"max |diff| {mx.abs(got - expect).max().item():.3e}"


@needs_gpu
def test_kernel_takes_unsigned_ids():
    w, s, b = table(64, 128, 64, mx.bfloat16)
    ids = mx.array([5, 63, 0], dtype=mx.uint32)
    assert mx.array_equal(q4_embedding_kernel(ids, w, s, b, group_size=64), mlx_lookup(ids, w, s, b, 64))
