"""The greedy argmax kernel (metal/argmax.py) against MLX's argmax: the first maximum's index over the last axis."""

import mlx.core as mx
import numpy as np
import pytest

from lattice_mlx.metal.argmax import argmax, argmax_kernel, argmax_ref, supported

needs_gpu = pytest.mark.kernels  # a GPU backend, or the CPU render (tests/conftest.py)


def logits(shape, dtype, seed=0, ties=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * 4
    if ties:  # the row's maximum planted at several places, the first of them anywhere (start, middle, last chunk)
        x = np.round(x)
        flat = x.reshape(-1, shape[-1])
        for r in range(flat.shape[0]):
            at = np.sort(rng.choice(shape[-1], size=3, replace=False))
            flat[r, at] = flat[r].max() + 1
    return mx.array(x).astype(dtype)


def test_dispatch_is_the_reference_off_the_gpu(monkeypatch):
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    x = logits((2, 3, 64), mx.float32)
    assert mx.array_equal(argmax(x), argmax_ref(x))
    assert argmax(x).dtype == mx.uint32 and argmax(x).shape == (2, 3)


def test_supported_shapes():
    assert supported(mx.zeros((1, 1, 248320), dtype=mx.bfloat16))
    assert supported(mx.zeros((8,), dtype=mx.float16))
    assert not supported(mx.zeros((4, 100), dtype=mx.float32))  # not a multiple of 8
    assert not supported(mx.zeros((4, 64), dtype=mx.int32))
    assert not supported(mx.zeros((70000, 8), dtype=mx.float32))  # more rows than CUDA's grid y


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("shape", [(8,), (1, 1, 248320), (4, 248320), (1, 5, 1000), (3, 32768), (2, 8192 * 4 + 8)])
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_matches_mlx_argmax(shape, dtype, ties):
    x = logits(shape, dtype, seed=len(shape) + shape[-1], ties=ties)
    got, want = argmax_kernel(x), argmax_ref(x)
    assert got.dtype == mx.uint32 and got.shape == want.shape
    assert mx.array_equal(got, want), (got, want)
    # and the first maximum as numpy reads it on the host
    ref = np.argmax(np.array(x.astype(mx.float32)), axis=-1)
    assert np.array_equal(np.array(got), ref)


@needs_gpu
def test_kernel_rows_of_minus_infinity_and_a_single_maximum_at_the_end():
    V = 4096
    x = np.full((3, V), -np.inf, dtype=np.float32)
    x[1, V - 1] = -1e30
    x[2, :] = -5.0
    x[2, V - 1] = -4.0
    got = np.array(argmax_kernel(mx.array(x).astype(mx.bfloat16)))
    assert got.tolist() == [0, V - 1, V - 1]


@needs_gpu
def test_kernel_inside_a_compiled_function_and_on_a_view():
    x = logits((1, 4, 32768), mx.bfloat16, seed=3)
    f = mx.compile(lambda a: argmax(a[0, 1:3]))
    assert mx.array_equal(f(x), argmax_ref(x[0, 1:3]))
