"""The 4-bit embedding lookup in one kernel: out[t] = dequant(w[ids[t]]), MLX packing (as q4_matmul.py).

MLX's `QuantizedEmbedding` gathers the weight rows, their scales and their biases, then dequantizes: four launches
per lookup, and on MLX's CUDA backend every launch costs host dispatch (docs/results/code_measurements.md). A plain step looks up one token and
an MTP round four times (the verify's rows and the head's three forwards), so this saves 3 launches a step and 12 a
K = 3 round.

Bitwise MLX's own lookup on the device it runs on: MLX's `affine_dequantize` computes `scale * T(q) + bias` in the
activation type T, and whether the multiply and the add round separately or contract into one fma depends on the
backend and its compiler. The body has both forms (template ROUND: 0 one rounding of fma(s, q, b), 1 the product
rounded to T, then the sum); the first use on a device probes both against `mx.dequantize` on a table of 16k values
and keeps the one that matches bitwise, or falls back to MLX's four launches if neither does. (s * q is exact in
fp32: an 8- or 11-bit significand times a 4-bit integer.) The probe and the kernel have not run on Apple hardware.
"""

import functools

import mlx.core as mx
import numpy as np

from lattice_mlx.metal import _dialect, use_kernels

# One thread per weight word (8 values): thread g writes out[t, 8c .. 8c + 7], t = g / KW, c = g % KW.
_BODY = """
  const int KW = w_shape[1];
  const int NG = scales_shape[1];
  const int64_t g = LX_GID_X;
  const int64_t T = ids_shape[0];
  if (g >= T * KW) return;
  const int64_t t = g / KW;
  const int c = int(g - t * KW);
  const int64_t row = int64_t(ids[t]);
  const uint32_t u = w[row * KW + c];
  const int gi = (c * 8) / GS;
  const float s = LX_F32(scales[row * NG + gi]), b = LX_F32(biases[row * NG + gi]);
  for (int i = 0; i < 8; ++i) {
    const float q = static_cast<float>((u >> (4 * i)) & 0xFu);
    out[g * 8 + i] = ROUND == 0 ? static_cast<OT>(LX_FMA(s, q, b))
                                : static_cast<OT>(static_cast<float>(static_cast<OT>(s * q)) + b);
  }
"""

DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def supported(ids: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
              mode: str) -> bool:
    """4-bit affine rows with biases, a group of 32/64/128, integer ids, scales and biases in one float dtype."""
    return (bits == 4 and mode == "affine" and biases is not None and group_size in (32, 64, 128)
            and w.dtype == mx.uint32 and w.ndim == 2 and scales.dtype in DTYPES and biases.dtype == scales.dtype
            and scales.shape == (w.shape[0], w.shape[1] * 8 // group_size) and ids.size > 0
            and ids.dtype in (mx.int32, mx.uint32, mx.int64, mx.uint64))


def q4_embedding_ref(ids: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int) -> mx.array:
    """The specification: MLX's own lookup (gather the rows, their scales and biases, then dequantize)."""
    return mx.dequantize(w[ids], scales=scales[ids], biases=biases[ids], group_size=group_size, bits=4)


@_dialect.op(q4_embedding_ref)
def q4_embedding_kernel(ids: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                        rounding: int | None = None, init_value: float | None = None) -> mx.array:
    """The GPU kernel (Metal or CUDA): ids [...] -> [..., K] in scales' dtype. `rounding`: the body's ROUND
    (default: the probed one, `rounding_for`). `init_value` poisons the output."""
    rounding = rounding_for(scales.dtype) if rounding is None else rounding
    kernel = _dialect.build("lattice_q4_embedding", _BODY, ("ids", "w", "scales", "biases"), ("out",))
    KW = w.shape[1]
    n = ids.size * KW
    (out,) = kernel(
        inputs=[ids.reshape(-1), w, scales, biases],
        template=[("OT", scales.dtype), ("GS", group_size), ("ROUND", rounding)],
        grid=(-(-n // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(ids.size, KW * 8)],
        output_dtypes=[scales.dtype],
        init_value=init_value,
    )
    return out.reshape(*ids.shape, KW * 8)


_ROUNDING: dict[tuple[mx.Dtype, str], int | None] = {}
_PROBE = (64, 256, 64)  # the probe's table: rows, columns, group size


@functools.cache  # (per dtype: a recording of the model's forwards asked for it at every lookup, 0.2 s a listing)
def _probe_table(dtype: mx.Dtype):
    rng = np.random.default_rng(7)
    V, K, G = _PROBE
    dense = rng.standard_normal((V, K)) * np.exp2(rng.integers(-6, 4, size=(V, 1)))
    w, s, b = mx.quantize(mx.array(dense.astype(np.float32)).astype(dtype), group_size=G, bits=4)
    return mx.array(np.arange(V, dtype=np.int32)), w, s, b


def rounding_for(dtype: mx.Dtype) -> int | None:
    """The body's ROUND that gives MLX's lookup bitwise for this dtype on this backend, None if neither does (or the
    kernel failed to build). Probed once per process and backend."""
    key = (dtype, _dialect.backend())
    if key in _ROUNDING:
        return _ROUNDING[key]
    ids, w, s, b = _probe_table(dtype)
    expect = q4_embedding_ref(ids, w, s, b, group_size=_PROBE[2])
    found = None
    for rounding in (0, 1):
        try:
            got = q4_embedding_kernel(ids, w, s, b, group_size=_PROBE[2], rounding=rounding)
        except _dialect.KernelFailed:
            break
        if mx.array_equal(got, expect).item():
            found = rounding
            break
    if not _dialect.collecting():  # (a spied probe learns nothing about the device)
        _ROUNDING[key] = found
    return found


def q4_embedding(ids: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int,
                 bits: int, mode: str = "affine") -> mx.array:
    """MLX's quantized embedding lookup (`nn.QuantizedEmbedding.__call__`): one kernel on a GPU where it applies."""
    if use_kernels() and supported(ids, w, scales, biases, group_size, bits, mode):
        if _dialect.recording_active():  # the probe's calls and both roundings: a device keeps one of them
            probe = _probe_table(scales.dtype)
            for rounding in (0, 1):
                q4_embedding_kernel(*probe, group_size=_PROBE[2], rounding=rounding)
                out = q4_embedding_kernel(ids, w, scales, biases, group_size=group_size, rounding=rounding)
            return out
        if rounding_for(scales.dtype) is not None:
            try:
                return q4_embedding_kernel(ids, w, scales, biases, group_size=group_size)
            except _dialect.KernelFailed:
                pass
    return mx.dequantize(w[ids], scales=scales[ids], biases=biases[ids] if biases is not None else None,
                         group_size=group_size, bits=bits, mode=mode)
