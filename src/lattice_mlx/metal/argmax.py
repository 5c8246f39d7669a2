"""Greedy argmax over the vocabulary in one launch: one threadgroup of 1,024 threads per row.

MLX's CUDA `arg_reduce` spends tens of microseconds of GPU time on one 248,320-wide row, a few percent of a plain
step and more of a round (docs/results/code_measurements.md, 'Argmax'). A row of logits is ~0.5 MB; here
1,024 threads each read 16-byte chunks, four in flight, keep the first maximum they meet, and a warp shuffle and one
threadgroup pass pick the first maximum of the row. Same result as `mx.argmax(x, axis=-1)`: the index of the first
maximal value (uint32), except that a NaN is never chosen here (a row of NaNs gives 0).
"""

import mlx.core as mx

from lattice_mlx.metal import _dialect, use_kernels

THREADS = 1024
# Lane l of thread t reads chunk t, t + 1024, ... (8 values each), so each thread meets its indices in increasing
# order and a strict `>` keeps its first maximum; across threads, ties go to the smaller index. Indices travel as
# floats through the shuffles (exact below 2^24); index N marks a thread that took nothing (no data, or NaNs only).
_BODY = """
  constexpr int NT = 1024;
  constexpr int NC = N / 8;
  const int tid = LX_TID_X;
  const int64_t row = LX_BID_Y;
  const int64_t base = row * N;
  float bv = 0.0f, bi = float(N);  // bi == N: nothing taken yet (no infinity constant: Metal's fast math)
  for (int c0 = tid; c0 < NC; c0 += 4 * NT) {
    float v[4][8];
    for (int u = 0; u < 4; ++u) {
      const int c = c0 + u * NT;
      if (c < NC) LX_LOAD8(x + base + 8 * c, v[u]);
    }
    for (int u = 0; u < 4; ++u) {
      const int c = c0 + u * NT;
      if (c < NC) {
        for (int j = 0; j < 8; ++j) {
          if (v[u][j] > bv || (bi == float(N) && v[u][j] == v[u][j])) {
            bv = v[u][j];
            bi = float(8 * c + j);
          }
        }
      }
    }
  }
  LX_SHARED float sv[32];
  LX_SHARED float si[32];
  const int w = tid / 32, lane = tid % 32;
  for (int pass = 0; pass < 2; ++pass) {
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = LX_SHFL_XOR(bv, o), oi = LX_SHFL_XOR(bi, o);
      if (oi != float(N) && (bi == float(N) || ov > bv || (ov == bv && oi < bi))) {
        bv = ov;
        bi = oi;
      }
    }
    if (pass == 1) break;
    if (lane == 0) {
      sv[w] = bv;
      si[w] = bi;
    }
    LX_BARRIER;
    if (w != 0) return;
    bv = sv[lane];
    bi = si[lane];
  }
  if (lane == 0) out[row] = bi < float(N) ? uint32_t(bi) : 0u;
"""
DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def argmax_ref(x: mx.array) -> mx.array:
    """The specification: MLX's argmax over the last axis."""
    return mx.argmax(x, axis=-1)


def supported(x: mx.array) -> bool:
    N = x.shape[-1] if x.ndim else 0
    return (x.dtype in DTYPES and N % 8 == 0 and 0 < N < 2**24 and x.size > 0
            and x.size // N <= 65535)  # grid y = rows (CUDA's limit)


@_dialect.op(argmax_ref)
def argmax_kernel(x: mx.array) -> mx.array:
    """The GPU kernel (Metal or CUDA); same contract as `argmax_ref`."""
    N = x.shape[-1]
    rows = x.size // N
    kernel = _dialect.build("lattice_argmax", _BODY, ("x",), ("out",))
    (out,) = kernel(
        inputs=[x],
        template=[("N", N)],
        grid=(THREADS, rows, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape[:-1]],
        output_dtypes=[mx.uint32],
    )
    return out


def argmax(x: mx.array) -> mx.array:
    """Index of the first maximum along the last axis (uint32): the kernel on a GPU where it applies, MLX's
    argmax otherwise."""
    if use_kernels() and supported(x):
        try:
            return argmax_kernel(x)
        except _dialect.KernelFailed:
            pass
    return argmax_ref(x)
