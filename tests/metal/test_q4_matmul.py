import mlx.core as mx
import numpy as np
import pytest
from _tol import assert_close, out_key

from lattice_mlx.metal import q4_matmul as q4_module
from lattice_mlx.metal.q4_matmul import Pre, prologue_ref, q4_matmul, q4_matmul_kernel, q4_matmul_ref, quantized_matmul

needs_gpu = pytest.mark.kernels  # a GPU backend, or the CPU render (tests/conftest.py)


def make(M, N, K, group_size, dtype, *, seed=0, lead=()):
    rng = np.random.default_rng(seed)
    w_full = mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05).astype(dtype)
    w, scales, biases = mx.quantize(w_full, group_size=group_size, bits=4)
    x = mx.array(rng.standard_normal((*lead, M, K)).astype(np.float32)).astype(dtype)
    return x, w, scales, biases


def numpy_q4(x, w, scales, biases, group_size):
    """An independent float64 spec (nibble unpacking in numpy): no fp32 matmul that CUDA might run on TF32."""
    w = np.array(w).astype(np.uint64)
    q = ((w[..., None] >> (4 * np.arange(8, dtype=np.uint64))) & 0xF).reshape(w.shape[0], -1).astype(np.float64)
    s = np.repeat(np.array(scales.astype(mx.float32), dtype=np.float64), group_size, axis=-1)
    b = np.repeat(np.array(biases.astype(mx.float32), dtype=np.float64), group_size, axis=-1)
    return (np.array(x.astype(mx.float32), dtype=np.float64) @ (s * q + b).T).astype(np.float32)


# --- reference and dispatch: these run everywhere, the CPU included ---


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_ref_matches_dequantize_matmul(group_size):
    x, w, s, b = make(3, 40, 256, group_size, mx.float32)
    ref = q4_matmul_ref(x, w, s, b, group_size=group_size)
    np.testing.assert_allclose(np.array(ref), numpy_q4(x, w, s, b, group_size), rtol=2e-3, atol=2e-3)
    with mx.stream(mx.cpu):  # exact fp32 matmuls on the CPU (a CUDA fp32 matmul may use TF32)
        ref = q4_matmul_ref(x, w, s, b, group_size=group_size)
        expect = x @ mx.dequantize(w, s, b, group_size=group_size, bits=4).T
        np.testing.assert_allclose(np.array(ref), np.array(expect), rtol=1e-5, atol=1e-5)


def test_ref_matches_quantized_matmul():
    x, w, s, b = make(2, 24, 128, 64, mx.float32, lead=(1,))
    with mx.stream(mx.cpu):  # exact fp32 matmuls on the CPU (a CUDA fp32 matmul may use TF32)
        ref = q4_matmul_ref(x, w, s, b, group_size=64)
        expect = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
    assert ref.shape == (1, 2, 24)
    np.testing.assert_allclose(np.array(ref), np.array(expect), rtol=1e-4, atol=1e-4)


def test_dispatch_falls_back_when_forced(monkeypatch):
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    x, w, s, b = make(2, 16, 64, 32, mx.float32)
    y = q4_matmul(x, w, s, b, group_size=32)
    expect = quantized_matmul(x, w, s, b, group_size=32, bits=4)  # on the CPU: mx.quantized_matmul itself
    assert mx.array_equal(y, expect)


@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("M", [1, 4, 12])
def test_quantized_matmul_at_a_small_k(M, group_size):
    """K = 64 (the tiny test shapes): MLX 0.32.4's CUDA quantized matmul got rows 2+ wrong at group 64 (run 15);
    the wrapper must match the float64 spec on every backend."""
    x, w, s, b = make(M, 40, 64, group_size, mx.float32)
    y = quantized_matmul(x, w, s, b, group_size=group_size, bits=4)
    np.testing.assert_allclose(np.array(y), numpy_q4(x, w, s, b, group_size), rtol=1e-4, atol=1e-4)


