"""The MTP head's input in one kernel: concat(rms_norm(e) * we, rms_norm(h) * wh) along the last axis.

The head reads the embedding of the next token and the target's hidden, each through its own RMSNorm, and
concatenates them for its fc projection. MLX runs that as two norms and two copies: four launches per head forward,
twelve per K = 3 round, and on MLX's CUDA backend every launch costs host dispatch
(docs/results/code_measurements.md). Rounding as the unfused
ops round (as qk_norm_rope.py): x * rsqrt(mean(x^2) + eps) to the activation type, times the weight, rounded again.
The sum of squares runs in another order than MLX's norm, so the result is within the activation type's rounding of
the reference, not bitwise.
"""

import mlx.core as mx

from lattice_mlx.metal import _dialect, use_kernels


# One warp per (row m, half j): lane l takes elements l, l + 32, ... of e (j = 0) or h (j = 1). With a pre-norm
# (`_body(True)`), the h half is first normalised by its own weight `wp` (eps PRE_EPS), rounded as the unfused
# norm rounds it, and that row is what the h half's norm reads: three passes over h's row instead of two.
def _body(pre: bool) -> str:
    if pre:
        h_val = "LX_F32(static_cast<OT>(LX_F32(wp[i]) * LX_F32(static_cast<OT>(LX_F32(h[m * H + i]) * pinv))))"
        refine = """
  float pinv = 0.0f;
  if (j == 1) {
    pinv = LX_RSQRT(ss / H + PRE_EPS);
    float ss2 = 0.0f;
    for (int i = lane; i < H; i += 32) {
      const float v = HVAL;
      ss2 = LX_FMA(v, v, ss2);
    }
    ss = LX_SIMD_SUM(ss2);
  }"""
    else:
        h_val, refine = "LX_F32(h[m * H + i])", ""
    return ("""
  const int lane = LX_TID_X;
  const int j = LX_BID_Y;
  const int64_t m = LX_BID_Z;
  float ss = 0.0f;
  for (int i = lane; i < H; i += 32) {
    const float v = j == 0 ? LX_F32(e[m * H + i]) : LX_F32(h[m * H + i]);
    ss = LX_FMA(v, v, ss);
  }
  ss = LX_SIMD_SUM(ss);""" + refine + """
  const float inv = LX_RSQRT(ss / H + EPS);
  for (int i = lane; i < H; i += 32) {
    const float v = j == 0 ? LX_F32(e[m * H + i]) : HVAL;
    const float w = j == 0 ? LX_F32(we[i]) : LX_F32(wh[i]);
    out[m * 2 * H + j * H + i] = static_cast<OT>(w * LX_F32(static_cast<OT>(v * inv)));
  }
""").replace("HVAL", h_val)


_BODY = _body(False)
_BODY_PRE = _body(True)
DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def rms_pair_ref(e: mx.array, h: mx.array, norm_e, norm_h, pre_h=None) -> mx.array:
    """The specification: MLX's two norms (h through `pre_h` first, when given) and a concatenation."""
    return mx.concatenate([norm_e(e), norm_h(pre_h(h) if pre_h is not None else h)], axis=-1)


def supported(e: mx.array, h: mx.array, norm_e, norm_h, pre_h=None) -> bool:
    H = e.shape[-1]
    norms = (norm_e, norm_h) if pre_h is None else (norm_e, norm_h, pre_h)
    return (e.shape == h.shape and e.dtype == h.dtype and all(n.weight.dtype == e.dtype for n in norms)
            and e.dtype in DTYPES and H % 32 == 0 and all(n.weight.shape == (H,) for n in norms)
            and norm_e.eps == norm_h.eps and 0 < e.size // H <= 65535)  # grid z = rows (CUDA's limit)


@_dialect.op(rms_pair_ref)
def rms_pair_kernel(e: mx.array, h: mx.array, norm_e, norm_h, pre_h=None, *,
                    init_value: float | None = None) -> mx.array:
    """The GPU kernel (Metal or CUDA); same contract as `rms_pair_ref`. `init_value` poisons the output (tests)."""
    H = e.shape[-1]
    consts = _dialect.constants(EPS=float(norm_e.eps), PRE_EPS=float(pre_h.eps) if pre_h is not None else 0.0)
    if pre_h is None:
        kernel = _dialect.build("lattice_rms_pair", _BODY, ("e", "h", "we", "wh"), ("out",), consts=consts)
        weights = [norm_e.weight, norm_h.weight]
    else:
        kernel = _dialect.build("lattice_rms_pair_pre", _BODY_PRE, ("e", "h", "we", "wh", "wp"), ("out",),
                                consts=consts)
        weights = [norm_e.weight, norm_h.weight, pre_h.weight]
    (out,) = kernel(
        inputs=[e, h, *weights],
        template=[("OT", e.dtype), ("H", H)],
        grid=(32, 2, e.size // H),
        threadgroup=(32, 1, 1),
        output_shapes=[(*e.shape[:-1], 2 * H)],
        output_dtypes=[e.dtype],
        init_value=init_value,
    )
    return out


def rms_pair(e: mx.array, h: mx.array, norm_e, norm_h, pre_h=None) -> mx.array:
    """The head's entry point: the kernel on a GPU where it applies, the reference otherwise. `pre_h`: a norm h
    goes through first (a draft step's hidden is the head's output before its final norm; the lm_head applies that
    norm in its own prologue, and this kernel again, so no launch computes it on its own)."""
    if use_kernels() and supported(e, h, norm_e, norm_h, pre_h):
        try:
            return rms_pair_kernel(e, h, norm_e, norm_h, pre_h)
        except _dialect.KernelFailed:
            pass
    return rms_pair_ref(e, h, norm_e, norm_h, pre_h)
