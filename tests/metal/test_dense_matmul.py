"""The fused matmul body on unquantized weights (`dense_matmul`): the MTP head kept in bf16, unquantized models."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from _tol import assert_close, out_key
from test_q4_matmul import PRE_KINDS, make_pre, needs_gpu, rows_of

from lattice_mlx.metal.q4_matmul import (
    dense_matmul,
    dense_matmul_kernel,
    dense_matmul_ref,
    dense_supported,
    prologue_ref,
)
from lattice_mlx.models.layers import project


def weight(N, K, dtype, seed):
    return mx.array(np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05).astype(dtype)


def numpy_dense(x, w):
    """A float64 spec (no fp32 matmul that CUDA might run on TF32)."""
    return (np.array(x.astype(mx.float32), dtype=np.float64) @ np.array(w.astype(mx.float32), dtype=np.float64).T
            ).astype(np.float32)


# --- reference and dispatch: these run everywhere, the CPU included ---


@pytest.mark.parametrize("kind", PRE_KINDS, ids=str)
@pytest.mark.parametrize("res", [False, True], ids=["plain", "residual"])
def test_dispatch_plain_ops_equal_the_ref(kind, res):
    """The non-kernel path (prologue's plain ops, x @ w.T, add) against the spec, fp32 on the CPU."""
    with mx.stream(mx.cpu):
        x, pre = make_pre(kind, 3, 256, mx.float32, seed=3)
        w = weight(40, 256, mx.float32, 4)
        r = mx.array(np.random.default_rng(5).standard_normal((1, 3, 40)).astype(np.float32)) if res else None
        ref = dense_matmul_ref(x, w, pre=pre, residual=r)
        got = dense_matmul(x, w, pre=pre, residual=r)
        spec = numpy_dense(prologue_ref(pre, x), w) + (np.array(r) if res else 0)
    assert got.shape == ref.shape == (1, 3, 40)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(ref), spec, rtol=1e-4, atol=1e-4)


def test_project_routes_bias_free_linears_and_keeps_the_rest():
    """project() sends a bias-free nn.Linear through dense_matmul (same result as the layer) and leaves a linear with
    a bias to its own call."""
    x, pre = make_pre("rms", 2, 64, mx.float32, seed=9)
    lin = nn.Linear(64, 24, bias=False)
    expect = lin(prologue_ref(pre, x))
    np.testing.assert_allclose(np.array(project(lin, x, pre=pre)), np.array(expect), rtol=1e-5, atol=1e-5)
    biased = nn.Linear(64, 24, bias=True)
    np.testing.assert_allclose(np.array(project(biased, x, pre=pre)), np.array(biased(prologue_ref(pre, x))),
                               rtol=1e-5, atol=1e-5)


def test_supported_cases():
    x, pre = make_pre("rms", 2, 256, mx.bfloat16)
    w = weight(64, 256, mx.bfloat16, 0)
    assert dense_supported(x, w, pre)
    assert not dense_supported(x, w.astype(mx.float32), pre)  # the weight in another dtype than x
    assert not dense_supported(x, weight(64, 288, mx.bfloat16, 0))  # K does not match x
    assert not dense_supported(mx.zeros((1, 9, 256), dtype=mx.bfloat16), w)  # more rows than a verify
    assert not dense_supported(x, w[:63], glu=True)  # no [gate | up] halves
    assert dense_supported(x, w, glu=True)


# --- the GPU kernel against the spec ---

# (M, N, K, dtype): N odd, K with fewer chunks than lanes and with a ragged last pass (3584)
CASES = {
    "M1-bf16": (1, 1003, 1024, mx.bfloat16),
    "M3-bf16-K3584": (3, 1003, 3584, mx.bfloat16),
    "M8-bf16-K256": (8, 1002, 256, mx.bfloat16),
    "M2-fp16": (2, 257, 512, mx.float16),
    "M4-fp32": (4, 257, 2048, mx.float32),
}


@needs_gpu
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_matches_spec(case):
    M, N, K, dtype = CASES[case]
    x, _ = make_pre(None, M, K, dtype, seed=len(case))
    w = weight(N, K, dtype, len(case) + 1)
    y = dense_matmul_kernel(x, w, init_value=float("nan"))
    assert y.shape == (1, M, N) and y.dtype == dtype
    assert_close(y, mx.array(numpy_dense(x, w)), out_key(dtype), case)


FUSED = {f"{k}-M{M}-{d}": (k, M, K * (4 if k == "gated_rms" else 1), dt)
         for k in ["rms", "swiglu", "gate", "gated_rms"]
         for (M, K, d, dt) in [(1, 1024, "bf16", mx.bfloat16), (4, 512, "fp16", mx.float16), (8, 256, "fp32", mx.float32)]}


@needs_gpu
@pytest.mark.parametrize("case", list(FUSED), ids=list(FUSED))
@pytest.mark.parametrize("res", [False, True], ids=["plain", "residual"])
def test_fused_kernel_matches_ref(case, res):
    kind, M, K, dtype = FUSED[case]
    x, pre = make_pre(kind, M, K, dtype, seed=len(case))
    w = weight(1003, K, dtype, len(case) + 1)
    r = mx.array(np.random.default_rng(2).standard_normal((1, M, 1003)).astype(np.float32)).astype(dtype) \
        if res else None
    y = dense_matmul_kernel(x, w, pre=pre, residual=r, init_value=float("nan"))
    with mx.stream(mx.cpu):  # the spec in exact fp32 matmuls
        ref = dense_matmul_ref(x, w, pre=pre, residual=r)
    assert y.shape == ref.shape == (1, M, 1003) and y.dtype == dtype
    assert_close(y, ref, out_key(dtype), case)