def test_small_k_workaround_is_the_same_matmul(monkeypatch):
    """The workaround's dequantize-and-multiply, forced on whatever backend runs the suite."""
    monkeypatch.setattr(q4_module, "small_k_workaround", lambda x: True)
    x, w, s, b = make(5, 24, 128, 64, mx.float32)
    with mx.stream(mx.cpu):  # exact fp32 matmuls on the CPU (a CUDA fp32 matmul may use TF32)
        y = quantized_matmul(x, w, s, b, group_size=64, bits=4)
        expect = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
    np.testing.assert_allclose(np.array(y), np.array(expect), rtol=1e-5, atol=1e-5)
    x8, w8, s8, b8 = x, *mx.quantize(mx.random.normal((24, 128), key=mx.random.key(1)), group_size=64, bits=8)
    with mx.stream(mx.cpu):
        y8 = quantized_matmul(x8, w8, s8, b8, group_size=64, bits=8)
        e8 = mx.quantized_matmul(x8, w8, s8, b8, transpose=True, group_size=64, bits=8)
    np.testing.assert_allclose(np.array(y8), np.array(e8), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lead", [(16,), (4,), (2, 3)])
def test_a_batch_of_rows_is_one_quantized_matmul(monkeypatch, lead):
    """x's leading axes (a batch of sequences' steps [B, 1, K], a batched verify [B, K + 1, K]) go to MLX as one
    problem of all the rows: MLX takes them as a batch of problems, and its CUDA kernel reads the whole weight once
    per problem (docs/adr/0009, 'Batch run 3'). The product is the same."""
    x, w, s, b = make(1 if len(lead) == 1 else 4, 40, 256, 64, mx.float32, lead=lead)
    with mx.stream(mx.cpu):
        expect = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
        shapes, qmm = [], mx.quantized_matmul
        monkeypatch.setattr(mx, "quantized_matmul", lambda x, *a, **k: shapes.append(x.shape) or qmm(x, *a, **k))
        y = quantized_matmul(x, w, s, b, group_size=64, bits=4)
    assert shapes == [(x.size // 256, 256)] and y.shape == expect.shape
    np.testing.assert_allclose(np.array(y), np.array(expect), rtol=1e-5, atol=1e-5)


def test_dequant_rows_picks_the_dequantized_matmul_from_its_rows(monkeypatch):
    """LATTICE_DEQUANT_ROWS=N: from N rows on (a CUDA device, made to look present here) the weight is dequantized
    and multiplied, below N MLX's quantized matmul runs; either gives the same product. A trace key (kernel_policy)
    follows the setting; a bad value is one line naming the variable."""
    from lattice_mlx import settings
    from lattice_mlx.metal import kernel_policy

    monkeypatch.setattr(q4_module, "_cuda_gpu", lambda: True)
    calls = []
    dequantize = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(1) or dequantize(*a, **k))
    x, w, s, b = make(12, 24, 512, 64, mx.float32)
    with mx.stream(mx.cpu):
        expect = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
        for rows, dequantized in ((0, False), (9, True), (12, True), (13, False)):
            calls.clear()
            with settings.override(dequant_rows=str(rows)):
                y = quantized_matmul(x, w, s, b, group_size=64, bits=4)
                assert bool(calls) == dequantized, rows
                assert kernel_policy()[1] == rows
            np.testing.assert_allclose(np.array(y), np.array(expect), rtol=1e-5, atol=1e-5)
    with settings.override(dequant_rows="-1"), pytest.raises(ValueError, match="LATTICE_DEQUANT_ROWS"):
        kernel_policy()


def test_split_k_layout_is_the_same_product_where_it_applies(monkeypatch):
    """A weight of few outputs and many inputs re-laid as SPLIT_K weights over K (q4_matmul.SplitK): the same product
    (float32, the CPU stream), taken by `quantized_matmul` only past the fused kernel's rows and up to
    SPLIT_K_MAX_ROWS, on a CUDA device (made to look present here), with a layout made from this very weight; no
    layout for a weight of many outputs, few inputs, or a K that does not split into whole groups."""
    calls = []
    split_matmul = q4_module.split_k_matmul
    monkeypatch.setattr(q4_module, "split_k_matmul", lambda *a, **k: calls.append(1) or split_matmul(*a, **k))
    x, w, s, b = make(65, 96, 2048, 64, mx.float32, seed=3)
    with mx.stream(mx.cpu):
        split = q4_module.split_k_layout(w, s, b, group_size=64, bits=4)
        assert split is not None and split.parts == q4_module.SPLIT_K and split.w.shape == (4, 96, 2048 // 32)
        expect = np.array(mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4))
        for cuda in (False, True):
            monkeypatch.setattr(q4_module, "_cuda_gpu", lambda cuda=cuda: cuda)
            for rows in (1, 8, 9, 16, 64, 65):
                calls.clear()
                y = quantized_matmul(x[:rows][None], w, s, b, group_size=64, bits=4, split=split)
                assert bool(calls) == (cuda and 8 < rows <= 64), (cuda, rows)
                np.testing.assert_allclose(np.array(y[0]), expect[:rows], rtol=1e-4, atol=1e-4)
        calls.clear()  # the layout's parts hold the weight's own groups: the sum is the product, not just close
        np.testing.assert_allclose(np.array(split_matmul(x[:16], split, group_size=64, bits=4)), expect[:16],
                                   rtol=1e-4, atol=1e-4)
        assert q4_module.split_k_layout(*mx.quantize(mx.zeros((8192, 2048)), group_size=64, bits=4), group_size=64,
                                        bits=4) is None  # many outputs
        assert q4_module.split_k_layout(*mx.quantize(mx.zeros((96, 1024)), group_size=64, bits=4), group_size=64,
                                        bits=4) is None  # few inputs
        assert q4_module.split_k_layout(*mx.quantize(mx.zeros((96, 2112)), group_size=64, bits=4), group_size=64,
                                        bits=4) is None  # 2112 / 4 is not whole groups of 64


# --- the GPU kernel against the reference ---

# (M, N, K, group_size, dtype): N not a multiple of the 4 rows per warp, K with fewer chunks than lanes (256) and
# with a ragged last pass (3584 = 3.5 passes of 32 lanes x 32 values).
CASES = {
    "M1-g64-bf16": (1, 1003, 1024, 64, mx.bfloat16),
    "M3-g64-bf16-K3584": (3, 1003, 3584, 64, mx.bfloat16),
    "M8-g64-bf16-K256": (8, 1002, 256, 64, mx.bfloat16),
    "M5-g32-bf16": (5, 513, 1024, 32, mx.bfloat16),
    "M2-g32-fp16": (2, 257, 512, 32, mx.float16),
    "M2-g32-fp32": (2, 257, 512, 32, mx.float32),
    "M1-g128-bf16": (1, 1001, 1024, 128, mx.bfloat16),
}


@needs_gpu
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_matches_ref(case):
    M, N, K, gs, dtype = CASES[case]
    x, w, s, b = make(M, N, K, gs, dtype, seed=len(case), lead=(1,))
    y = q4_matmul_kernel(x, w, s, b, group_size=gs, init_value=float("nan"))
    assert y.shape == (1, M, N) and y.dtype == dtype
    assert_close(y, mx.array(numpy_q4(x, w, s, b, gs)), out_key(dtype), case)


@needs_gpu
@pytest.mark.parametrize("rows", [2, 4, 8], ids=lambda r: f"R={r}")
def test_kernel_any_rows_per_block(rows):
    x, w, s, b = make(3, 1001, 1024, 64, mx.float32, seed=rows)
    y = q4_matmul_kernel(x, w, s, b, group_size=64, rows=rows, init_value=float("nan"))
    assert_close(y, mx.array(numpy_q4(x, w, s, b, 64)), "fp32", f"R={rows}")


@needs_gpu
def test_kernel_rows_equal_single_row_calls():
    x, w, s, b = make(8, 1003, 1024, 64, mx.float32, seed=11)
    y = q4_matmul_kernel(x, w, s, b, group_size=64)
    for m in range(8):
        assert_close(y[m : m + 1], q4_matmul_kernel(x[m : m + 1], w, s, b, group_size=64), "same", f"row {m}")


@needs_gpu
@pytest.mark.parametrize("M", [1, 4, 8, 9])
def test_dispatch_matches_quantized_matmul(M):
    x, w, s, b = make(M, 512, 1024, 64, mx.bfloat16, seed=M, lead=(1,))
    y = q4_matmul(x, w, s, b, group_size=64)
    expect = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
    assert_close(y, expect, "bfloat16", f"M={M}")


# --- fused prologues and the residual epilogue ---


def make_pre(kind, M, K, dtype, *, seed=0, heads_dim=64):
    """x as the prologue reads it, and its Pre: rms [M, K]; swiglu [M, 2K]; gate x [1, H, M, D] with a [q | gate]
    source that has a k/v tail (as the fused qkv projection output has); gated_rms x [1, M, H, D] with z at an offset
    inside a wider source (as the fused GDN input projection output has)."""
    rng = np.random.default_rng(seed)
    arr = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)  # noqa: E731
    if kind is None:
        return arr(1, M, K), None
    if kind == "rms":
        return arr(1, M, K), Pre("rms", (1 + 0.3 * arr(K)).astype(dtype), 1e-6)
    if kind == "swiglu":
        return arr(1, M, 2 * K), Pre("swiglu")
    D, H = heads_dim, K // heads_dim
    if kind == "gate":
        return arr(1, H, M, D), Pre("gate", src=arr(1, M, 2 * K + 2 * D))
    return arr(1, M, H, D), Pre("gated_rms", (1 + 0.3 * arr(D)).astype(dtype), 1e-6, src=arr(1, M, K + 3 * 8 + K),
                                offset=24)


PRE_KINDS = [None, "rms", "swiglu", "gate", "gated_rms"]


def rows_of(kind, x, pre, lo, hi):
    """Rows lo..hi of make_pre's input and the Pre that reads them (the gate's x holds its rows on axis 2, the
    others on axis 1; the gate and gated_rms sources hold them on axis 1)."""
    if kind == "gate":
        return x[:, :, lo:hi], Pre("gate", src=pre.src[:, lo:hi])
    if kind == "gated_rms":
        return x[:, lo:hi], Pre("gated_rms", pre.weight, pre.eps, src=pre.src[:, lo:hi], offset=pre.offset)
    return x[:, lo:hi], pre


@pytest.mark.parametrize("kind", PRE_KINDS, ids=str)
@pytest.mark.parametrize("res", [False, True], ids=["plain", "residual"])
def test_dispatch_plain_ops_equal_the_ref(kind, res):
    """The non-kernel path (prologue's plain ops + quantized_matmul + add) against the spec, fp32 on the CPU."""
    with mx.stream(mx.cpu):
        x, pre = make_pre(kind, 3, 256, mx.float32, seed=3)
        _, w, s, b = make(1, 40, 256, 64, mx.float32, seed=4)
        r = mx.array(np.random.default_rng(5).standard_normal((1, 3, 40)).astype(np.float32)) if res else None
        ref = q4_matmul_ref(x, w, s, b, group_size=64, pre=pre, residual=r)
        got = q4_matmul(x, w, s, b, group_size=64, pre=pre, residual=r)
    assert got.shape == ref.shape == (1, 3, 40)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-4)


