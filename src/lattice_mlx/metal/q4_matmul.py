"""4-bit affine matmul with its neighbours fused: y = r + (P(x) @ dequant(w).T), MLX packing.

dequant(w)[n, k] = s[n, k / G] q[n, k] + z[n, k / G]; P is an optional prologue (`Pre`) and r an optional residual.
Shapes: x [..., K] (M = prod of the leading dims; other layouts per `Pre`); w [N, K / 8] uint32 (8 nibbles a word,
low nibble first); scales, biases [N, K / G]; r and y [..., N] in x's dtype. With no prologue and no residual the
result is `mx.quantized_matmul(..., transpose=True)`. One kernel launch replaces the norm / gate / residual ops
around a projection: on MLX's CUDA backend every launch costs host dispatch whatever it computes
(docs/results/code_measurements.md, 'Launch costs').

The same body also reads unquantized weights (`dense_matmul`: w [N, K] in x's dtype), for the linears a model keeps
in bf16 (the MTP head, which `convert -q` leaves unquantized by default, or a whole unquantized checkpoint), so
they get the same fusions and the same batch invariance.
"""

from dataclasses import dataclass
from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn

from lattice_mlx import settings
from lattice_mlx.metal import _dialect, dequant_rows, use_kernels
from lattice_mlx.metal import cuda_gpu as _cuda_gpu  # (a name of this module: tests stub it)

MAX_ROWS = 8  # the rows the kernel takes at most by default; LATTICE_FUSED_ROWS=16: 16 (`max_rows`)


def max_rows() -> int:
    """The rows the fused kernel takes at most: LATTICE_FUSED_ROWS (8, or 16: a batch's steps of up to 16 sequences
    too, in a variant holding 16 rows)."""
    return int(settings.raw("fused_rows") or MAX_ROWS)


@dataclass(frozen=True, eq=False)
class Pre:
    """What the matmul applies to its input first. kind:
    rms        x [..., K] -> rms_norm(x, weight, eps)
    swiglu     x [..., 2K] -> silu(x[..., :K]) * x[..., K:]
    gate       x [B, H, T, D] (attention output) -> x in token order [B, T, H*D] * sigmoid(gate), the gate being the
               second half of each head's [q | gate] block at the start of src [B, T, >= 2 H D]
    gated_rms  x [B, T, H, D] (GDN output) -> rms_norm per head (weight [D], eps) * silu(z), z = src[..., offset:
               offset + H D]
    """

    kind: str
    weight: mx.array | None = None
    eps: float = 0.0
    src: mx.array | None = None
    offset: int = 0


# The plain-ops forms of the prologues: the element-wise chains compiled into one kernel each, as the model ran them
# before they were fused into the matmul (and as the CPU and LATTICE_KERNELS=ref still run them).
@partial(mx.compile, shapeless=True)
def swiglu(g: mx.array, u: mx.array) -> mx.array:
    return nn.silu(g) * u


@partial(mx.compile, shapeless=True)
def _sigmoid_gate(x: mx.array, gate: mx.array) -> mx.array:
    return x * mx.sigmoid(gate)


@partial(mx.compile, shapeless=True)
def _silu_gate(y: mx.array, z: mx.array) -> mx.array:
    return (y.astype(mx.float32) * nn.silu(z.astype(mx.float32))).astype(y.dtype)


def prologue_ref(pre: Pre | None, x: mx.array) -> mx.array:
    """The prologue with plain ops; returns the matmul's input [..., K]."""
    if pre is None:
        return x
    if pre.kind == "rms":
        return mx.fast.rms_norm(x, pre.weight, pre.eps)
    if pre.kind == "swiglu":
        g, u = mx.split(x, 2, axis=-1)
        return swiglu(g, u)
    if pre.kind == "gate":
        B, H, T, D = x.shape
        gate = pre.src[..., : 2 * H * D].reshape(B, T, H, 2 * D)[..., D:]
        return _sigmoid_gate(x.transpose(0, 2, 1, 3).reshape(B, T, -1), gate.reshape(B, T, -1))
    if pre.kind == "gated_rms":
        B, T, H, D = x.shape
        z = pre.src[..., pre.offset : pre.offset + H * D].reshape(B, T, H, D)
        return _silu_gate(mx.fast.rms_norm(x, pre.weight, pre.eps), z).reshape(B, T, -1)
    raise ValueError(f"unknown prologue {pre.kind!r}")


