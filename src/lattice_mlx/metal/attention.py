"""Attention at decode/verify sizes: o = softmax(scale q k^T + mask) v, GQA, fp32 accumulation.

Shapes: q [B, Hq, T, D] (T = 1..16 rows); k, v [B, Hkv, L, D], views of a bigger KV-cache buffer allowed; o [B, Hq, T, D]
in q's dtype. Query head h reads kv head h // (Hq // Hkv). causal: row t attends keys 0 .. L - T + t (the last T keys
are the rows' own positions), as `mx.fast.scaled_dot_product_attention(..., mask="causal")`.
"""

import functools

import mlx.core as mx
import numpy as np

from lattice_mlx import settings
from lattice_mlx.metal import _dialect, iota, use_kernels
from lattice_mlx.metal import cuda_gpu as _cuda_gpu  # (a name of this module: tests stub it)


def sdpa_ref(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None,
             length: mx.array | None = None) -> mx.array:
    """The specification: MLX's fused attention (mask None, "causal" or an additive/boolean array). `length` (an int
    scalar array, mask None or "causal"): only the first `length` keys are valid (a fixed-capacity cache holding
    rows past them); causal rows then end at key length - T + t."""
    if length is not None:
        mask = valid_keys(q.shape[2], k.shape[2], mask == "causal", length)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def valid_keys(T: int, L: int, causal: bool, length) -> mx.array:
    """The boolean [T, L] (or [1, L]) mask of the keys each row reads: the first `length` (an int scalar array or
    int), causal rows ending at key length - T + t."""
    # row t's last key, length - T + t: T as host data, not a scalar constant (MLX names a fused kernel by its scalar
    # constants' values: a kernel per depth, cache.py's _clamped_positions)
    last = length + _back(T) if causal else length - 1  # [T] or scalar
    return iota(L)[None, :] <= mx.reshape(last, (-1, 1))


@functools.cache
def _back(T: int) -> mx.array:
    """[-T, .., -1] int32 from host data (shared: never written to)."""
    return mx.array(np.arange(-T, 0, dtype=np.int32))