def test_gate_and_gated_rms_prologues_read_the_right_columns():
    """Against numpy: the gate is the second half of each head's [q | gate] block; z sits at the given offset."""
    x, pre = make_pre("gate", 2, 128, mx.float32, seed=7, heads_dim=32)
    xs, g = np.array(x), np.array(pre.src)
    H, D = 4, 32
    gate = g[0, :, : 2 * H * D].reshape(2, H, 2 * D)[..., D:].reshape(2, -1)
    expect = xs[0].transpose(1, 0, 2).reshape(2, -1) / (1 + np.exp(-gate))
    np.testing.assert_allclose(np.array(prologue_ref(pre, x))[0], expect, rtol=1e-5, atol=1e-5)
    x, pre = make_pre("gated_rms", 2, 128, mx.float32, seed=8, heads_dim=32)
    xs, z, w = np.array(x)[0], np.array(pre.src)[0, :, 24:152].reshape(2, 4, 32), np.array(pre.weight)
    normed = xs / np.sqrt((xs * xs).mean(-1, keepdims=True) + 1e-6) * w
    expect = (normed * z / (1 + np.exp(-z))).reshape(2, -1)
    np.testing.assert_allclose(np.array(prologue_ref(pre, x))[0], expect, rtol=1e-4, atol=1e-5)