@needs_gpu
@pytest.mark.parametrize("case", ["none-M1-bf16", "rms-M4-fp16", "rms-M8-fp32", "none-M3-bf16-K3584"])
def test_glu_kernel_matches_ref(case):
    kind, M, d = case.split("-")[:3]
    kind = None if kind == "none" else kind
    M, dtype = int(M[1:]), {"bf16": mx.bfloat16, "fp16": mx.float16, "fp32": mx.float32}[d]
    K = 3584 if case.endswith("K3584") else 1024
    x, pre = make_pre(kind, M, K, dtype, seed=len(case))
    w = weight(2 * 1003, K, dtype, len(case) + 1)
    y = dense_matmul_kernel(x, w, pre=pre, glu=True, init_value=float("nan"))
    with mx.stream(mx.cpu):
        ref = dense_matmul_ref(x, w, pre=pre, glu=True)
    assert y.shape == ref.shape == (1, M, 1003) and y.dtype == dtype
    assert_close(y, ref, out_key(dtype), case)


@needs_gpu
@pytest.mark.parametrize("rows", [1, 2, 8], ids=lambda r: f"R={r}")
def test_kernel_any_rows_per_block(rows):
    x, _ = make_pre(None, 3, 1024, mx.float32, seed=rows)
    w = weight(1001, 1024, mx.float32, rows + 1)
    y = dense_matmul_kernel(x, w, rows=rows, init_value=float("nan"))
    assert_close(y, mx.array(numpy_dense(x, w)), "fp32", f"R={rows}")


@needs_gpu
@pytest.mark.parametrize("kind", PRE_KINDS, ids=str)
@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
def test_fused_kernel_rows_are_batch_invariant(kind, glu):
    """Row m of an 8-row call is bitwise the 1-row call on that row: a verify row equals a decode step."""
    if glu and kind not in (None, "rms"):
        pytest.skip("the model fuses SwiGLU only after no prologue or the RMSNorm")
    K = 2048
    x, pre = make_pre(kind, 8, K, mx.bfloat16, seed=13)
    w = weight(2 * 1003 if glu else 1003, K, mx.bfloat16, 14)
    y = dense_matmul_kernel(x, w, pre=pre, glu=glu)
    for m in range(8):
        xm, pm = rows_of(kind, x, pre, m, m + 1)
        assert mx.array_equal(y[:, m : m + 1], dense_matmul_kernel(xm, w, pre=pm, glu=glu)), (kind, m)


@needs_gpu
@pytest.mark.parametrize("M", [1, 4, 9])
def test_dispatch_matches_matmul(M):
    x, _ = make_pre(None, M, 1024, mx.bfloat16, seed=M)
    w = weight(512, 1024, mx.bfloat16, M + 1)
    assert_close(dense_matmul(x, w), x @ w.T, "bfloat16", f"M={M}")


@needs_gpu
def test_dispatch_leaves_large_weights_to_the_plain_ops(monkeypatch):
    """Above DENSE_MAX_WEIGHTS (a bf16 lm_head) cuBLAS reads faster than the kernel: the dispatcher runs the ops."""
    from lattice_mlx.metal import q4_matmul as q4_module

    x, pre = make_pre("rms", 2, 1024, mx.bfloat16, seed=3)
    w = weight(512, 1024, mx.bfloat16, 4)
    launched = []
    monkeypatch.setattr(q4_module, "dense_matmul_kernel", lambda *a, **k: launched.append(1) or dense_matmul_kernel(*a, **k))
    monkeypatch.setattr(q4_module, "DENSE_MAX_WEIGHTS", w.size - 1)
    assert_close(q4_module.dense_matmul(x, w, pre=pre), prologue_ref(pre, x) @ w.T, "bfloat16", "ops")
    assert not launched
    monkeypatch.setattr(q4_module, "DENSE_MAX_WEIGHTS", w.size)
    q4_module.dense_matmul(x, w, pre=pre)
    assert launched


@needs_gpu
@pytest.mark.parametrize("kind", [None, "rms", "gated_rms"], ids=str)
def test_sixteen_rows_match_the_spec_and_each_row_its_one_row_call(kind):
    """LATTICE_FUSED_ROWS=16 on unquantized weights (the MTP head's draft step over a batch of up to 16 sequences):
    a call of 13 rows in the variant holding 16 against the spec, each row bitwise its one-row call."""
    from lattice_mlx import settings

    x, pre = make_pre(kind, 13, 1024, mx.float32, seed=61)
    w = weight(96, 1024, mx.float32, 62)
    with settings.override(fused_rows="16"):
        y = dense_matmul_kernel(x, w, pre=pre, init_value=float("nan"))
        with mx.stream(mx.cpu):
            ref = dense_matmul_ref(x, w, pre=pre)
        assert_close(y, ref, out_key(mx.float32), str(kind))
        for m in (0, 8, 12):
            x1, p1 = rows_of(kind, x, pre, m, m + 1)
            assert mx.array_equal(y[:, m : m + 1], dense_matmul_kernel(x1, w, pre=p1)), (kind, m)
