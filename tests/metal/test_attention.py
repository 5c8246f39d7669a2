"""Decode/verify attention: the reference against a float64 spec and the dispatcher on sliced KV-cache views (all
backends); on a GPU the kernel against the fp32 reference over T x L x D x heads x dtype x causal, NaN-poisoned."""

import itertools
import shutil

import mlx.core as mx
import numpy as np
import pytest
from _tol import assert_close, out_key
from test_dialect import assert_nvcc_compiles, assert_render_is_syntax_shaped, cuda_translation_unit

from lattice_mlx import settings
from lattice_mlx.metal import _dialect, attention, use_kernels
from lattice_mlx.metal.attention import _BODY, _COMBINE, sdpa, sdpa_composed, sdpa_kernel, sdpa_ref, supported

needs_gpu = pytest.mark.kernels  # a GPU backend, or the CPU render (tests/conftest.py)


def make_inputs(B, Hq, Hkv, T, L, D, dtype, *, seed=0, pad=13):
    """q as mlx-lm makes it ([B, T, Hq, D] transposed: a strided view); k, v the first L positions of a
    [B, Hkv, L + pad, D] cache buffer whose tail is NaN, as KVCache returns them (a kernel reading past L fails)."""
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((B, T, Hq, D)).astype(np.float32)).astype(dtype).transpose(0, 2, 1, 3)

    def cache():
        buf = np.full((B, Hkv, L + pad, D), np.nan, dtype=np.float32)
        buf[:, :, :L] = rng.standard_normal((B, Hkv, L, D))
        return mx.array(buf).astype(dtype)[:, :, :L]

    return q, cache(), cache()