# (prologue, M, K, dtype): every prologue at one row, several rows and the largest M, each activation dtype.
# gated_rms needs K a multiple of 1024 (every lane of a warp runs the same passes).
FUSED = {f"{k}-M{M}-K{K * (4 if k == 'gated_rms' else 1)}-{d}": (k, M, K * (4 if k == "gated_rms" else 1), dt)
         for k in ["rms", "swiglu", "gate", "gated_rms"]
         for (M, K, d, dt) in [(1, 1024, "bf16", mx.bfloat16), (4, 512, "fp16", mx.float16), (8, 256, "fp32", mx.float32)]}


@needs_gpu
@pytest.mark.parametrize("case", list(FUSED), ids=list(FUSED))
@pytest.mark.parametrize("res", [False, True], ids=["plain", "residual"])
def test_fused_kernel_matches_ref(case, res):
    kind, M, K, dtype = FUSED[case]
    x, pre = make_pre(kind, M, K, dtype, seed=len(case))
    _, w, s, b = make(1, 1003, K, 64, dtype, seed=len(case) + 1)
    r = mx.array(np.random.default_rng(2).standard_normal((1, M, 1003)).astype(np.float32)).astype(dtype) \
        if res else None
    y = q4_matmul_kernel(x, w, s, b, group_size=64, pre=pre, residual=r, init_value=float("nan"))
    with mx.stream(mx.cpu):  # the spec in exact fp32 matmuls
        ref = q4_matmul_ref(x, w, s, b, group_size=64, pre=pre, residual=r)
    assert y.shape == ref.shape == (1, M, 1003) and y.dtype == dtype
    assert_close(y, ref, out_key(dtype), case)


