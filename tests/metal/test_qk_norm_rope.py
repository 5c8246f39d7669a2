"""q/k RMSNorm + RoPE from the fused projection: the reference against a float64 spec (all backends); on a GPU the
kernel against the reference over dtypes, head dims, rotary widths, T and offsets, and its batch invariance."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from _tol import assert_close, out_key
from test_dialect import assert_nvcc_compiles, assert_render_is_syntax_shaped, cuda_translation_unit

from lattice_mlx.metal import _dialect
from lattice_mlx.metal.qk_norm_rope import _BODY, qk_norm_rope, qk_norm_rope_kernel, qk_norm_rope_ref, supported

needs_gpu = pytest.mark.kernels  # a GPU backend, or the CPU render (tests/conftest.py)


def make(Hq, Hkv, D, T, dtype, *, seed=0, batch=2):
    rng = np.random.default_rng(seed)
    src = mx.array(rng.standard_normal((batch, T, (2 * Hq + 2 * Hkv) * D)).astype(np.float32) * 3).astype(dtype)
    norms = []
    for _ in range(2):
        n = nn.RMSNorm(D, eps=1e-6)
        n.weight = mx.array(1 + 0.3 * rng.standard_normal(D).astype(np.float32)).astype(dtype)
        norms.append(n)
    return src, norms[0], norms[1]


def numpy_spec(src, qn, kn, offset, Hq, Hkv, D, rope_dims, base):
    """Float64 from the module docstring: head layout, RMSNorm, non-interleaved RoPE on the first rope_dims dims."""
    x = np.array(src.astype(mx.float32), dtype=np.float64)
    B, T, _ = x.shape
    q = x[..., : Hq * 2 * D].reshape(B, T, Hq, 2 * D)[..., :D]
    k = x[..., Hq * 2 * D : (2 * Hq + Hkv) * D].reshape(B, T, Hkv, D)
    v = x[..., (2 * Hq + Hkv) * D :].reshape(B, T, Hkv, D)

    def norm_rope(a, w):
        a = a / np.sqrt((a**2).mean(-1, keepdims=True) + 1e-6) * np.array(w.astype(mx.float32), dtype=np.float64)
        half = rope_dims // 2
        pos = (offset + np.arange(T))[None, :, None, None]
        inv = base ** (-np.arange(half) / half)
        c, s = np.cos(pos * inv), np.sin(pos * inv)
        a1, a2 = a[..., :half], a[..., half:rope_dims]
        out = a.copy()
        out[..., :half], out[..., half:rope_dims] = a1 * c - a2 * s, a1 * s + a2 * c
        return out.transpose(0, 2, 1, 3)

    return norm_rope(q, qn.weight), norm_rope(k, kn.weight), v.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("rope_dims", [16, 64])
@pytest.mark.parametrize("offset", [0, 37])
def test_ref_matches_spec(rope_dims, offset):
    src, qn, kn = make(4, 2, 64, 3, mx.float32)
    got = qk_norm_rope_ref(src, qn, kn, offset, heads=(4, 2, 64), rope_dims=rope_dims, base=10000.0)
    for g, s in zip(got, numpy_spec(src, qn, kn, offset, 4, 2, 64, rope_dims, 10000.0)):
        assert_close(g, mx.array(s.astype(np.float32)), "fp32", "ref vs spec")


def test_dispatch_is_the_reference_without_kernels(monkeypatch):
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    src, qn, kn = make(8, 2, 256, 4, mx.bfloat16)
    args = dict(heads=(8, 2, 256), rope_dims=64, base=1e7)
    for a, b in zip(qk_norm_rope(src, qn, kn, 5, **args), qk_norm_rope_ref(src, qn, kn, 5, **args)):
        assert mx.array_equal(a, b)


def test_supported():
    src, qn, kn = make(8, 2, 256, 1, mx.bfloat16)
    assert supported(src, qn, kn, heads=(8, 2, 256), rope_dims=64)
    assert not supported(src, qn, kn, heads=(8, 2, 128), rope_dims=64), "width does not match the heads"
    assert not supported(src, qn, kn, heads=(8, 2, 256), rope_dims=63), "odd rotary width"
    assert not supported(src.astype(mx.float32), qn, kn, heads=(8, 2, 256), rope_dims=64), "norm weight dtype"


@pytest.mark.parametrize("dialect", ["metal", "cuda"])
def test_body_renders(dialect):
    assert_render_is_syntax_shaped(_BODY, dialect)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on the PATH")
def test_cuda_render_compiles(tmp_path):
    bf = "__nv_bfloat16"
    unit = cuda_translation_unit(
        _BODY, [("src", bf), ("qw", bf), ("kw", bf), ("offset", "int")],
        [("q_out", bf), ("k_out", bf), ("v_out", bf)],
        [("OT", bf), ("D", 256), ("Hq", 8), ("Hkv", 2), ("ROPE", 64), ("PER_ROW", 1)],
        _dialect.constants(EPS=1e-6, LOG2_BASE=23.2534966642))
    assert_nvcc_compiles(unit, tmp_path, "qk_norm_rope")


DTYPES = {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}
GRID = [(D, rd, T, dt) for D, rd in [(64, 64), (128, 32), (256, 64), (256, 256)] for T in (1, 4, 9) for dt in DTYPES]


@needs_gpu
@pytest.mark.parametrize("D,rope_dims,T,dtype", GRID, ids=[f"D{d}-r{r}-T{t}-{dt}" for d, r, t, dt in GRID])
def test_kernel_matches_ref(D, rope_dims, T, dtype):
    dt = DTYPES[dtype]
    src, qn, kn = make(8, 2, D, T, dt, seed=D + T)
    args = dict(heads=(8, 2, D), rope_dims=rope_dims, base=1e7)
    got = qk_norm_rope_kernel(src, qn, kn, 1234, **args, init_value=float("nan"))
    with mx.stream(mx.cpu):
        ref = qk_norm_rope_ref(src, qn, kn, 1234, **args)
    for name, g, r in zip("qkv", got, ref):
        assert g.shape == r.shape and g.dtype == dt
        key = "rope_fp32" if dt == mx.float32 and name != "v" else out_key(dt)
        assert_close(g, r, key, f"{name}: kernel vs ref")


@needs_gpu
def test_kernel_array_offset_and_batch_invariance():
    """An array offset (the compiled path's) gives the int offset's result; row t of a 4-row call is bitwise the
    1-row call at offset + t (a verify row equals the decode step at its position)."""
    src, qn, kn = make(8, 2, 256, 4, mx.bfloat16, seed=3)
    args = dict(heads=(8, 2, 256), rope_dims=64, base=1e7)
    rows = qk_norm_rope(src, qn, kn, 300, **args)
    for a, b in zip(rows, qk_norm_rope(src, qn, kn, mx.array(300, dtype=mx.int32), **args)):
        assert mx.array_equal(a, b)
    for t in range(4):
        one = qk_norm_rope(src[:, t : t + 1], qn, kn, 300 + t, **args)
        for a, b in zip(rows, one):
            assert mx.array_equal(a[:, :, t : t + 1], b), f"row {t}"


@needs_gpu
@pytest.mark.parametrize("T", [1, 3])
def test_kernel_per_row_offsets(T):
    """A batch of sequences at their own positions (offset [B], batch.py): each row is the one-row call at its own
    offset, bitwise, and the reference (mx.fast.rope with per-row offsets) agrees."""
    src, qn, kn = make(8, 2, 128, T, mx.bfloat16, seed=5, batch=3)
    args = dict(heads=(8, 2, 128), rope_dims=64, base=1e7)
    offsets = mx.array([7, 300, 41], dtype=mx.int32)
    rows = qk_norm_rope(src, qn, kn, offsets, **args)
    for b in range(3):
        one = qk_norm_rope(src[b : b + 1], qn, kn, int(offsets[b]), **args)
        for a, o in zip(rows, one):
            assert mx.array_equal(a[b : b + 1], o), f"row {b}"
    with mx.stream(mx.cpu):
        ref = qk_norm_rope_ref(src, qn, kn, offsets, **args)
    for name, g, r in zip("qkv", rows, ref):
        assert_close(g, r, out_key(mx.bfloat16), f"{name}: kernel vs ref")
