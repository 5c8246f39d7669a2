"""Comparison helpers and THE tolerance table for kernel tests; every entry says why it is that loose."""

import mlx.core as mx
import numpy as np

# (relative RMS, max |diff| / max |ref|) per compared quantity.
TOL = {
    # fp32 arithmetic on both sides; only the summation order differs (lane sums vs a serial reduction).
    "fp32": (1e-5, 1e-4),
    # the recurrence compounds fp32 rounding over 512 steps; still far below any bf16 effect.
    "fp32_drift": (1e-4, 1e-3),
    # y rounded once to fp16 (2^-11 relative) from fp32 values that differ by summation order: ties may round apart.
    "float16": (1e-3, 2e-3),
    # y rounded once to bf16 (2^-8 relative): the same, with a coarser grid.
    "bfloat16": (8e-3, 1.6e-2),
    # RoPE in fp32 at position ~1e3: theta = pos * inv_freq carries inv_freq's last-bit difference (an exp2 here,
    # MLX's own formula there) times pos, and cos/sin of such angles differ by ~pos * 2^-24: ~1e-5 relative.
    "rope_fp32": (5e-5, 5e-4),
    # split calls or one call, one row or many: identical arithmetic per element, so bit-exact is expected;
    # the small slack covers the compiler contracting a multiply-add differently in another variant.
    "same": (1e-6, 1e-5),
}


def out_key(dtype: mx.Dtype) -> str:
    return {mx.float32: "fp32", mx.float16: "float16", mx.bfloat16: "bfloat16"}[dtype]


def assert_close(got: mx.array, ref: mx.array, key: str, what: str = "") -> None:
    rel_rms, rel_max = TOL[key]
    g = np.array(got.astype(mx.float32), dtype=np.float64)
    r = np.array(ref.astype(mx.float32), dtype=np.float64)
    assert g.shape == r.shape, f"{what}: shape {g.shape} != {r.shape}"
    assert np.isfinite(g).all(), f"{what}: non-finite values (an output element left unwritten?)"
    scale = max(np.sqrt(np.mean(r * r)), 1e-30)
    err_rms = np.sqrt(np.mean((g - r) ** 2)) / scale
    err_max = np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)
    assert err_rms <= rel_rms, f"{what}: relative RMS {err_rms:.3g} > {rel_rms:g} ({key})"
    assert err_max <= rel_max, f"{what}: relative max {err_max:.3g} > {rel_max:g} ({key})"
