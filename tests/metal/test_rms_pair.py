"""The MTP head's two input norms and their concatenation in one kernel (metal/rms_pair.py) against MLX's ops."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from _tol import assert_close, out_key

from lattice_mlx.metal.rms_pair import rms_pair, rms_pair_kernel, rms_pair_ref, supported

needs_gpu = pytest.mark.kernels  # a GPU backend, or the CPU render (tests/conftest.py)


def case(shape, dtype, seed=0, norms_n=2):
    rng = np.random.default_rng(seed)
    H = shape[-1]
    norms = []
    for _ in range(norms_n):
        n = nn.RMSNorm(H, eps=1e-6)
        n.weight = mx.array(rng.normal(1.0, 0.3, H).astype(np.float32)).astype(dtype)
        norms.append(n)
    e = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    h = mx.array((rng.standard_normal(shape) * 7).astype(np.float32)).astype(dtype)
    return e, h, *norms


def pre_case(shape, dtype, seed=0):
    """A draft step's inputs: the head's output before its final norm (large, as a residual stream grows), that
    norm, and the pair's two norms."""
    e, h, ne, nh, pre = case(shape, dtype, seed, norms_n=3)
    return e, (h.astype(mx.float32) * 5).astype(dtype), ne, nh, pre


def test_dispatch_is_the_reference_off_the_gpu(monkeypatch):
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    e, h, ne, nh = case((1, 3, 64), mx.float32)
    out = rms_pair(e, h, ne, nh)
    assert out.shape == (1, 3, 128)
    assert mx.array_equal(out, mx.concatenate([ne(e), nh(h)], axis=-1))
    e, h, ne, nh, pre = pre_case((1, 3, 64), mx.float32)
    assert mx.array_equal(rms_pair(e, h, ne, nh, pre), mx.concatenate([ne(e), nh(pre(h))], axis=-1))


def test_supported_refuses_what_the_body_would_misread():
    e, h, ne, nh = case((1, 2, 64), mx.bfloat16)
    assert supported(e, h, ne, nh)
    assert not supported(e, h[:, :1], ne, nh)
    assert not supported(e, h.astype(mx.float32), ne, nh)
    assert not supported(e[..., :48], h[..., :48], ne, nh)  # the weights are 64 wide
    nh.eps = 1e-5
    assert not supported(e, h, ne, nh)
    e, h, ne, nh, pre = pre_case((1, 2, 64), mx.bfloat16)
    assert supported(e, h, ne, nh, pre)
    pre.weight = pre.weight.astype(mx.float32)
    assert not supported(e, h, ne, nh, pre)
    pre.weight = mx.ones((32,), dtype=mx.bfloat16)
    assert not supported(e, h, ne, nh, pre)


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 4, 1024), (2, 3, 2560)])
def test_kernel_matches_ref(shape, dtype):
    e, h, ne, nh = case(shape, dtype, seed=shape[-1])
    got = rms_pair_kernel(e, h, ne, nh, init_value=float("nan"))
    assert got.shape == (*shape[:-1], 2 * shape[-1]) and got.dtype == dtype
    assert_close(got, rms_pair_ref(e, h, ne, nh), out_key(dtype), f"rms_pair {shape}")


@needs_gpu
def test_kernel_rows_equal_single_row_calls():
    e, h, ne, nh = case((1, 5, 1024), mx.bfloat16, seed=3)
    whole = rms_pair_kernel(e, h, ne, nh)
    for t in range(5):
        assert mx.array_equal(whole[:, t : t + 1], rms_pair_kernel(e[:, t : t + 1], h[:, t : t + 1], ne, nh))


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 4, 1024), (2, 3, 2560)])
def test_pre_kernel_matches_ref(shape, dtype):
    e, h, ne, nh, pre = pre_case(shape, dtype, seed=shape[-1] + 1)
    got = rms_pair_kernel(e, h, ne, nh, pre, init_value=float("nan"))
    assert got.shape == (*shape[:-1], 2 * shape[-1]) and got.dtype == dtype
    assert_close(got, rms_pair_ref(e, h, ne, nh, pre), out_key(dtype), f"rms_pair pre {shape}")
    # the e half does not see the pre-norm: the plain kernel's, bitwise
    H = shape[-1]
    assert mx.array_equal(got[..., :H], rms_pair_kernel(e, h, ne, nh)[..., :H])


@needs_gpu
def test_pre_kernel_rows_equal_single_row_calls():
    e, h, ne, nh, pre = pre_case((1, 5, 1024), mx.bfloat16, seed=4)
    whole = rms_pair_kernel(e, h, ne, nh, pre)
    for t in range(5):
        assert mx.array_equal(whole[:, t : t + 1], rms_pair_kernel(e[:, t : t + 1], h[:, t : t + 1], ne, nh, pre))
