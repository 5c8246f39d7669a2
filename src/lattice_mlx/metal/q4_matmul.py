"""4-bit affine matmul, MLX packing: y[m, n] = sum_k x[m, k] (s[n, k / G] q[n, k] + z[n, k / G]).

Shapes: x [..., K] (M = prod of the leading dims); w [N, K / 8] uint32 (8 nibbles a word, low nibble first);
scales, biases [N, K / G]; y [..., N] in x's dtype. Same result as `mx.quantized_matmul(..., transpose=True)`.
"""

import mlx.core as mx

from lattice_mlx.metal import _dialect, use_kernels

MAX_ROWS = 8


def q4_matmul_ref(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int = 4
) -> mx.array:
    """The specification: unpack the nibbles with plain ops, dequantise in fp32, one fp32 matmul."""
    assert bits == 4, "only 4-bit weights"
    N = w.shape[0]
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    q = ((w[..., None] >> shifts) & 0xF).reshape(N, -1).astype(mx.float32)  # [N, K]
    s = mx.repeat(scales.astype(mx.float32), group_size, axis=-1)
    z = mx.repeat(biases.astype(mx.float32), group_size, axis=-1)
    return (x.astype(mx.float32) @ (s * q + z).T).astype(x.dtype)


# One simdgroup/warp per R rows of w; lane l takes the 32-value chunks c = l, l + 32, ... of each row (one uint4
# of weights, one group, so one scale and one bias). x is read once per chunk and used for all R rows; each
# weight nibble becomes a float once and feeds M fused multiply-adds. Lane sums at the end, one per (row, m).
_BODY = """
  const int N = w_shape[0];
  const int KW = w_shape[1];
  const int KC = KW / 4;
  const int K = KW * 8;
  const int NG = K / GS;
  const int lane = LX_TID_X % 32;
  const int n0 = (LX_GID_X / 32) * R;
  if (n0 >= N) return;

  float acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;

  for (int c = lane; c < KC; c += 32) {
    uint32_t wq[R][4];
    float sc[R], bs[R];
    for (int r = 0; r < R; ++r) {
      const int n = n0 + r;
      if (n < N) {
        const uint4 u = LX_LOAD_U4(w + n * KW + c * 4);
        wq[r][0] = u.x; wq[r][1] = u.y; wq[r][2] = u.z; wq[r][3] = u.w;
        sc[r] = LX_F32(scales[n * NG + (c * 32) / GS]);
        bs[r] = LX_F32(biases[n * NG + (c * 32) / GS]);
      } else {
        wq[r][0] = 0u; wq[r][1] = 0u; wq[r][2] = 0u; wq[r][3] = 0u;
        sc[r] = 0.0f;
        bs[r] = 0.0f;
      }
    }
    float p[R][M], xs[M];
    for (int m = 0; m < M; ++m) {
      xs[m] = 0.0f;
      for (int r = 0; r < R; ++r) p[r][m] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float qf[R][8];
      for (int r = 0; r < R; ++r) {
        const uint32_t lo = wq[r][j] & 0x0F0F0F0Fu;
        const uint32_t hi = (wq[r][j] >> 4) & 0x0F0F0F0Fu;
        for (int i = 0; i < 4; ++i) {
          qf[r][2 * i] = LX_BYTE_F(lo, i);
          qf[r][2 * i + 1] = LX_BYTE_F(hi, i);
        }
      }
      for (int m = 0; m < M; ++m) {
        float xv[8];
        LX_LOAD8(x + m * K + c * 32 + j * 8, xv);
        xs[m] += ((xv[0] + xv[1]) + (xv[2] + xv[3])) + ((xv[4] + xv[5]) + (xv[6] + xv[7]));
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < 8; ++i) p[r][m] += qf[r][i] * xv[i];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] += sc[r] * p[r][m] + bs[r] * xs[m];
  }

  for (int r = 0; r < R; ++r) {
    const int n = n0 + r;
    for (int m = 0; m < M; ++m) {
      const float total = LX_SIMD_SUM(acc[r][m]);
      if (lane == 0 && n < N) y[m * N + n] = static_cast<OT>(total);
    }
  }
"""