@needs_gpu
@pytest.mark.parametrize("kind", PRE_KINDS, ids=str)
def test_fused_kernel_rows_are_batch_invariant(kind):
    """Row m of an 8-row call is bitwise the 1-row call on that row: a verify row equals a decode step."""
    K = 2048  # split over 2 warps (SK = 2) for this N, and a multiple of 1024 for gated_rms
    x, pre = make_pre(kind, 8, K, mx.bfloat16, seed=13)
    _, w, s, b = make(1, 1003, K, 64, mx.bfloat16, seed=14)
    y = q4_matmul_kernel(x, w, s, b, group_size=64, pre=pre)
    for m in range(8):
        xm, pm = rows_of(kind, x, pre, m, m + 1)
        assert mx.array_equal(y[:, m : m + 1], q4_matmul_kernel(xm, w, s, b, group_size=64, pre=pm)), (kind, m)


@needs_gpu
@pytest.mark.parametrize("T", [1, 2])
def test_gate_prologue_over_a_batch(T):
    """The attention output of a batch, x [B, H, T, D] with its [q | gate] source [B, T, S] (batch.py's steps at
    T = 1, a batch's verify at T > 1): the kernel against the spec, and each sequence's rows bitwise its own call."""
    B, H, D, K = 3, 8, 64, 512
    rng = np.random.default_rng(21)
    arr = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)  # noqa: E731
    x, pre = arr(B, H, T, D), Pre("gate", src=arr(B, T, 2 * K + 2 * D))
    _, w, s, b = make(1, 1003, K, 64, mx.bfloat16, seed=22)
    res = arr(B, T, 1003)
    y = q4_matmul_kernel(x, w, s, b, group_size=64, pre=pre, residual=res, init_value=float("nan"))
    with mx.stream(mx.cpu):
        ref = q4_matmul_ref(x, w, s, b, group_size=64, pre=pre, residual=res)
    assert y.shape == ref.shape == (B, T, 1003)
    assert_close(y, ref, out_key(mx.bfloat16), f"gate B={B} T={T}")
    for i in range(B):
        one = q4_matmul_kernel(x[i : i + 1], w, s, b, group_size=64, pre=Pre("gate", src=pre.src[i : i + 1]),
                               residual=res[i : i + 1])
        assert mx.array_equal(y[i : i + 1], one), i


