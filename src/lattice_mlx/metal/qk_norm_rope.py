"""The attention layer's q/k RMSNorm + RoPE (and v's head-major layout) in one kernel, read from the fused projection.

src [B, T, S] is the fused qkv projection's output: per query head [q (D) | output gate (D)], then Hkv key heads
(D each), then Hkv value heads. Outputs q [B, Hq, T, D] = rope(rms_norm(q) * wq), k [B, Hkv, T, D] likewise with wk,
v [B, Hkv, T, D] (copied), positions offset + t (offset: one for every row, or one per row b: a batch of sequences at
their own positions, batch.py). RoPE is the non-interleaved form over the first `rope_dims` dims
(mx.fast.rope traditional=False, scale 1); the rest pass through. Rounding as the unfused ops round: the norm's
x * rsqrt(mean(x^2) + eps) to the activation type, times the weight, rounded again; RoPE in fp32 from that.

Replaces, per attention layer and forward, two RMSNorms, two RoPEs and the copies of their strided inputs (~5
launches) with one. Each (token, head) is one warp whose work does not depend on T: batch-invariant by construction.
"""

import math

import mlx.core as mx

from lattice_mlx.metal import _dialect, use_kernels

# One 32-thread threadgroup per (token, head); heads 0..Hq-1 are q, then Hkv k heads, then Hkv v heads. Lane l holds
# dims l + 32 i; the normed row goes through threadgroup memory so RoPE can pair dim e with e +- rope_dims / 2.
_BODY = """
  constexpr int NE = D / 32;
  constexpr int HALF = ROPE / 2;
  LX_SHARED float buf[D];
  const int lane = LX_TID_X;
  const int head = LX_BID_Y;
  const int T = src_shape[1];
  const int bt = LX_BID_Z;
  const int bi = bt / T;
  const int t = bt % T;
  const int64_t row = int64_t(bt) * src_shape[2];
  const bool is_q = head < Hq;
  const bool is_v = head >= Hq + Hkv;
  const int col = is_q ? head * 2 * D : Hq * 2 * D + (head - Hq) * D;
  const int oh = is_q ? head : (is_v ? head - Hq - Hkv : head - Hq);
  const int64_t ob = ((int64_t(bi) * (is_q ? Hq : Hkv) + oh) * T + t) * D;
  float x[NE];
#pragma unroll
  for (int i = 0; i < NE; ++i) x[i] = LX_F32(src[row + col + lane + 32 * i]);
  if (is_v) {
#pragma unroll
    for (int i = 0; i < NE; ++i) v_out[ob + lane + 32 * i] = static_cast<OT>(x[i]);
    return;
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < NE; ++i) ss += x[i] * x[i];
  ss = LX_SIMD_SUM(ss);
  const float inv = LX_RSQRT(ss / D + EPS);
#pragma unroll
  for (int i = 0; i < NE; ++i) {
    const int e = lane + 32 * i;
    const float w = LX_F32(is_q ? qw[e] : kw[e]);
    buf[e] = LX_F32(static_cast<OT>(w * LX_F32(static_cast<OT>(x[i] * inv))));
  }
  LX_BARRIER;
  const float pos = static_cast<float>(offset[PER_ROW ? bi : 0] + t);
#pragma unroll
  for (int i = 0; i < NE; ++i) {
    const int e = lane + 32 * i;
    float r = buf[e];
    if (e < ROPE) {
      const int p = e < HALF ? e : e - HALF;
      const float theta = pos * LX_EXP2(-(static_cast<float>(p) / HALF) * LOG2_BASE);
      const float c = LX_COS(theta);
      const float s = LX_SIN(theta);
      r = e < HALF ? buf[e] * c - buf[e + HALF] * s : buf[e - HALF] * s + buf[e] * c;
    }
    if (is_q) {
      q_out[ob + e] = static_cast<OT>(r);
    } else {
      k_out[ob + e] = static_cast<OT>(r);
    }
  }
"""
_INPUTS = ("src", "qw", "kw", "offset")
_OUTPUTS = ("q_out", "k_out", "v_out")


def _offset_array(offset: int | mx.array) -> mx.array:
    """One position per call [1], or one per batch row [B]."""
    return offset.astype(mx.int32).reshape(-1) if isinstance(offset, mx.array) else mx.array([offset], dtype=mx.int32)