_INPUTS = ("x", "w", "scales", "biases")
_OUTPUTS = ("y",)
THREADS_PER_GROUP = 128
# Rows of w per warp by M, from the H200 sweep on the 248320 x 1024 lm_head (g64, us for R = 2 / 4 / 8):
# M=1 97 / 84 / 80, M=2 125 / 105 / 115, M=4 189 / 154 / 174, M=6 269 / 190 / 243, M=8 352 / 281 / 284.
ROWS_PER_WARP = {1: 8, 2: 4, 3: 4, 4: 4, 5: 4, 6: 4, 7: 4, 8: 4}
# The kernel wins where the weight read dominates (H200, bf16, g64; kernel vs mx.quantized_matmul, us):
# lm_head 248320 x 1024: M=1 78 vs 157, M=2 111 vs 314, M=4 154 vs 600, M=7 312 vs 1039, M=8 366 vs 119 (GEMM);
# 9728 x 2560: M=1 22 vs 21, M=2 25 vs 35, M=4 30 vs 63; 3584 x 1024 and smaller: ~17 us of custom-kernel
# dispatch against ~8 us for the built-in, a loss or a tie at every M. Not measured on Metal: MLX's own there.
KERNEL_MIN_WEIGHTS = 1 << 24
KERNEL_MAX_ROWS = 7


def supported(x: mx.array, w: mx.array, group_size: int, bits: int) -> bool:
    """Shapes and types the kernel handles: 4-bit, K a multiple of 32, M = 1..8, group 32/64/128."""
    K = x.shape[-1]
    return (
        bits == 4
        and group_size in (32, 64, 128)
        and K % 32 == 0
        and w.shape[-1] * 8 == K
        and 1 <= x.size // K <= MAX_ROWS
        and x.dtype in (mx.bfloat16, mx.float16, mx.float32)
    )


def q4_matmul_kernel(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int = 4,
    rows_per_warp: int | None = None,
    init_value: float | None = None,
) -> mx.array:
    """The GPU kernel (Metal or CUDA); same result as `q4_matmul_ref`. `init_value` poisons the output (tests)."""
    assert supported(x, w, group_size, bits), "shape or type not handled by the kernel"
    K, N = x.shape[-1], w.shape[0]
    M = x.size // K
    R = rows_per_warp or ROWS_PER_WARP[M]
    kernel = _dialect.build("lattice_q4_matmul", _BODY, _INPUTS, _OUTPUTS)
    # x keeps its shape: the body indexes it flat as [M, K] (row-contiguous is guaranteed by MLX).
    (y,) = kernel(
        inputs=[x, w, scales, biases],
        template=[("OT", x.dtype), ("M", M), ("R", R), ("GS", group_size)],
        grid=(32 * -(-N // R), 1, 1),
        threadgroup=(THREADS_PER_GROUP, 1, 1),
        output_shapes=[(*x.shape[:-1], N)],
        output_dtypes=[x.dtype],
        init_value=init_value,
    )
    return y


def kernel_wins(x: mx.array, w: mx.array, group_size: int, bits: int) -> bool:
    """Where the kernel beat `mx.quantized_matmul` when measured (figures above, docs/bench/kernels/)."""
    return (
        _dialect.backend() == "cuda"
        and w.shape[0] * x.shape[-1] >= KERNEL_MIN_WEIGHTS
        and x.size // x.shape[-1] <= KERNEL_MAX_ROWS
        and supported(x, w, group_size, bits)
    )


def q4_matmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int = 4
) -> mx.array:
    """The entry point the model's quantized linears call; semantics of `mx.quantized_matmul(transpose=True)`."""
    if use_kernels() and kernel_wins(x, w, group_size, bits):
        return q4_matmul_kernel(x, w, scales, biases, group_size=group_size, bits=bits)
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