# --- 16 rows (LATTICE_FUSED_ROWS=16: a batch's steps of up to 16 sequences in the fused kernel) ---


def test_sixteen_rows_only_with_the_setting(monkeypatch):
    """At the default the kernel takes up to 8 rows and split-K starts at 9; with LATTICE_FUSED_ROWS=16 it takes up
    to 16 in one variant of 16 rows, and split-K starts at 17."""
    from lattice_mlx import settings
    from lattice_mlx.metal.q4_matmul import supported

    _, w, _, _ = make(1, 64, 256, 64, mx.bfloat16)
    split = object()  # (split_k_applies only asks whether a layout was given)
    monkeypatch.setattr(q4_module, "_cuda_gpu", lambda: True)
    rows = lambda M: mx.zeros((M, 1, 256), dtype=mx.bfloat16)  # noqa: E731 (a batch's step: [B, 1, K])
    assert supported(rows(8), w, 64, 4) and not supported(rows(9), w, 64, 4)
    assert q4_module.split_k_applies(rows(9), split) and not q4_module.split_k_applies(rows(8), split)
    with settings.override(fused_rows="16"):
        assert supported(rows(16), w, 64, 4) and supported(rows(9), w, 64, 4) and not supported(rows(17), w, 64, 4)
        assert not q4_module.split_k_applies(rows(16), split) and q4_module.split_k_applies(rows(17), split)
        for policy in q4_module.CAPACITIES:
            monkeypatch.setattr(q4_module, "CAPACITY", policy)
            assert [q4_module.capacity(M) for M in (9, 12, 16)] == ([9, 12, 16] if policy == "exact" else [16] * 3)
    monkeypatch.setenv("LATTICE_FUSED_ROWS", "12")
    with pytest.raises(ValueError, match="LATTICE_FUSED_ROWS"):
        q4_module.max_rows()