def numpy_spec(q, k, v, scale, causal):
    """Float64, from the module docstring: query head h reads kv head h // (Hq // Hkv); causal row t sees 0..L-T+t."""
    q, k, v = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    T, L = q.shape[2], k.shape[2]
    k, v = (np.repeat(x, q.shape[1] // k.shape[1], axis=1) for x in (k, v))
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if causal:
        s = np.where(np.arange(L)[None, :] <= (L - T + np.arange(T))[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def fp32_reference(q, k, v, scale, causal):
    """`sdpa_ref` in fp32 on the CPU stream (a CUDA fp32 matmul may use TF32), rounded once to q's dtype."""
    with mx.stream(mx.cpu):
        f32 = [x.astype(mx.float32) for x in (q, k, v)]
        return sdpa_ref(*f32, scale=scale, mask="causal" if causal else None).astype(q.dtype)


# --- reference and dispatch: these run everywhere, the CPU included ---


@pytest.mark.parametrize(
    "T,L,heads,causal",
    [(1, 1, (8, 2), False), (1, 50, (8, 2), True), (4, 50, (8, 2), True), (9, 9, (4, 4), True), (5, 30, (6, 3), False)],
    ids=["T1-L1", "T1-L50-causal", "T4-L50-causal", "T9-L9-causal", "T5-L30-6q3kv"],
)
def test_ref_matches_spec(T, L, heads, causal):
    """The reference's causal mask is bottom-right aligned and its GQA grouping is h // (Hq // Hkv)."""
    q, k, v = make_inputs(2, *heads, T, L, 64, mx.float32, seed=T + L)
    got = sdpa_ref(q, k, v, scale=0.125, mask="causal" if causal else None)
    assert_close(got, mx.array(numpy_spec(q, k, v, 0.125, causal).astype(np.float32)), "fp32", "ref vs spec")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,mask", [(1, None), (4, "causal")], ids=["decode", "verify"])
def test_dispatch_reads_cache_views(T, mask, dtype):
    """k, v sliced from a bigger buffer (NaN past L) give what contiguous copies give, and match the spec."""
    q, k, v = make_inputs(2, 8, 2, T, 300, 128, dtype, seed=T)
    scale = 128**-0.5
    got = sdpa(q, k, v, scale=scale, mask=mask)
    assert got.shape == q.shape and got.dtype == dtype
    assert_close(got, sdpa(mx.contiguous(q), mx.contiguous(k), mx.contiguous(v), scale=scale, mask=mask), "same")
    spec = mx.array(numpy_spec(q, k, v, scale, mask == "causal").astype(np.float32)).astype(dtype)
    assert_close(got, spec, out_key(dtype), "dispatch vs spec")


def rows_reference(q):
    """What the dispatcher gives rows the kernel does not take: MLX's SDPA, or on MLX's CUDA backend the same
    written out in ops (no cuDNN graph per prompt shape)."""
    return sdpa_composed if attention.composed(q) else sdpa_ref


def test_dispatch_array_mask_goes_to_reference():
    q, k, v = make_inputs(1, 8, 2, 3, 40, 64, mx.float32)
    mask = mx.array(np.random.default_rng(0).random((3, 40)) < 0.7)
    want = rows_reference(q)(q, k, v, scale=0.125, mask=mask)
    assert mx.array_equal(sdpa(q, k, v, scale=0.125, mask=mask), want)


def test_dispatch_uses_reference_when_forced(monkeypatch):
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    assert not use_kernels()
    q, k, v = make_inputs(1, 8, 2, 4, 77, 256, mx.bfloat16)
    got = sdpa(q, k, v, scale=0.0625, mask="causal")
    assert mx.array_equal(got, rows_reference(q)(q, k, v, scale=0.0625, mask="causal"))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask", [None, "causal", "causal-length", "length", "bool", "additive-4d", "bool-per-head",
                                  "bool-keys", "bool-3d"])
def test_composed_matches_mlx_sdpa(mask, dtype):
    """Prompt rows written out in ops (scores, mask, fp32 softmax, values; GQA by grouped query heads) give MLX's
    fused attention, on cache views, for every mask the model passes: causal (bottom-right), the valid keys of a
    fixed-capacity cache, boolean and additive arrays, per head or broadcast."""
    T, L, Hq, Hkv = 37, 60, 8, 2
    q, k, v = make_inputs(2, Hq, Hkv, T, L, 64, dtype, seed=len(mask or ""))
    rng = np.random.default_rng(1)
    length = mx.array(L - 5) if mask in ("causal-length", "length") else None
    arr = {"bool": mx.array(rng.random((T, L)) < 0.7),
           "additive-4d": mx.array(rng.standard_normal((2, 1, T, L)).astype(np.float32)).astype(dtype),
           "bool-per-head": mx.array(rng.random((2, Hq, T, L)) < 0.6),
           "bool-keys": mx.array(rng.random((2, 1, 1, L)) < 0.7),  # [B, 1, 1, L]: a batch's padding
           "bool-3d": mx.array(rng.random((Hq, T, L)) < 0.7)}
    m = arr.get(mask, "causal" if mask and mask.startswith("causal") else None)
    got = sdpa_composed(q, k, v, scale=0.125, mask=m, length=length)
    with mx.stream(mx.cpu):
        f32 = [x.astype(mx.float32) for x in (q, k, v)]
        m32 = m.astype(mx.float32) if isinstance(m, mx.array) and m.dtype != mx.bool_ else m
        want = sdpa_ref(*f32, scale=0.125, mask=m32, length=length).astype(dtype)
    assert got.shape == q.shape and got.dtype == dtype
    assert_close(got, want, out_key(dtype), f"composed vs MLX's SDPA, mask {mask}")


def test_prompt_rows_go_to_the_composed_form_on_cuda_only(monkeypatch):
    """On MLX's CUDA backend rows the kernel does not take (several rows with an array mask, or the kernel off) go to
    `sdpa_composed` unless LATTICE_CUDNN_SDPA=1; one row, or another backend, go to MLX's SDPA."""
    calls = []
    monkeypatch.setattr(attention, "sdpa_composed", lambda *a, **kw: calls.append("composed") or a[0])
    monkeypatch.setattr(attention, "sdpa_ref", lambda *a, **kw: calls.append("mlx") or a[0])
    q, k, v = make_inputs(1, 8, 2, 4, 40, 64, mx.float32)
    mask = mx.array(np.random.default_rng(0).random((4, 40)) < 0.7)
    one = make_inputs(1, 8, 2, 1, 40, 64, mx.float32)
    for cuda, cudnn, inputs, want in [(True, None, (q, k, v), "composed"), (True, True, (q, k, v), "mlx"),
                                      (True, None, one, "mlx"), (False, None, (q, k, v), "mlx")]:
        monkeypatch.setattr(attention, "_cuda_gpu", lambda cuda=cuda: cuda)
        calls.clear()
        with settings.override(cudnn_sdpa=cudnn, kernels="ref"):
            sdpa(*inputs, scale=0.125, mask=mask[:, :40] if inputs[0].shape[2] == 4 else None)
        assert calls == [want], (cuda, cudnn, want)


def test_kernel_serves_every_row_count_at_every_length(monkeypatch):
    """Decode and verify take the same kernel at any length (batch invariance): the dispatcher never hands a
    supported shape to MLX's SDPA."""
    called = []
    monkeypatch.setattr(attention, "use_kernels", lambda: True)
    monkeypatch.setattr(attention, "sdpa_kernel", lambda *a, **kw: called.append(a[1].shape[2]))
    for T in (1, 4, 9, 16):
        for L in (16, 4096, 16384, 20000, 100_000):
            sdpa(mx.zeros((1, 8, T, 256)), mx.zeros((1, 2, L, 256)), mx.zeros((1, 2, L, 256)), scale=1.0,
                 mask="causal" if T > 1 else None)
    assert len(called) == 20


def test_supported_shapes():
    def ok(Hq, Hkv, T, L, D, causal=False, dtype=mx.bfloat16, Dv=None):
        q = mx.zeros((1, Hq, T, D), dtype=dtype)
        return supported(
            q, mx.zeros((1, Hkv, L, D), dtype=dtype), mx.zeros((1, Hkv, L, Dv or D), dtype=dtype), causal=causal
        )

    assert ok(8, 2, 1, 1, 256) and ok(8, 2, 16, 40000, 64, causal=True) and ok(4, 4, 9, 9, 128, causal=True)
    assert not ok(8, 2, 17, 100, 256), "T > 16"
    assert not ok(8, 2, 1, 100, 96), "D not in {64, 128, 256}"
    assert not ok(6, 4, 1, 100, 128), "Hq not a multiple of Hkv"
    assert not ok(8, 2, 5, 4, 128, causal=True), "causal with fewer keys than rows"
    assert not ok(8, 2, 1, 100, 128, Dv=64), "v head dim differs"
    assert not ok(8, 2, 1, 100, 128, dtype=mx.int32)


def test_num_splits_fixed_key_blocks():
    """Splits are blocks of SPLIT_KEYS keys whatever the row count: key j is always in split j // SPLIT_KEYS."""
    n = attention.SPLIT_KEYS
    assert [attention.num_splits(L) for L in (1, n, n + 1, 2 * n, 4096)] == [1, 1, 2, 2, -(-4096 // n)]


# --- the bodies render to both dialects (and compile for sm_90 where nvcc exists) ---

BODIES = {"attention": _BODY, "attention_combine": _COMBINE}


@pytest.mark.parametrize("dialect", ["metal", "cuda"])
@pytest.mark.parametrize("op", list(BODIES))
def test_body_renders(op, dialect):
    assert_render_is_syntax_shaped(BODIES[op], dialect)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on the PATH")
@pytest.mark.parametrize("op", list(BODIES))
def test_cuda_render_compiles(op, tmp_path):
    bf = "__nv_bfloat16"
    if op == "attention":
        ins = [("q", bf), ("k", bf), ("v", bf), ("chunk_keys", "int"), ("kv_len", "int")]
        outs = [("out", bf), ("o_part", "float"), ("ml_part", "float")]
        unit = cuda_translation_unit(_BODY, ins, outs, [("OT", bf), ("D", 256)], _dialect.constants(SCALE=0.0625))
    else:
        unit = cuda_translation_unit(_COMBINE, [("o_part", "float"), ("ml_part", "float")], [("out", bf)], [("OT", bf)])
    assert_nvcc_compiles(unit, tmp_path, op)


# --- the GPU kernel against the reference ---

DTYPES = {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}
HEADS = {"8q2kv": (8, 2), "4q4kv": (4, 4)}
GRID = [
    (T, L, D, heads, dtype, causal)
    for T, L, D, heads, dtype, causal in itertools.product(
        [1, 2, 5, 9], [1, 7, 100, 1000, 5000], [64, 128, 256], HEADS, DTYPES, [False, True]
    )
    if not (causal and L < T)
]


@needs_gpu
@pytest.mark.parametrize(
    "T,L,D,heads,dtype,causal",
    GRID,
    ids=[f"T{t}-L{l}-D{d}-{h}-{dt}-{'causal' if c else 'full'}" for t, l, d, h, dt, c in GRID],
)
def test_kernel_matches_ref(T, L, D, heads, dtype, causal):
    dt = DTYPES[dtype]
    q, k, v = make_inputs(2, *HEADS[heads], T, L, D, dt, seed=T * 7919 + L + D)
    got = sdpa_kernel(q, k, v, scale=D**-0.5, causal=causal, init_value=float("nan"))
    assert got.shape == q.shape and got.dtype == dt
    assert_close(got, fp32_reference(q, k, v, D**-0.5, causal), out_key(dt), "kernel vs ref")


@needs_gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("T,L,causal", [(1, 1000, False), (5, 100, True), (16, 40, True)], ids=["T1", "T5", "T16"])
def test_kernel_any_split_count(T, L, causal, splits):
    """Every split count gives the same result, 64 splits of 40 keys included (empty and all-masked splits)."""
    q, k, v = make_inputs(2, 8, 2, T, L, 128, mx.float32, seed=splits)
    got = sdpa_kernel(q, k, v, scale=0.1, causal=causal, init_value=float("nan"), splits=splits)
    assert_close(got, fp32_reference(q, k, v, 0.1, causal), "fp32", f"{splits} splits")


@needs_gpu
@pytest.mark.parametrize("T,L", [(1, 4096), (4, 4096), (16, 20000)], ids=["decode-4k", "verify-4k", "verify-20k"])
def test_kernel_qwen_shapes(T, L):
    """Qwen3.5-0.8B attention (8 query heads, 2 kv heads, D=256, bf16) through the dispatcher, sharp softmax."""
    q, k, v = make_inputs(1, 8, 2, T, L, 256, mx.bfloat16, seed=L)
    q = q * 4
    mask = "causal" if T > 1 else None
    got = sdpa(q, k, v, scale=256**-0.5, mask=mask)
    assert_close(got, fp32_reference(q, k, v, 256**-0.5, T > 1), "bfloat16", "dispatch vs ref")
    kernel = sdpa_kernel(q, k, v, scale=256**-0.5, causal=T > 1, init_value=float("nan"))
    assert_close(kernel, fp32_reference(q, k, v, 256**-0.5, T > 1), "bfloat16", "kernel vs ref")
    assert_close(got, kernel, "same", "dispatch runs the kernel")


@needs_gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("L0", [30, attention.SPLIT_KEYS - 2, 600], ids=["short", "split-boundary", "3-splits"])
def test_kernel_is_batch_invariant(L0, dtype):
    """Row t of a causal 4-row call (a verify) is bitwise the 1-row call over its first L0 + t + 1 keys (the decode
    step at that position), through the dispatcher, across a split boundary and with several splits."""
    T = 4
    q, k, v = make_inputs(1, 8, 2, T, L0 + T, 256, DTYPES[dtype], seed=L0)
    rows = sdpa(q, k, v, scale=0.0625, mask="causal")
    for t in range(T):
        one = sdpa(q[:, :, t : t + 1], k[:, :, : L0 + t + 1], v[:, :, : L0 + t + 1], scale=0.0625)
        assert mx.array_equal(rows[:, :, t : t + 1], one), f"row {t}"


@pytest.mark.parametrize("T,L,causal", [(1, 37, False), (4, 37, True), (3, 300, True)])
def test_ref_length_equals_the_sliced_keys(T, L, causal):
    """A device key count over a bigger buffer gives what the first `length` keys give (rows past it hold big
    finite values, as stale drafts would: masked out, not multiplied in)."""
    q, k, v = make_inputs(1, 8, 2, T, L + 50, 64, mx.float32, seed=L)
    k = mx.concatenate([k[:, :, :L], mx.full((1, 2, 50, 64), 1e3)], axis=2)
    v = mx.concatenate([v[:, :, :L], mx.full((1, 2, 50, 64), 1e3)], axis=2)
    mask = "causal" if causal else None
    got = sdpa_ref(q, k, v, scale=0.125, mask=mask, length=mx.array(L, dtype=mx.int32))
    want = sdpa_ref(q, k[:, :, :L], v[:, :, :L], scale=0.125, mask=mask)
    assert mx.allclose(got, want, atol=1e-6).item()


@needs_gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("T,L", [(1, 37), (4, 37), (4, attention.SPLIT_KEYS - 2), (3, 700)])
def test_kernel_length_is_bitwise_the_sliced_keys(T, L, dtype):
    """The kernel over a fixed-capacity buffer with a device key count (pipelined rounds) is bitwise the kernel over
    exactly those keys: extra (empty) splits merge as exact zeros; rows past the count, poisoned, are never read."""
    cap = L + attention.SPLIT_KEYS + 9
    q, k, v = make_inputs(1, 8, 2, T, cap, 256, DTYPES[dtype], seed=T + L)
    k = mx.concatenate([k[:, :, :L], mx.full((1, 2, cap - L, 256), float("nan"), dtype=k.dtype)], axis=2)
    v = mx.concatenate([v[:, :, :L], mx.full((1, 2, cap - L, 256), float("nan"), dtype=v.dtype)], axis=2)
    causal = T > 1
    got = sdpa_kernel(q, k, v, scale=0.0625, causal=causal, length=mx.array(L, dtype=mx.int32))
    want = sdpa_kernel(q, k[:, :, :L], v[:, :, :L], scale=0.0625, causal=causal)
    assert mx.array_equal(got, want).item()