def sdpa_composed(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None,
                  length: mx.array | None = None) -> mx.array:
    """`sdpa_ref` written out in ops: scores, mask, a softmax in fp32, values (GQA by grouping the query heads). What
    MLX itself runs where none of its fused kernels applies; on MLX's CUDA backend its fused kernel for prompt rows
    is cuDNN's, which builds a graph for every new shape in every process (seconds on a GPU for a prompt length
    not seen before: docs/results/code_measurements.md, 'First use of a prompt length')."""
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    if isinstance(mask, str) or length is not None:  # "causal" and / or the valid keys: a boolean [T, L] mask
        mask = valid_keys(T, L, mask == "causal", L if length is None else length)
    qg = (q * mx.array(scale, q.dtype)).reshape(B, Hkv, Hq // Hkv, T, D)
    scores = qg @ mx.swapaxes(k, -1, -2)[:, :, None]  # [B, Hkv, G, T, L]
    if mask is not None:
        if mask.ndim > 2:  # [..., Hq or 1, T or 1, L or 1]: the query heads' axis split as q's
            m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
            heads = (Hkv, Hq // Hkv) if m.shape[1] == Hq else (1, 1)
            mask = m.reshape(m.shape[0], *heads, m.shape[2], m.shape[3])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ v[:, :, None]).reshape(B, Hq, T, D)


# Flash-decoding. Threadgroup (b, kv head, row block, key split): NW warps stream the split's keys KB at a time,
# lane l holding dims l + 32 i of q (RB rows, pre-scaled), k, v and the output accumulators; a score is one lane
# sum per (row, key); online softmax in fp32 with a finite floor (no inf - inf). The warps' (max, sum, acc) then
# merge through threadgroup memory; with one split the block writes o, else fp32 partials that _COMBINE merges.
# k, v (and q, a transposed view in mlx-lm) are read through their strides: a KV-cache slice is never copied.
_BODY = """
  constexpr int NW = 8;
  constexpr int RB = 4;
  constexpr int KB = 4;
  constexpr int NK = D / 32;
  constexpr float LOWEST = -1.0e30f;
  LX_SHARED float sm_m[NW * RB];
  LX_SHARED float sm_l[NW * RB];
  LX_SHARED float sm_o[RB * D];
  const int tid = LX_TID_X;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int split = LX_BID_X;
  const int nsplit = LX_NBLK_X;
  const int Hq = q_shape[1];
  const int T = q_shape[2];
  const int Hkv = k_shape[1];
  // kv_len[0] >= 0: the valid keys of a fixed-capacity cache (a device scalar); k, v may hold rows past them
  const int L = kv_len[0] < 0 ? k_shape[2] : (kv_len[0] < k_shape[2] ? kv_len[0] : k_shape[2]);
  const int G = Hq / Hkv;
  const int rows = G * T;
  const int bi = LX_BID_Z / Hkv;
  const int hk = LX_BID_Z % Hkv;
  const int row0 = LX_BID_Y * RB;
  const int chunk = nsplit == 1 ? L : chunk_keys[0];
  const bool causal = chunk_keys[1] != 0;
  const int k0 = split * chunk;
  const int k1 = (k0 + chunk < L) ? k0 + chunk : L;
  const float qscale = SCALE;

  // Row r of this block is (g, t) = divmod(row0 + r, T); a row past the last gets hi = -1 (no keys).
  float qr[RB][NK], acc[RB][NK], m[RB], l[RB];
  int hi[RB];
  int kend = k0;
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int row = row0 + r < rows ? row0 + r : rows - 1;
    const int g = row / T;
    const int t = row % T;
    const int lim = causal ? L - T + t : L - 1;
    hi[r] = row0 + r < rows ? (lim < k1 - 1 ? lim : k1 - 1) : -1;
    kend = hi[r] + 1 > kend ? hi[r] + 1 : kend;
    const int64_t qb = bi * q_strides[0] + (hk * G + g) * q_strides[1] + t * q_strides[2];
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      qr[r][i] = LX_F32(q[qb + (lane + 32 * i) * q_strides[3]]) * qscale;
      acc[r][i] = 0.0f;
    }
    m[r] = LOWEST;
    l[r] = 0.0f;
  }

  const int64_t kb0 = bi * k_strides[0] + hk * k_strides[1];
  const int64_t vb0 = bi * v_strides[0] + hk * v_strides[1];
  for (int j0 = k0 + warp * KB; j0 < kend; j0 += NW * KB) {
    // KB keys per step (their loads in flight together); a key past kend reloads key kend - 1 and is masked.
    float kx[KB][NK], vx[KB][NK];
#pragma unroll
    for (int c = 0; c < KB; ++c) {
      const int j = j0 + c < kend ? j0 + c : kend - 1;
      const int64_t kb = kb0 + j * k_strides[2];
      const int64_t vb = vb0 + j * v_strides[2];
#pragma unroll
      for (int i = 0; i < NK; ++i) {
        kx[c][i] = LX_F32(k[kb + (lane + 32 * i) * k_strides[3]]);
        vx[c][i] = LX_F32(v[vb + (lane + 32 * i) * v_strides[3]]);
      }
    }
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      float s[KB];
      float mnew = m[r];
#pragma unroll
      for (int c = 0; c < KB; ++c) {
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < NK; ++i) part = LX_FMA(qr[r][i], kx[c][i], part);
        s[c] = LX_SIMD_SUM(part);
        mnew = j0 + c <= hi[r] ? LX_FMAX(mnew, s[c]) : mnew;
      }
      const float corr = LX_EXP(m[r] - mnew);
      m[r] = mnew;
      float p[KB];
#pragma unroll
      for (int c = 0; c < KB; ++c) p[c] = j0 + c <= hi[r] ? LX_EXP(s[c] - mnew) : 0.0f;
      l[r] = LX_FMA(l[r], corr, p[0]);
#pragma unroll
      for (int c = 1; c < KB; ++c) l[r] += p[c];
#pragma unroll
      for (int i = 0; i < NK; ++i) {
        float a = LX_FMA(p[0], vx[0][i], acc[r][i] * corr);
#pragma unroll
        for (int c = 1; c < KB; ++c) a = LX_FMA(p[c], vx[c][i], a);
        acc[r][i] = a;
      }
    }
  }

  // Merge the NW warps: rescale each to the block max, then add the accumulators warp by warp.
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      sm_m[warp * RB + r] = m[r];
      sm_l[warp * RB + r] = l[r];
    }
  }
  LX_BARRIER;
  float f[RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    float mb = LOWEST;
    for (int w = 0; w < NW; ++w) mb = LX_FMAX(mb, sm_m[w * RB + r]);
    f[r] = LX_EXP(m[r] - mb);
  }
  for (int w = 0; w < NW; ++w) {
    if (warp == w) {
#pragma unroll
      for (int r = 0; r < RB; ++r) {
#pragma unroll
        for (int i = 0; i < NK; ++i) {
          const int e = r * D + lane + 32 * i;
          sm_o[e] = LX_FMA(acc[r][i], f[r], w == 0 ? 0.0f : sm_o[e]);
        }
      }
    }
    LX_BARRIER;
  }
  for (int e = tid; e < RB * D; e += NW * 32) {
    const int r = e / D;
    const int d = e % D;
    if (row0 + r >= rows) continue;
    float mb = LOWEST;
    for (int w = 0; w < NW; ++w) mb = LX_FMAX(mb, sm_m[w * RB + r]);
    float lb = 0.0f;
    for (int w = 0; w < NW; ++w) lb = LX_FMA(sm_l[w * RB + r], LX_EXP(sm_m[w * RB + r] - mb), lb);
    const int g = (row0 + r) / T;
    const int t = (row0 + r) % T;
    const int64_t orow = (int64_t(bi) * Hq + hk * G + g) * T + t;
    if (nsplit == 1) {
      out[orow * D + d] = static_cast<OT>(sm_o[e] / lb);
    } else {
      const int64_t slot = orow * nsplit + split;
      o_part[slot * D + d] = sm_o[e];
      if (d == 0) {
        ml_part[2 * slot] = mb;
        ml_part[2 * slot + 1] = lb;
      }
    }
  }
"""

# One threadgroup of D threads per output row: o = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
_COMBINE = """
  const int ns = o_part_shape[1];
  const int D = o_part_shape[2];
  const int64_t row = LX_BID_X;
  const int d = LX_TID_X;
  if (d < D) {
    float mb = -1.0e30f;
    for (int s = 0; s < ns; ++s) mb = LX_FMAX(mb, ml_part[2 * (row * ns + s)]);
    float acc = 0.0f, lb = 0.0f;
    for (int s = 0; s < ns; ++s) {
      const float w = LX_EXP(ml_part[2 * (row * ns + s)] - mb);
      lb = LX_FMA(w, ml_part[2 * (row * ns + s) + 1], lb);
      acc = LX_FMA(w, o_part[(row * ns + s) * D + d], acc);
    }
    out[row * D + d] = static_cast<OT>(acc / lb);
  }
"""

RB = 4  # query rows per threadgroup (the body's RB)
THREADS = 256  # 8 warps (the body's NW)
# Launch geometry: threadgroups (split, row block, b * Hkv) of 256 threads, then (splits > 1) the combine with one
# threadgroup of D threads per output row. nvcc sm_90: 242 registers at D=256 (80 at D=64), no spills, so one
# threadgroup per SM at D=256. A threadgroup does 2 RB D FMAs per key, so one per kv head is compute bound on its
# SM (Qwen3.5-0.8B decode, L=4096: ~8M FMAs, tens of us) and long caches split into blocks of SPLIT_KEYS keys:
# Qwen3.5-0.8B (B=1, Hkv=2, G=4) decode at L=4096 is 2 x 16 threadgroups + 8 combine threadgroups.
#
# Batch invariance: key j always lands in split j // SPLIT_KEYS and, inside it, in the same warp and step, whatever
# T or L is, so a verify row reduces its keys exactly as the decode step at its position does (a split or warp
# holding only keys past a row's last contributes exact zeros, and the single-launch and combine paths divide the
# same sums). The split size is fixed for that reason, not tuned per length: an earlier rule (splits from L and the
# block count) made a verify row differ from the decode step in bf16 past 512 keys.
SPLIT_KEYS = 256
_INPUTS = ("q", "k", "v", "chunk_keys", "kv_len")
_OUTPUTS = ("out", "o_part", "ml_part")


def num_splits(L: int, split_keys: int = SPLIT_KEYS) -> int:
    """Key splits for L keys (1 = the single-launch path)."""
    return max(1, -(-L // split_keys))


# Parameter arrays are padded to 16 bytes (the kernel reads the head): arrays of <= 8 bytes, which MLX's CUDA
# allocator serves from a shared managed pool, were read more slowly (docs/results/code_measurements.md, 'Small
# parameter arrays').
@functools.cache
def _int_pair(a: int, b: int) -> mx.array:
    return mx.array([a, b, 0, 0], dtype=mx.int32)


_ALL_KEYS = mx.array([-1, 0, 0, 0], dtype=mx.int32)  # kv_len: every key of k, v is valid


def supported(q: mx.array, k: mx.array, v: mx.array, *, causal: bool) -> bool:
    """Shapes the kernel handles: T <= 16, D in {64, 128, 256} for q, k and v, Hq a multiple of Hkv, one dtype."""
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        return False
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    return (
        1 <= T <= 16
        and D in (64, 128, 256)
        and k.shape[0] == B
        and k.shape[3] == D
        and Hq % Hkv == 0
        and L >= (T if causal else 1)
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (mx.float32, mx.bfloat16, mx.float16)
        and B * Hkv <= 65535
    )


def sdpa_kernel_ref(q: mx.array, k: mx.array, v: mx.array, *, scale: float, causal: bool,
                    length: mx.array | None = None) -> mx.array:
    """`sdpa_ref` with the kernel's arguments (causal rather than a mask)."""
    return sdpa_ref(q, k, v, scale=scale, mask="causal" if causal and q.shape[2] > 1 else None, length=length)


@_dialect.op(sdpa_kernel_ref)
def sdpa_kernel(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool,
    init_value: float | None = None,
    splits: int | None = None,
    length: mx.array | None = None,
) -> mx.array:
    """The GPU kernel (Metal or CUDA); same result as `sdpa_ref` with mask None or "causal" (and `length`).

    `splits` forces the number of key splits (tests; default `num_splits`, keys split into blocks of SPLIT_KEYS);
    `init_value` poisons outputs (tests).
    """
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    # causal is a runtime flag, not a template constant: decode (T = 1) and verify rows run the same compiled kernel
    # (two variants rounded differently in rare cases: a verify row then differed from the decode step)
    causal = causal and T > 1
    row_blocks = (Hq // Hkv * T + RB - 1) // RB
    chunk = -(-L // splits) if splits else SPLIT_KEYS
    ns = num_splits(L, chunk)
    part = (B * Hq * T, ns, D) if ns > 1 else (1,)
    kernel = _dialect.build("lattice_sdpa", _BODY, _INPUTS, _OUTPUTS, ensure_row_contiguous=False,
                            consts=_dialect.constants(SCALE=float(scale)))
    out, o_part, ml_part = kernel(
        inputs=[q, k, v, _int_pair(chunk, int(causal)),
                 _ALL_KEYS if length is None else length.astype(mx.int32).reshape(1)],
        template=[("OT", q.dtype), ("D", D)],
        grid=(THREADS * ns, row_blocks, B * Hkv),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[q.shape if ns == 1 else (1,), part, (*part[:2], 2) if ns > 1 else (1,)],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
        init_value=init_value,
    )
    if ns == 1:
        return out
    combine = _dialect.build("lattice_sdpa_combine", _COMBINE, ("o_part", "ml_part"), ("out",))
    return combine(
        inputs=[o_part, ml_part],
        template=[("OT", q.dtype)],
        grid=(D * B * Hq * T, 1, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
        init_value=init_value,
    )[0]


# The kernel serves every T <= 16 at every length, so that a verify row and the decode step at its position run the
# same reduction (batch invariance; MLX's SDPA picks other kernels for one row and for several). It is slower than
# MLX's SDPA only for wide verifies over long contexts, a cost accepted for exactness; an earlier cap that sent long
# contexts to MLX's SDPA lost accuracy past the kernel's tolerance there, so there is no cap
# (docs/results/code_measurements.md, 'Attention at every length').


def sdpa(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None,
         length: mx.array | None = None) -> mx.array:
    """The one entry point the model calls; same contract as `sdpa_ref`. Array masks go to the reference."""
    causal = isinstance(mask, str) and mask == "causal"
    if use_kernels() and (mask is None or causal) and supported(q, k, v, causal=causal):
        try:
            return sdpa_kernel(q, k, v, scale=scale, causal=causal, length=length)
        except _dialect.KernelFailed:
            pass
    return (sdpa_composed if composed(q) else sdpa_ref)(q, k, v, scale=scale, mask=mask, length=length)


def composed(q: mx.array) -> bool:
    """Whether rows the kernel does not take are written out in ops (`sdpa_composed`: several rows on MLX's CUDA
    backend, unless LATTICE_CUDNN_SDPA=1) rather than given to MLX's SDPA."""
    return q.shape[2] > 1 and _cuda_gpu() and not settings.on("cudnn_sdpa")