def qk_norm_rope_ref(src: mx.array, q_norm, k_norm, offset: int | mx.array, *, heads: tuple[int, int, int],
                     rope_dims: int, base: float) -> tuple[mx.array, mx.array, mx.array]:
    """The specification in MLX ops: split, RMSNorm, transpose, mx.fast.rope."""
    Hq, Hkv, D = heads
    B, T, _ = src.shape
    q = src[..., : Hq * 2 * D].reshape(B, T, Hq, 2 * D)[..., :D]
    k = src[..., Hq * 2 * D : Hq * 2 * D + Hkv * D].reshape(B, T, Hkv, D)
    v = src[..., Hq * 2 * D + Hkv * D : Hq * 2 * D + 2 * Hkv * D].reshape(B, T, Hkv, D)
    q = q_norm(q).transpose(0, 2, 1, 3)
    k = k_norm(k).transpose(0, 2, 1, 3)
    q = mx.fast.rope(q, rope_dims, traditional=False, base=base, scale=1.0, offset=offset)
    k = mx.fast.rope(k, rope_dims, traditional=False, base=base, scale=1.0, offset=offset)
    return q, k, v.transpose(0, 2, 1, 3)


def supported(src: mx.array, q_norm, k_norm, *, heads: tuple[int, int, int], rope_dims: int,
              offset: int | mx.array = 0) -> bool:
    Hq, Hkv, D = heads
    one_per_row = not isinstance(offset, mx.array) or offset.size in (1, src.shape[0])  # (one, or one per row)
    return (src.ndim == 3 and one_per_row and src.shape[-1] == (2 * Hq + 2 * Hkv) * D and D % 32 == 0 and 32 <= D <= 512
            and rope_dims % 2 == 0 and 0 < rope_dims <= D and src.dtype in (mx.float32, mx.bfloat16, mx.float16)
            and q_norm.weight.dtype == k_norm.weight.dtype == src.dtype and q_norm.eps == k_norm.eps
            and src.shape[0] * src.shape[1] <= 65535)  # grid z = B * T (CUDA's limit)


@_dialect.op(qk_norm_rope_ref)
def qk_norm_rope_kernel(src: mx.array, q_norm, k_norm, offset: int | mx.array, *, heads: tuple[int, int, int],
                        rope_dims: int, base: float, init_value: float | None = None
                        ) -> tuple[mx.array, mx.array, mx.array]:
    """The GPU kernel (Metal or CUDA); same contract as `qk_norm_rope_ref`. `init_value` poisons outputs (tests)."""
    Hq, Hkv, D = heads
    B, T, _ = src.shape
    offsets = _offset_array(offset)
    kernel = _dialect.build("lattice_qk_norm_rope", _BODY, _INPUTS, _OUTPUTS,
                            consts=_dialect.constants(EPS=float(q_norm.eps), LOG2_BASE=math.log2(base)))
    return tuple(kernel(
        inputs=[src, q_norm.weight, k_norm.weight, offsets],
        template=[("OT", src.dtype), ("D", D), ("Hq", Hq), ("Hkv", Hkv), ("ROPE", rope_dims),
                  ("PER_ROW", int(offsets.size > 1))],
        grid=(32, Hq + 2 * Hkv, B * T),
        threadgroup=(32, 1, 1),
        output_shapes=[(B, Hq, T, D), (B, Hkv, T, D), (B, Hkv, T, D)],
        output_dtypes=[src.dtype] * 3,
        init_value=init_value,
    ))


def qk_norm_rope(src: mx.array, q_norm, k_norm, offset: int | mx.array, *, heads: tuple[int, int, int],
                 rope_dims: int, base: float) -> tuple[mx.array, mx.array, mx.array]:
    """The model's entry point: the kernel on a GPU where it applies, the reference otherwise."""
    if use_kernels() and supported(src, q_norm, k_norm, heads=heads, rope_dims=rope_dims, offset=offset):
        try:
            return qk_norm_rope_kernel(src, q_norm, k_norm, offset, heads=heads, rope_dims=rope_dims, base=base)
        except _dialect.KernelFailed:
            pass
    return qk_norm_rope_ref(src, q_norm, k_norm, offset, heads=heads, rope_dims=rope_dims, base=base)