def glu_ref(y: mx.array) -> mx.array:
    """The SwiGLU epilogue with plain ops: y [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    g, u = mx.split(y, 2, axis=-1)
    return swiglu(g, u)


def unfused(matmul, x: mx.array, *, pre: Pre | None = None, residual: mx.array | None = None,
            glu: bool = False) -> mx.array:
    """What a fused kernel does, op by op around `matmul` (a callable on the prologue's output): the prologue, the
    matmul, the SwiGLU epilogue or the residual add."""
    y = matmul(prologue_ref(pre, x))
    y = glu_ref(y) if glu else y
    return y if residual is None else residual + y


def q4_matmul_ref(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int = 4,
                  pre: Pre | None = None, residual: mx.array | None = None, glu: bool = False) -> mx.array:
    """The specification: the prologue with plain ops, the nibbles unpacked with plain ops and dequantised in fp32,
    one fp32 matmul rounded to the activation dtype, then the SwiGLU epilogue (`glu`: w's rows are [gate | up])
    or the residual added."""
    assert bits == 4, "only 4-bit weights"
    N = w.shape[0]
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    q = ((w[..., None] >> shifts) & 0xF).reshape(N, -1).astype(mx.float32)  # [N, K]
    s = mx.repeat(scales.astype(mx.float32), group_size, axis=-1)
    z = mx.repeat(biases.astype(mx.float32), group_size, axis=-1)
    return unfused(lambda x: (x.astype(mx.float32) @ (s * q + z).T).astype(x.dtype), x, pre=pre, residual=residual,
                   glu=glu)


def _round(v: str) -> str:
    """A value rounded to the activation dtype and back, as the unfused ops store their results."""
    return f"static_cast<float>(static_cast<OT>({v}))"


# How each prologue turns x into xv[0..7] = the matmul's input at [m, k0 .. k0+7]. The norms are linear in x up to a
# per-row (rms) or per-head (gated_rms) factor, so that factor is applied to the finished sums instead: the loop
# collects the sum of squares (sq) of the raw values it reads anyway. x is row-major [M, K] except for swiglu
# ([M, 2K]) and gate (the attention output [B, H, T, HD]: [H, M, HD] for one sequence, GB = 0; a batch's rows, GB = 1,
# find their sequence and token).
_LOAD_X = {
    "none": "LX_LOAD8(x + m * K + k0, xv);",
    "rms": """LX_LOAD8(x + m * K + k0, xv);
        for (int i = 0; i < 8; ++i) {
          sq[m] = LX_FMA(xv[i], xv[i], sq[m]);
          xv[i] *= wv[i];
        }""",
    "swiglu": f"""float uv[8];
        LX_LOAD8(x + m * 2 * K + k0, xv);
        LX_LOAD8(x + m * 2 * K + K + k0, uv);
        for (int i = 0; i < 8; ++i) xv[i] = {_round(_round("xv[i] * (1.0f / (1.0f + LX_EXP(-xv[i])))") + " * uv[i]")};""",
    "gate": f"""const int h = k0 / HD, d = k0 - h * HD;
        float gv[8];
        if (GB) {{  // a batch: row m is token m % T of sequence m / T
          const int xt = x_shape[2], xb = m / xt;
          LX_LOAD8(x + ((xb * (K / HD) + h) * xt + (m - xb * xt)) * HD + d, xv);
        }} else {{
          LX_LOAD8(x + (h * M + m) * HD + d, xv);
        }}
        LX_LOAD8(g + m * GSTR + h * 2 * HD + HD + d, gv);
        for (int i = 0; i < 8; ++i) xv[i] = {_round("xv[i] * (1.0f / (1.0f + LX_EXP(-gv[i])))")};""",
    "gated_rms": """float zv[8];
        LX_LOAD8(x + m * K + k0, xv);
        LX_LOAD8(zs + m * ZSTR + ZOFF + k0, zv);
        for (int i = 0; i < 8; ++i) {
          sq[m] = LX_FMA(xv[i], xv[i], sq[m]);
          xv[i] *= wv[i] * (zv[i] * (1.0f / (1.0f + LX_EXP(-zv[i]))));
        }""",
}
# Loads of a chunk that every row m shares, before the row loop (the norm weights).
_LOAD_SHARED = {
    "rms": "float wv[8];\n      LX_LOAD8(nw + k0, wv);",
    "gated_rms": "float wv[8];\n      LX_LOAD8(nw + (k0 % HD), wv);",
}
# What a chunk's partial sums are scaled by before they join the row's: gated_rms, 1 / rms of the chunk's head
# (HD / 32 adjacent lanes hold the HD / 32 chunks of one head in the same pass; their squares join by shuffles).
_CHUNK_SCALE = {
    "gated_rms": """for (int m = 0; m < M; ++m) {
      float hs = sq[m];
      for (int o = 1; o < HD / 32; o <<= 1) hs += LX_SHFL_XOR(hs, o);
      const float f = LX_RSQRT(hs / HD + EPS * 1e-9f);
      for (int r = 0; r < R; ++r) p[r][m] *= f;
      xs[m] *= f;
      sq[m] = 0.0f;
    }""",
}
# rms: the whole row's sum of squares, joined over the block's warps, scales the finished sums.
_ROW_SCALE = {
    "rms": """float ss = 0.0f;
    for (int v = 0; v < SK; ++v) ss += sqs[v * M + m];
    f = LX_RSQRT(ss / K + EPS * 1e-9f);""",
}
_STORE = {
    False: f"y[m * NO + n] = static_cast<OT>({_round('total')});",
    True: f"y[m * NO + n] = static_cast<OT>(LX_F32(res[m * NO + n]) + {_round('total')});",
}
# The SwiGLU epilogue (glu): the block's rows r < R are gate rows n0 + r, rows R + r the matching up rows NO + n0 + r;
# both sums are rounded to the activation dtype (as the unfused matmul stores them), then silu(gate) * up rounded
# as the unfused ops round it.
_GLU = f"""float t2 = 0.0f;
    for (int v = 0; v < SK; ++v) t2 += red[v * {{RR}} * M + R * M + i];
    {{
      const float gv = {_round("total")}, uv = {_round("f * t2")};
      total = {_round(_round("gv * (1.0f / (1.0f + LX_EXP(-gv)))") + " * uv")};
    }}"""
# M, the rows of this call, from x's shape: the template constant MM is the rows the registers and the shared memory
# hold (one variant of MM rows serves every M <= MM; `capacity`), the loops over rows stop at M. MM = 1: M is 1 at
# compile time.
_ROWS_M = {
    "none": """int M = 1;
  if (MM > 1)
    for (int d = 0; d < x_ndim - 1; ++d) M *= x_shape[d];""",
    "gate": """const int M = MM > 1 ? x_shape[0] * x_shape[2] : 1;  // x [B, H, T, D]""",
    "gated_rms": """int M = 1;  // x [B, T, H, D]
  if (MM > 1)
    for (int d = 0; d < x_ndim - 2; ++d) M *= x_shape[d];""",
}
_EXTRA_INPUTS = {"none": (), "rms": ("nw",), "swiglu": (), "gate": ("g",), "gated_rms": ("nw", "zs")}

# One threadgroup/block per R rows of w (per R output columns and their 2R rows with the glu epilogue), its SK warps
# splitting K: thread t takes the 32-value chunks c = t, t + 32 SK, ... of each row (one uint4 of weights, one group,
# so one scale and one bias). x is read once per chunk and used for all the block's rows; each weight nibble becomes
# a float once and feeds M fused multiply-adds. Lane sums, then the SK warp sums in order, one per (row, m). A row's
# sum runs in the same order whatever M and R are (SK depends on the weight's shape only) and every multiply-add is
# an explicit fma (no contraction left to the compiler to choose per variant), so row m of an M-row call is bitwise
# a one-row call on it. RR: the rows a block computes; NO: the output's width.
_BODY = """
  LX_SHARED float red[SK * {RR} * MM];
  LX_SHARED float sqs[SK * MM];
  {ROWS_M}
  const int N = w_shape[0];
  const int NO = {NO};
{W_DEFS}
  const int lane = LX_TID_X % 32;
  const int wid = LX_TID_X / 32;
  const int n0 = LX_BID_X * R;
  if (n0 >= NO) return;  // the whole block: n0 is the block's

  float acc[{RR}][MM], sq[MM];
  for (int m = 0; m < M; ++m) {
    sq[m] = 0.0f;
    for (int r = 0; r < {RR}; ++r) acc[r][m] = 0.0f;
  }

  for (int c = LX_TID_X; c < KC; c += 32 * SK) {
{W_CHUNK}
    float p[{RR}][MM], xs[MM];
    for (int m = 0; m < M; ++m) {
      xs[m] = 0.0f;
      for (int r = 0; r < {RR}; ++r) p[r][m] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int k0 = c * 32 + j * 8;
      float qf[{RR}][8];
{W_ROWS}
      {LOAD_SHARED}
      for (int m = 0; m < M; ++m) {
        float xv[8];
        {LOAD_X}
        xs[m] += ((xv[0] + xv[1]) + (xv[2] + xv[3])) + ((xv[4] + xv[5]) + (xv[6] + xv[7]));
        for (int r = 0; r < {RR}; ++r)
          for (int i = 0; i < 8; ++i) p[r][m] = LX_FMA(qf[r][i], xv[i], p[r][m]);
      }
    }
    {CHUNK_SCALE}
    for (int r = 0; r < {RR}; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = {W_ACC};
  }

  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < {RR}; ++r) {
      const float part = LX_SIMD_SUM(acc[r][m]);
      if (lane == 0) red[(wid * {RR} + r) * M + m] = part;
    }
    const float part = LX_SIMD_SUM(sq[m]);
    if (lane == 0) sqs[wid * M + m] = part;
  }
  LX_BARRIER;
  for (int i = LX_TID_X; i < R * M; i += 32 * SK) {
    const int r = i / M, m = i - (i / M) * M, n = n0 + r;
    float t = 0.0f;
    for (int v = 0; v < SK; ++v) t += red[v * {RR} * M + i];
    float f = 1.0f;
    {ROW_SCALE}
    float total = f * t;
    {GLU}
    if (n < NO) {STORE}
  }
"""


# The weight formats: how a block reads its rows of w. q4: a thread's 32-value chunk of a row is one uint4 of nibbles
# (one quantization group: one scale, one bias), unpacked 8 values at a time; the chunk's sums are scaled and the
# bias times the sum of x added once. dense: w [N, K] in x's dtype (an unquantized model, the MTP head kept in
# bf16), 8 values loaded at a time, the chunk's sums added as they are.
_W_FORMATS = {
    "q4": {
        "W_DEFS": """  const int KW = w_shape[1];
  const int KC = KW / 4;
  const int K = KW * 8;
  const int NG = K / GS;""",
        "W_CHUNK": """    uint32_t wq[{RR}][4];
    float sc[{RR}], bs[{RR}];
    for (int r = 0; r < {RR}; ++r) {
      const int o = r < R ? r : r - R;  // the output column's offset in the block (r >= R: glu's up rows)
      const int n = n0 + o + (r < R ? 0 : NO);
      if (n0 + o < NO) {
        const uint4 u = LX_LOAD_U4(w + n * KW + c * 4);
        wq[r][0] = u.x; wq[r][1] = u.y; wq[r][2] = u.z; wq[r][3] = u.w;
        sc[r] = LX_F32(scales[n * NG + (c * 32) / GS]);
        bs[r] = LX_F32(biases[n * NG + (c * 32) / GS]);
      } else {
        wq[r][0] = 0u; wq[r][1] = 0u; wq[r][2] = 0u; wq[r][3] = 0u;
        sc[r] = 0.0f;
        bs[r] = 0.0f;
      }
    }""",
        "W_ROWS": """      for (int r = 0; r < {RR}; ++r) {
        const uint32_t lo = wq[r][j] & 0x0F0F0F0Fu;
        const uint32_t hi = (wq[r][j] >> 4) & 0x0F0F0F0Fu;
        for (int i = 0; i < 4; ++i) {
          qf[r][2 * i] = LX_BYTE_F(lo, i);
          qf[r][2 * i + 1] = LX_BYTE_F(hi, i);
        }
      }""",
        "W_ACC": "LX_FMA(sc[r], p[r][m], LX_FMA(bs[r], xs[m], acc[r][m]))",
    },
    "dense": {
        "W_DEFS": """  const int K = w_shape[1];
  const int KC = K / 32;""",
        "W_CHUNK": "",
        "W_ROWS": """      for (int r = 0; r < {RR}; ++r) {
        const int o = r < R ? r : r - R;  // the output column's offset in the block (r >= R: glu's up rows)
        const int n = n0 + o + (r < R ? 0 : NO);
        if (n0 + o < NO) {
          LX_LOAD8(w + n * K + k0, qf[r]);
        } else {
          for (int i = 0; i < 8; ++i) qf[r][i] = 0.0f;
        }
      }""",
        "W_ACC": "acc[r][m] + p[r][m]",
    },
}


@cache  # built once per variant: the dispatcher runs per projection and token on uncompiled paths
def body(kind: str, residual: bool, glu: bool = False, fmt: str = "q4") -> str:
    """The kernel body of one prologue kind and weight format, with or without the residual or SwiGLU epilogue (one
    source for both dialects)."""
    out = _BODY
    for key, text in _W_FORMATS[fmt].items():
        out = out.replace("{" + key + "}", text)
    out = out.replace("for (int m = 0; m < M; ++m)", "for (int m = 0; m < MM; ++m) if (m < M)")
    return (out.replace("{ROWS_M}", _ROWS_M.get(kind, _ROWS_M["none"])).replace("{LOAD_X}", _LOAD_X[kind]).replace("{LOAD_SHARED}", _LOAD_SHARED.get(kind, ""))
            .replace("{CHUNK_SCALE}", _CHUNK_SCALE.get(kind, "")).replace("{ROW_SCALE}", _ROW_SCALE.get(kind, ""))
            .replace("{GLU}", _GLU if glu else "").replace("{STORE}", _STORE[residual])
            .replace("{NO}", "N / 2" if glu else "N").replace("{RR}", "(2 * R)" if glu else "R"))


# Rows of w per block by M: the fastest in a sweep on the 248,320 x 1,024 lm_head (docs/results/code_measurements.md,
# 'rows per block').
ROWS = {1: 8, 2: 4, 3: 4, 4: 4, 5: 4, 6: 4, 7: 4, 8: 4}
# ... and past 8 rows (LATTICE_FUSED_ROWS=16) 2: a thread's accumulators are rows per block x the rows held (not swept)
ROWS.update({m: 2 for m in range(9, 17)})
# Fewer rows per block (and K split over up to 4 warps where N is small) until this many warps are in flight: fewer
# warps cannot hide the loads' latency (the same page).
MIN_WARPS = 1024
DTYPES = (mx.bfloat16, mx.float16, mx.float32)


# The rows a variant holds (MM) for a call of M rows. Every variant is a build of its own on first use in a process
# (on MLX's CUDA backend an NVRTC compile that MLX does not keep on disk for custom kernels; Metal builds a library
# per variant too), and a verify of K + 1 rows at each new depth K built a dozen variants of its own, the bulk of a
# first speculative generation's cost. "quad": one variant holds 2..4 rows (verifies of K = 1..3), one 5..8;
# "shared": one variant 2..8; "exact": one per M. Decode keeps its one-row variant. A row's arithmetic is the same
# in every variant (the loops over rows stop at M), so the choice changes no result (tests/metal/test_q4_matmul.py);
# registers held for 8 rows slowed calls of 2-4 rows, 4 rows held for 3 did not (docs/results/code_measurements.md,
# 'Rows a variant holds').
CAPACITIES = ("quad", "shared", "exact")
CAPACITY = "quad"


def capacity(M: int) -> int:
    """MM for a call of M rows under CAPACITY (past MAX_ROWS, with LATTICE_FUSED_ROWS=16: one variant of 16 rows)."""
    if M == 1 or CAPACITY == "exact":
        return M
    if M > MAX_ROWS:
        return max_rows()
    return 4 if CAPACITY == "quad" and M <= 4 else MAX_ROWS


def launch_shape(M: int, N: int, K: int, rows: int | None = None) -> tuple[int, int]:
    """(R rows per block, SK warps splitting K). SK depends on the weight's shape only (batch invariance)."""
    SK = max(1, min(4, K // 1024)) if N <= 4096 else 1
    R = rows or ROWS[M]
    while rows is None and R > 1 and -(-N // R) * SK < MIN_WARPS:
        R //= 2
    return R, SK


def _sizes(pre: Pre | None, x: mx.array) -> tuple[int, int, tuple[int, ...]]:
    """(K, M, the output's leading shape) for x as the prologue reads it."""
    kind = pre.kind if pre is not None else "none"
    if kind == "gate":  # x [B, H, T, D]
        return x.shape[1] * x.shape[3], x.shape[0] * x.shape[2], (x.shape[0], x.shape[2])
    if kind == "gated_rms":  # x [B, T, H, D]
        return x.shape[-2] * x.shape[-1], x.size // (x.shape[-2] * x.shape[-1]), x.shape[:-2]
    K = x.shape[-1] // 2 if kind == "swiglu" else x.shape[-1]
    return K, x.size // x.shape[-1], x.shape[:-1]


def _layout_ok(x: mx.array, K: int, N: int, pre: Pre | None, residual: mx.array | None, glu: bool) -> bool:
    """What both weight formats need of x, the prologue's side inputs and the residual (K: the weight's inputs)."""
    if glu and (N % 2 or residual is not None):
        return False
    if x.ndim < (4 if pre is not None and pre.kind in ("gate", "gated_rms") else 1):
        return False
    Kx, M, _ = _sizes(pre, x)
    if not (Kx == K and K % 32 == 0 and 1 <= M <= max_rows() and x.dtype in DTYPES):
        return False
    if residual is not None and (residual.dtype != x.dtype or residual.size != M * N):  # (no glu here)
        return False
    if pre is None:
        return True
    if pre.kind == "swiglu":
        return x.shape[-1] % 2 == 0
    if pre.kind == "rms":
        return pre.weight.dtype == x.dtype and pre.weight.size == K
    if pre.kind == "gate":  # x [B, H, T, D], src [B, T, S]: S a multiple of 8 (16-byte loads)
        return (x.shape[-1] % 8 == 0 and pre.src.dtype == x.dtype and pre.src.shape[-1] % 8 == 0
                and pre.src.shape[-1] >= 2 * K and pre.src.size == M * pre.src.shape[-1])
    if pre.kind == "gated_rms":  # a warp's lanes run the same passes (K % 1024) and a head spans 2^i lanes
        D = x.shape[-1]
        return (K % 1024 == 0 and D in (32, 64, 128, 256, 512, 1024) and pre.weight.dtype == x.dtype
                and pre.weight.size == D and pre.src.dtype == x.dtype and pre.src.shape[-1] % 8 == 0
                and pre.offset % 8 == 0 and pre.offset + K <= pre.src.shape[-1]
                and pre.src.size == M * pre.src.shape[-1])
    return False


def supported(x: mx.array, w: mx.array, group_size: int, bits: int, pre: Pre | None = None,
              residual: mx.array | None = None, glu: bool = False) -> bool:
    """Shapes and types the kernel handles: 4-bit, K a multiple of 32, M = 1..max_rows() rows, group 32/64/128, the
    residual and the prologue's side inputs in x's dtype and laid out as the body indexes them; the SwiGLU
    epilogue on an even number of rows and without a residual."""
    return (bits == 4 and group_size in (32, 64, 128) and w.dtype == mx.uint32 and w.ndim == 2
            and _layout_ok(x, w.shape[-1] * 8, w.shape[0], pre, residual, glu))


def dense_supported(x: mx.array, w: mx.array, pre: Pre | None = None, residual: mx.array | None = None,
                    glu: bool = False) -> bool:
    """The dense kernel's cases: w [N, K] in x's dtype, otherwise as `supported`."""
    return w.ndim == 2 and w.dtype == x.dtype and _layout_ok(x, w.shape[1], w.shape[0], pre, residual, glu)


def _launch(fmt: str, x: mx.array, weights: list[mx.array], template: list, *, pre: Pre | None,
            residual: mx.array | None, glu: bool, rows: int | None, init_value: float | None) -> mx.array:
    """One launch of the fused matmul body in weight format `fmt` (weights: w, then its scales and biases)."""
    kind = pre.kind if pre is not None else "none"
    w = weights[0]
    K, M, lead = _sizes(pre, x)
    N = w.shape[0]
    R, SK = launch_shape(M, N, K, rows)
    if glu and rows is None:
        R = max(1, R // 2)
    NO = N // 2 if glu else N
    inputs, template = [x, *weights], [("OT", x.dtype), ("MM", capacity(M)), ("R", R), ("SK", SK), *template]
    if kind in ("rms", "gated_rms"):
        inputs.append(pre.weight)
        template.append(("EPS", round(pre.eps * 1e9)))
    if kind == "gate":
        inputs.append(pre.src)
        template += [("HD", x.shape[-1]), ("GSTR", pre.src.shape[-1]), ("GB", int(x.shape[0] > 1))]
    if kind == "gated_rms":
        inputs.append(pre.src)
        template += [("HD", x.shape[-1]), ("ZSTR", pre.src.shape[-1]), ("ZOFF", pre.offset)]
    names = ("x", "w", "scales", "biases")[: 1 + len(weights)] + _EXTRA_INPUTS[kind]
    if residual is not None:
        inputs.append(residual)
        names += ("res",)
    name = f"lattice_{fmt}_{kind}" + ("_res" if residual is not None else "") + ("_glu" if glu else "")
    kernel = _dialect.build(name, body(kind, residual is not None, glu, fmt), names, ("y",))
    (y,) = kernel(
        inputs=inputs,
        template=template,
        grid=(32 * SK * -(-NO // R), 1, 1),
        threadgroup=(32 * SK, 1, 1),
        output_shapes=[(*lead, NO)],
        output_dtypes=[x.dtype],
        init_value=init_value,
    )
    return y


def dense_matmul_ref(x: mx.array, w: mx.array, *, pre: Pre | None = None, residual: mx.array | None = None,
                     glu: bool = False) -> mx.array:
    """The specification of the dense kernel: the prologue with plain ops, one fp32 matmul rounded to the activation
    dtype, then the SwiGLU epilogue or the residual added."""
    return unfused(lambda x: (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(x.dtype), x, pre=pre,
                   residual=residual, glu=glu)


@_dialect.op(q4_matmul_ref)
def q4_matmul_kernel(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
                     bits: int = 4, pre: Pre | None = None, residual: mx.array | None = None, glu: bool = False,
                     rows: int | None = None, init_value: float | None = None) -> mx.array:
    """The GPU kernel (Metal or CUDA); same result as `q4_matmul_ref`. `init_value` poisons the output (tests).
    With `glu` a block computes R output columns from 2R rows of w (R halved: the same rows per block)."""
    assert supported(x, w, group_size, bits, pre, residual, glu), "shape, type or layout not handled by the kernel"
    return _launch("q4", x, [w, scales, biases], [("GS", group_size)], pre=pre, residual=residual, glu=glu,
                   rows=rows, init_value=init_value)


@_dialect.op(dense_matmul_ref)
def dense_matmul_kernel(x: mx.array, w: mx.array, *, pre: Pre | None = None, residual: mx.array | None = None,
                        glu: bool = False, rows: int | None = None, init_value: float | None = None) -> mx.array:
    """The same kernel on an unquantized weight w [N, K] (x's dtype); same result as `dense_matmul_ref`."""
    assert dense_supported(x, w, pre, residual, glu), "shape, type or layout not handled by the kernel"
    return _launch("dense", x, [w], [], pre=pre, residual=residual, glu=glu, rows=rows, init_value=init_value)


# MLX 0.32.4's CUDA quantized matmul returns wrong rows at K = 64 with group size 64 once x has two rows or more
# (docs/results/code_measurements.md, 'small K'; one row, and group 32, are exact). Only
# the tiny test shapes have a K that small, where it turned the prefill logits NaN; below SMALL_K on a CUDA device
# the weight is dequantized and multiplied instead (the fused kernel covers up to 8 rows wherever it applies).
SMALL_K = 256


def small_k_workaround(x: mx.array) -> bool:
    """True where `quantized_matmul` avoids MLX's quantized matmul (above)."""
    K = x.shape[-1]
    return K < SMALL_K and x.size > K and _cuda_gpu()


def dequant_applies(x: mx.array) -> bool:
    """Whether `quantized_matmul` dequantizes for x (its rows at least dequant_rows(), on a CUDA device)."""
    return _cuda_gpu() and 0 < dequant_rows() <= x.size // x.shape[-1]


# Past the fused kernel's rows (a batch's steps and rounds), MLX's CUDA quantized matmul tiles the output only: a
# weight of few outputs and many inputs (the MLP's down projection, the blocks' output projections: 1,024 outputs
# at the 0.8B shape) keeps few blocks busy over a long K. Split over K into SPLIT_K weights of K / SPLIT_K inputs,
# one batched call and a sum give it SPLIT_K times the blocks (docs/results/code_measurements.md, 'Split-K').
SPLIT_K = 4
SPLIT_K_MAX_N = 4096  # weights of at most this many outputs
SPLIT_K_MIN_K = 2048  # and at least this many inputs
SPLIT_K_MAX_ROWS = 64  # up to this many rows (beyond: not measured)


@dataclass(frozen=True, eq=False)
class SplitK:
    """A 4-bit weight [N, K / 8] (scales, biases [N, K / G]) re-laid as `parts` weights of K / parts inputs each,
    [parts, N, K / (8 parts)]: the same nibbles, groups and scales. `source`: the weight it was made from
    (layers.prepare_split_k makes a new layout for a weight replaced since)."""
    parts: int
    w: mx.array
    scales: mx.array
    biases: mx.array
    source: mx.array


def split_k_layout(w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int, bits: int,
                   parts: int = SPLIT_K) -> SplitK | None:
    """The weight's split-K layout (evaluated now: built inside a trace it would be every replay's work), or None
    where the weight is not one that gains (SPLIT_K_MAX_N, SPLIT_K_MIN_K) or K does not split into whole groups."""
    N, K = w.shape[0], w.shape[1] * 32 // bits
    if bits != 4 or biases is None or N > SPLIT_K_MAX_N or K < SPLIT_K_MIN_K or K % (parts * group_size):
        return None
    relaid = [mx.contiguous(a.reshape(N, parts, -1).transpose(1, 0, 2)) for a in (w, scales, biases)]
    mx.eval(relaid)
    return SplitK(parts, *relaid, w)


def split_k_applies(x: mx.array, split: SplitK | None) -> bool:
    """Whether `quantized_matmul` takes the split-K path for x: a layout given, max_rows() < rows <= SPLIT_K_MAX_ROWS,
    on a CUDA device (where it was measured), not dequantizing, LATTICE_SPLIT_K on."""
    rows = x.size // x.shape[-1]
    return (split is not None and max_rows() < rows <= SPLIT_K_MAX_ROWS and _cuda_gpu() and not dequant_applies(x)
            and settings.on("split_k"))


def split_k_matmul(rows: mx.array, split: SplitK, *, group_size: int, bits: int) -> mx.array:
    """rows [M, K] @ dequant(w).T as `split.parts` products of K / parts inputs in one batched call, summed."""
    M, K = rows.shape
    xs = rows.reshape(M, split.parts, K // split.parts).transpose(1, 0, 2)
    out = mx.quantized_matmul(xs, split.w, split.scales, split.biases, transpose=True, group_size=group_size,
                              bits=bits)
    return out.sum(axis=0)


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, *, group_size: int,
                     bits: int, mode: str = "affine", split: SplitK | None = None) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)`, but for MLX's small-K fault on CUDA, and
    from dequant_rows() rows on, the weight dequantized into x's dtype and multiplied (cuBLAS); with `split` (the
    weight's SplitK layout) split over K where `split_k_applies`."""
    # One problem of all the rows: MLX takes x's leading axes as a batch of problems of x.shape[-2] rows each, and its
    # CUDA kernel reads and dequantizes the whole weight once per problem, so a batch of B sequences' steps
    # ([B, 1, K]) read every weight B times, as B one-row problems in 16-row tiles (docs/adr/0009, MLX's quantized
    # matmul dispatch for a batch's steps)
    rows = x.reshape(-1, x.shape[-1]) if x.ndim > 2 else x
    if small_k_workaround(x) or dequant_applies(x):
        dense = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode).astype(x.dtype)
        out = rows @ dense.T
    elif mode == "affine" and split_k_applies(x, split):
        out = split_k_matmul(rows.reshape(-1, rows.shape[-1]), split, group_size=group_size, bits=bits)
    else:
        out = mx.quantized_matmul(rows, w, scales, biases, transpose=True, group_size=group_size, bits=bits, mode=mode)
    return out if rows is x else out.reshape(*x.shape[:-1], out.shape[-1])


def q4_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int = 4,
              pre: Pre | None = None, residual: mx.array | None = None, glu: bool = False,
              split: SplitK | None = None) -> mx.array:
    """The entry point of the model's 4-bit linears: the fused kernel on a GPU wherever it applies (up to 8 rows:
    decode steps, verifies of up to 7 drafts, trees of up to 7 nodes; 16 with LATTICE_FUSED_ROWS=16, a batch's
    steps of up to 16 sequences), else the prologue's plain ops,
    `quantized_matmul` (split over K with `split`, the weight's SplitK layout, where that applies), the SwiGLU ops
    (`glu`) and an add."""
    if use_kernels() and supported(x, w, group_size, bits, pre, residual, glu):
        try:
            return q4_matmul_kernel(x, w, scales, biases, group_size=group_size, bits=bits, pre=pre,
                                    residual=residual, glu=glu)
        except _dialect.KernelFailed:
            pass
    return unfused(lambda x: quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits, split=split), x,
                   pre=pre, residual=residual, glu=glu)


# The dense kernel's weights at most (elements): at the MTP head's shapes it saves launches and GPU time, but on a
# whole bf16 lm_head it reads slower than cuBLAS by more than the launch it saves (docs/results/code_measurements.md,
# 'dense kernel'). Above this size the plain ops run.
DENSE_MAX_WEIGHTS = 1 << 25


def dense_matmul(x: mx.array, w: mx.array, *, pre: Pre | None = None, residual: mx.array | None = None,
                 glu: bool = False) -> mx.array:
    """The entry point of the model's unquantized linears without a bias (w [N, K]): the fused kernel on a GPU
    wherever it applies and w is no larger than DENSE_MAX_WEIGHTS, else the prologue's plain ops, `x @ w.T`, the
    SwiGLU ops and an add."""
    if use_kernels() and w.size <= DENSE_MAX_WEIGHTS and dense_supported(x, w, pre, residual, glu):
        try:
            return dense_matmul_kernel(x, w, pre=pre, residual=residual, glu=glu)
        except _dialect.KernelFailed:
            pass
    return unfused(lambda x: x @ w.T, x, pre=pre, residual=residual, glu=glu)