@needs_gpu
@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
@pytest.mark.parametrize("kind", PRE_KINDS, ids=str)
def test_sixteen_rows_match_the_ref_and_each_row_its_one_row_call(kind, glu):
    """With LATTICE_FUSED_ROWS=16: calls of 16 and 11 rows (one variant holding 16) against the spec, and each row
    bitwise the one-row call on it, as at 8 rows: a batch of 16 sequences' step is each sequence's own step."""
    from lattice_mlx import settings

    if glu and kind not in (None, "rms"):
        pytest.skip("the SwiGLU epilogue follows a plain or rms prologue")
    K = 1024
    x, pre = make_pre(kind, 16, K, mx.float32, seed=51)
    _, w, s, b = make(1, 2 * 67 if glu else 131, K, 64, mx.float32, seed=52)
    with settings.override(fused_rows="16"):
        for M in (16, 11):
            xm, pm = rows_of(kind, x, pre, 0, M)
            y = q4_matmul_kernel(xm, w, s, b, group_size=64, pre=pm, glu=glu, init_value=float("nan"))
            with mx.stream(mx.cpu):
                ref = q4_matmul_ref(xm, w, s, b, group_size=64, pre=pm, glu=glu)
            assert y.shape == ref.shape == (1, M, w.shape[0] // (2 if glu else 1))
            assert_close(y, ref, out_key(mx.float32), f"{kind} M={M}")
            for m in (0, 7, 8, M - 1):
                x1, p1 = rows_of(kind, xm, pm, m, m + 1)
                one = q4_matmul_kernel(x1, w, s, b, group_size=64, pre=p1, glu=glu)
                assert mx.array_equal(y[:, m : m + 1], one), (kind, M, m)


def test_supported_refuses_layouts_the_body_would_misread():
    """Side inputs too narrow for what the body reads fall back to the plain ops (which raise or compute right)."""
    from lattice_mlx.metal.q4_matmul import supported

    _, w, s, b = make(1, 64, 256, 64, mx.bfloat16)
    x, pre = make_pre("gate", 2, 256, mx.bfloat16, heads_dim=64)
    assert supported(x, w, 64, 4, pre)
    assert not supported(x, w, 64, 4, Pre("gate", src=pre.src[..., :8]))  # src narrower than the [q | gate] blocks
    x, pre = make_pre("gated_rms", 2, 1024, mx.bfloat16, heads_dim=64)
    _, w, s, b = make(1, 64, 1024, 64, mx.bfloat16)
    assert supported(x, w, 64, 4, pre)
    assert not supported(x, w, 64, 4, Pre("gated_rms", pre.weight, pre.eps, src=pre.src, offset=1056))  # z past the row
    _, w, s, b = make(1, 64, 256, 64, mx.bfloat16)
    assert supported(mx.zeros((1, 2, 512), dtype=mx.bfloat16), w, 64, 4, Pre("swiglu"))
    assert not supported(mx.zeros((1, 2, 513), dtype=mx.bfloat16), w, 64, 4, Pre("swiglu"))


# --- the SwiGLU epilogue (glu): w's rows are [gate | up], the output silu(gate) * up ---


def test_glu_plain_ops_equal_numpy():
    """The non-kernel path with glu against numpy: silu of the first half of the rows' sums times the second half."""
    with mx.stream(mx.cpu):
        x, pre = make_pre("rms", 3, 256, mx.float32, seed=21)
        _, w, s, b = make(1, 80, 256, 64, mx.float32, seed=22)
        got = q4_matmul(x, w, s, b, group_size=64, pre=pre, glu=True)
        ref = q4_matmul_ref(x, w, s, b, group_size=64, pre=pre, glu=True)
        y = numpy_q4(prologue_ref(pre, x)[0], w, s, b, 64).astype(np.float64)
    g, u = y[:, :40], y[:, 40:]
    expect = g / (1 + np.exp(-g)) * u
    assert got.shape == ref.shape == (1, 3, 40)
    np.testing.assert_allclose(np.array(got)[0], expect, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(ref)[0], expect, rtol=1e-4, atol=1e-4)


def test_supported_refuses_glu_it_cannot_run():
    from lattice_mlx.metal.q4_matmul import supported

    x, w, s, b = make(2, 64, 256, 64, mx.bfloat16)
    assert supported(x, w, 64, 4, glu=True)
    assert not supported(x, w[:63], 64, 4, glu=True)  # an odd number of rows has no [gate | up] halves
    assert not supported(x, w, 64, 4, residual=mx.zeros((2, 32), dtype=mx.bfloat16), glu=True)


# (prologue, M, N, K, dtype): an odd number of output columns (1003), the largest M, each activation dtype
GLU = {f"{k}-M{M}-{d}": (k, M, 2 * 1003, K, dt) for k in [None, "rms"]
       for (M, K, d, dt) in [(1, 1024, "bf16", mx.bfloat16), (4, 512, "fp16", mx.float16), (8, 256, "fp32", mx.float32),
                             (3, 3584, "bf16", mx.bfloat16)]}


@needs_gpu
@pytest.mark.parametrize("case", list(GLU), ids=list(GLU))
def test_glu_kernel_matches_ref(case):
    kind, M, N, K, dtype = GLU[case]
    x, pre = make_pre(kind, M, K, dtype, seed=len(case))
    _, w, s, b = make(1, N, K, 64, dtype, seed=len(case) + 1)
    y = q4_matmul_kernel(x, w, s, b, group_size=64, pre=pre, glu=True, init_value=float("nan"))
    with mx.stream(mx.cpu):
        ref = q4_matmul_ref(x, w, s, b, group_size=64, pre=pre, glu=True)
    assert y.shape == ref.shape == (1, M, N // 2) and y.dtype == dtype
    assert_close(y, ref, out_key(dtype), case)


@needs_gpu
@pytest.mark.parametrize("rows", [1, 2, 4], ids=lambda r: f"R={r}")
def test_glu_kernel_any_rows_per_block(rows):
    x, pre = make_pre("rms", 3, 1024, mx.float32, seed=rows)
    _, w, s, b = make(1, 2002, 1024, 64, mx.float32, seed=rows + 1)
    y = q4_matmul_kernel(x, w, s, b, group_size=64, pre=pre, glu=True, rows=rows, init_value=float("nan"))
    with mx.stream(mx.cpu):
        ref = q4_matmul_ref(x, w, s, b, group_size=64, pre=pre, glu=True)
    assert_close(y, ref, "fp32", f"R={rows}")


@needs_gpu
def test_glu_kernel_rows_are_batch_invariant():
    """Row m of an 8-row call is bitwise the 1-row call on that row (a verify row equals a decode step)."""
    x, pre = make_pre("rms", 8, 2048, mx.bfloat16, seed=31)
    _, w, s, b = make(1, 2 * 1003, 2048, 64, mx.bfloat16, seed=32)
    y = q4_matmul_kernel(x, w, s, b, group_size=64, pre=pre, glu=True)
    for m in range(8):
        assert mx.array_equal(y[:, m : m + 1], q4_matmul_kernel(x[:, m : m + 1], w, s, b, group_size=64, pre=pre,
                                                                glu=True)), m


def test_capacity_policies():
    """The rows a variant holds: decode keeps a one-row variant; "quad" holds 2..4 rows in one and 5..8 in another,
    "shared" 2..8 in one, "exact" one per M."""
    got = {}
    for policy in q4_module.CAPACITIES:
        q4_module.CAPACITY, before = policy, q4_module.CAPACITY
        try:
            got[policy] = [q4_module.capacity(M) for M in range(1, 9)]
        finally:
            q4_module.CAPACITY = before
    assert got == {"shared": [1, 8, 8, 8, 8, 8, 8, 8], "quad": [1, 4, 4, 4, 8, 8, 8, 8],
                   "exact": [1, 2, 3, 4, 5, 6, 7, 8]}


@needs_gpu
@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
@pytest.mark.parametrize("kind", PRE_KINDS, ids=str)
def test_row_capacity_changes_no_result(kind, glu, monkeypatch):
    """A call of M rows in a variant holding more rows (MM > M, the rows taken from x's shape) is bitwise the call in
    the variant of exactly M rows, and each row is the one-row call: a verify of any depth can share one variant."""
    if glu and kind not in (None, "rms"):
        pytest.skip("the SwiGLU epilogue follows a plain or rms prologue")
    x, pre = make_pre(kind, 5, 1024, mx.bfloat16, seed=41)
    _, w, s, b = make(1, 2 * 501 if glu else 1003, 1024, 64, mx.bfloat16, seed=42)
    for M in (2, 3, 5):
        xm, pm = rows_of(kind, x, pre, 0, M)
        out = {}
        for policy in q4_module.CAPACITIES:
            monkeypatch.setattr(q4_module, "CAPACITY", policy)
            out[policy] = q4_matmul_kernel(xm, w, s, b, group_size=64, pre=pm, glu=glu, init_value=float("nan"))
        monkeypatch.setattr(q4_module, "CAPACITY", "quad")
        for policy, y in out.items():
            assert mx.array_equal(y, out["exact"]), (kind, M, policy)
        one, p1 = rows_of(kind, xm, pm, 0, 1)
        assert mx.array_equal(out["quad"][:, :1], q4_matmul_kernel(one, w, s, b, group_size=64, pre=p1, glu=glu))
