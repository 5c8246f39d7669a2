"""Gated DeltaNet recurrence: S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T, y_t = S_t q_t.

Shapes: q, k [B, T, Hk, Dk] (raw, normalised here); v [B, T, Hv, Dv]; a, b [B, T, Hv]; A_log, dt_bias [Hv];
state [B, Hv, Dv, Dk] fp32. Key head of value head h is h // (Hv // Hk).
"""

import mlx.core as mx
import mlx.nn as nn

from lattice_mlx.metal import _dialect, iota, use_kernels


def log_decay_ref(a: mx.array, A_log: mx.array, dt_bias: mx.array) -> mx.array:
    """log g = -exp(A_log) * softplus(a + dt_bias), fp32 [B, T, Hv] (g itself can underflow to 0)."""
    a = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    return -mx.exp(A_log.astype(mx.float32)) * mx.logaddexp(a, 0.0)


def gate_ref(a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """Decay g = exp(-exp(A_log) * softplus(a + dt_bias)) and beta = sigmoid(b), both fp32 [B, T, Hv]."""
    return mx.exp(log_decay_ref(a, A_log, dt_bias)), mx.sigmoid(b.astype(mx.float32))


def normalize_qk_ref(q: mx.array, k: mx.array, eps: float = 1e-6) -> tuple[mx.array, mx.array]:
    """Per-head L2 norm in fp32 (HF's rsqrt(sum x^2 + eps)); q also scaled by Dk^-0.5."""
    q = q.astype(mx.float32)
    k = k.astype(mx.float32)
    q = q * mx.rsqrt((q * q).sum(-1, keepdims=True) + eps) * (q.shape[-1] ** -0.5)
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True) + eps)
    return q, k


def gated_delta_ref(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
    *,
    step_states: bool = False,
) -> tuple[mx.array, mx.array]:
    """The specification: one step at a time, everything in fp32.

    Returns y [B, T, Hv, Dv] in v's dtype and the final state [B, Hv, Dv, Dk], or with `step_states` the state
    after every step [B, T, Hv, Dv, Dk] (index n-1 is the state after the first n tokens).
    """
    q, k, vf, g, beta, state = _prepare(q, k, v, a, b, A_log, dt_bias, state)
    T = k.shape[1]
    ys, states = [], []
    for t in range(T):
        state, y_t = _step(state, q[:, t], k[:, t], vf[:, t], g[:, t], beta[:, t])
        ys.append(y_t)
        if step_states:
            states.append(state)
    y = mx.stack(ys, axis=1).astype(v.dtype)
    return y, (mx.stack(states, axis=1) if step_states else state)


def gated_delta_chunked_ref(q, k, v, a, b, A_log, dt_bias, state, *, chunk: int = 64) -> tuple[mx.array, mx.array]:
    """The same recurrence in chunks (WY form): within a chunk of C steps the delta-rule updates are one unit lower-
    triangular solve, T = (I + tril(diag(beta) K K^T * decay, -1))^-1, so a chunk costs a few matmuls instead of C
    steps. Same contract as `gated_delta_ref` without step_states; the solve runs on the CPU stream."""
    B, T, _, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    q, k, vf, _, beta, S = _prepare(q, k, v, a, b, A_log, dt_bias, state)
    log_g = log_decay_ref(a, A_log, dt_bias)
    pad = (-T) % chunk
    if pad:  # padded steps have beta = 0 and g = 1: they leave the state unchanged
        q, k, vf = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, vf))
        log_g, beta = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (log_g, beta))
    n = (T + pad) // chunk

    def chunks(x):  # [B, n*C, Hv, ...] -> [B, Hv, n, C, ...]
        x = x.reshape(B, n, chunk, Hv, *x.shape[3:])
        return mx.moveaxis(x, 3, 1)

    q, k, vf, beta = chunks(q), chunks(k), chunks(vf), chunks(beta)
    log_g = mx.cumsum(chunks(log_g), axis=-1)  # [B, Hv, n, C] log of the decay since the chunk start
    decay = mx.exp(mx.tril(log_g[..., :, None] - log_g[..., None, :]))  # [.., C, C], exp(G_i - G_j) for j <= i
    lower = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), k=-1)
    kk = (k * beta[..., None]) @ mx.swapaxes(k, -1, -2)
    m = mx.eye(chunk) + mx.where(lower, kk * decay, 0.0)
    t_inv = mx.linalg.tri_inv(m, upper=False, stream=mx.cpu)
    w = t_inv @ (k * (beta * mx.exp(log_g))[..., None])  # [.., C, Dk]: what the incoming state removes
    u = t_inv @ (vf * beta[..., None])  # [.., C, Dv]
    qk = mx.where(mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_)), (q @ mx.swapaxes(k, -1, -2)) * decay, 0.0)
    ys = []
    St = mx.swapaxes(S, -1, -2)  # [B, Hv, Dk, Dv]
    for i in range(n):
        gi = log_g[:, :, i]  # [B, Hv, C]
        v_new = u[:, :, i] - w[:, :, i] @ St  # [B, Hv, C, Dv]
        ys.append((q[:, :, i] * mx.exp(gi)[..., None]) @ St + qk[:, :, i] @ v_new)
        tail = mx.exp(gi[..., -1:] - gi)[..., None]  # decay from each step to the chunk end
        St = St * mx.exp(gi[..., -1])[..., None, None] + mx.swapaxes(k[:, :, i] * tail, -1, -2) @ v_new
    y = mx.stack(ys, axis=2).reshape(B, Hv, n * chunk, Dv)[:, :, :T]
    return mx.moveaxis(y, 1, 2).astype(v.dtype), mx.swapaxes(St, -1, -2)


def _prepare(q, k, v, a, b, A_log, dt_bias, state):
    """fp32 inputs of the recurrence: normalised q/k repeated to the value heads, gates, a zero state if none."""
    B, _, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    q, k = normalize_qk_ref(q, k)
    if Hv != Hk:
        q, k = mx.repeat(q, Hv // Hk, axis=2), mx.repeat(k, Hv // Hk, axis=2)  # [B, T, Hv, Dk]
    g, beta = gate_ref(a, b, A_log, dt_bias)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    return q, k, v.astype(mx.float32), g, beta, state


def _step(state, q, k, v, g, beta):
    """One delta-rule step. Shapes: state [B, Hv, Dv, Dk]; q, k [B, Hv, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]."""
    state = state * g[:, :, None, None]
    kv = (state * k[:, :, None, :]).sum(-1)  # [B, Hv, Dv]
    state = state + ((v - kv) * beta[:, :, None])[..., None] * k[:, :, None, :]
    return state, (state * q[:, :, None, :]).sum(-1)


def gated_delta_tree_ref(q, k, v, a, b, A_log, dt_bias, state, parents: list[int]) -> tuple[mx.array, mx.array]:
    """Tree verify: node i continues from the state after its parent (parents[i] < i; -1 = the committed state).
    Returns y [B, N, Hv, Dv] and the state after every node [B, N, Hv, Dv, Dk]."""
    q, k, vf, g, beta, state = _prepare(q, k, v, a, b, A_log, dt_bias, state)
    ys, states = [], []
    for i, parent in enumerate(parents):
        s, y_i = _step(state if parent < 0 else states[parent], q[:, i], k[:, i], vf[:, i], g[:, i], beta[:, i])
        states.append(s)
        ys.append(y_i)
    return mx.stack(ys, axis=1).astype(v.dtype), mx.stack(states, axis=1)


# Shared by both forms: thread -> (b, hv, dv) row, gate constants, the state row into registers.
# (the thread's ids and the head's constants, without the state: the conv-fused body loads several rows of it)
_IDS = """
  constexpr int NK = Dk / 32;
  const int lane = LX_TID_X;
  const int dv = LX_GID_Y;
  const int bh = LX_BID_Z;
  const int bi = bh / Hv;
  const int hv = bh % Hv;
  const int hk = hv / (Hv / Hk);
  const int T = v_shape[1];
  if (dv >= Dv) return;

  const float neg_A = -LX_EXP(LX_F32(A_log[hv]));
  const float dtb = LX_F32(dt_bias[hv]);
  const float qscale = LX_RSQRT(float(Dk));
"""
_PREAMBLE = _IDS + """
  float S[NK];
  const int srow = (bh * Dv + dv) * Dk;
  for (int i = 0; i < NK; ++i) S[i] = state_in[srow + lane + 32 * i];
"""

# One delta-rule step on registers, shared by the serial, conv-fused and tree bodies: from raw q/k (qc, kc), v (vc)
# and gate inputs (ac = a + dt_bias, bc = b), the L2 norms, gates and the update of S; leaves y in `out`.
# (_GATES: its norms and gates, the same for every value row of a head; the conv-fused body shares them among rows)
_GATES = """\
    float qq = 0.0f, kk = 0.0f;
    for (int i = 0; i < NK; ++i) {
      qq += qc[i] * qc[i];
      kk += kc[i] * kc[i];
    }
    const float qr = LX_RSQRT(LX_SIMD_SUM(qq) + 1e-6f) * qscale;
    const float kr = LX_RSQRT(LX_SIMD_SUM(kk) + 1e-6f);
    const float sp = LX_FMAX(ac, 0.0f) + LX_LOG(1.0f + LX_EXP(-LX_FABS(ac)));
    const float g = LX_EXP(neg_A * sp);
    const float beta = 1.0f / (1.0f + LX_EXP(-bc));
"""
_STEP = _GATES + """
    float kv = 0.0f;
    for (int i = 0; i < NK; ++i) {
      kc[i] *= kr;
      S[i] *= g;
      kv += S[i] * kc[i];
    }
    const float delta = (vc - LX_SIMD_SUM(kv)) * beta;
    float out = 0.0f;
    for (int i = 0; i < NK; ++i) {
      S[i] += kc[i] * delta;
      out += S[i] * qc[i];
    }
    out = LX_SIMD_SUM(out) * qr;
"""

def _prefetch_loop(decl: str = "", shift: str = "", load: str = "") -> str:
    """Opens the serial loop over t that loads step t + 1's q, k, v, a, b while step t computes from the registers
    loaded last time (shared by the chain and the tree body; `decl`, `shift`, `load` add a per-step value)."""
    return """
  float qn[NK] = {0.0f}, kn[NK] = {0.0f}, vn = 0.0f, an = 0.0f, bn = 0.0f;
  float qc[NK], kc[NK], vc = 0.0f, ac = 0.0f, bc = 0.0f;
""" + decl + """  for (int t = -1; t < T; ++t) {
    for (int i = 0; i < NK; ++i) {
      qc[i] = qn[i];
      kc[i] = kn[i];
    }
    vc = vn;
    ac = an + dtb;
    bc = bn;
""" + shift + """    if (t + 1 < T) {
      const int qk = ((bi * T + t + 1) * Hk + hk) * Dk + lane;
      const int hvn = (bi * T + t + 1) * Hv + hv;
      for (int i = 0; i < NK; ++i) {
        qn[i] = LX_F32(q[qk + 32 * i]);
        kn[i] = LX_F32(k[qk + 32 * i]);
      }
      vn = LX_F32(v[hvn * Dv + dv]);
      an = LX_F32(a[hvn]);
      bn = LX_F32(b[hvn]);
""" + load + """    }
    if (t < 0) continue;
"""


# One simdgroup/warp per state row (b, hv, dv); lane l holds S[dv, l + 32 i] in registers for the whole sequence.
# Each step: L2-normalise q and k (two lane sums), gates from a/b, then the delta rule with two more lane sums.
# The next step's inputs are loaded before the current step's arithmetic so their latency overlaps it.
_BODY = _PREAMBLE + """
  // Iteration t issues the loads of step t + 1, then computes step t from the registers loaded last time.""" + \
    _prefetch_loop() + """
""" + _STEP + """\
    const int hvt = (bi * T + t) * Hv + hv;
    if (lane == 0) y[hvt * Dv + dv] = static_cast<YT>(out);
    if (STEP) {
      const int so = (hvt * Dv + dv) * Dk + lane;
      for (int i = 0; i < NK; ++i) state_out[so + 32 * i] = S[i];
    }
  }
  if (!STEP) {
    for (int i = 0; i < NK; ++i) state_out[srow + lane + 32 * i] = S[i];
  }
"""

# The same recurrence with the state-independent lane sums taken 32 steps at a time: lane l computes the gates
# of step t0 + l, and the y and |q|^2 partial sums of 32 steps are reduced together (31 shuffles for 32 sums,
# off the step-to-step chain). Each step keeps only the k norm and S k sums on its critical path.
_BODY_BATCHED = _PREAMBLE + """
  for (int t0 = 0; t0 < T; t0 += 32) {
    const int nb = (T - t0 < 32) ? (T - t0) : 32;
    float gl = 1.0f, bl = 0.0f, vl = 0.0f;
    if (lane < nb) {
      const int hvt = (bi * T + t0 + lane) * Hv + hv;
      const float ac = LX_F32(a[hvt]) + dtb;
      gl = LX_EXP(neg_A * (LX_FMAX(ac, 0.0f) + LX_LOG(1.0f + LX_EXP(-LX_FABS(ac)))));
      bl = 1.0f / (1.0f + LX_EXP(-LX_F32(b[hvt])));
      vl = LX_F32(v[hvt * Dv + dv]);
    }
    float qn[NK], kn[NK];
    const int qk0 = ((bi * T + t0) * Hk + hk) * Dk + lane;
    for (int i = 0; i < NK; ++i) {
      qn[i] = LX_F32(q[qk0 + 32 * i]);
      kn[i] = LX_F32(k[qk0 + 32 * i]);
    }
    float out[32], qq[32];
#pragma unroll
    for (int s = 0; s < 32; ++s) {
      out[s] = 0.0f;
      qq[s] = 0.0f;
      if (s < nb) {
        float qc[NK], kc[NK];
        for (int i = 0; i < NK; ++i) {
          qc[i] = qn[i];
          kc[i] = kn[i];
        }
        if (s + 1 < nb) {
          const int qk = qk0 + (s + 1) * Hk * Dk;
          for (int i = 0; i < NK; ++i) {
            qn[i] = LX_F32(q[qk + 32 * i]);
            kn[i] = LX_F32(k[qk + 32 * i]);
          }
        }
        float kk = 0.0f;
        for (int i = 0; i < NK; ++i) {
          kk += kc[i] * kc[i];
          qq[s] += qc[i] * qc[i];
        }
        const float kr = LX_RSQRT(LX_SIMD_SUM(kk) + 1e-6f);
        const float g = LX_SHFL(gl, s);
        const float beta = LX_SHFL(bl, s);
        const float vs = LX_SHFL(vl, s);
        float kv = 0.0f;
        for (int i = 0; i < NK; ++i) {
          S[i] *= g;
          kv += S[i] * kc[i];
        }
        const float dk = (vs - LX_SIMD_SUM(kv) * kr) * beta * kr;
        for (int i = 0; i < NK; ++i) {
          S[i] += kc[i] * dk;
          out[s] += S[i] * qc[i];
        }
        if (STEP) {
          const int so = (((bi * T + t0 + s) * Hv + hv) * Dv + dv) * Dk + lane;
          for (int i = 0; i < NK; ++i) state_out[so + 32 * i] = S[i];
        }
      }
    }
    // Recursive halving: after the level of width w, out[i] holds the partial sum for step i + (lane & (32 - w)).
#pragma unroll
    for (int level = 0; level < 5; ++level) {
      const int w = 16 >> level;
      const bool upper = (lane & w) != 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (i < w) {
          const float send_o = upper ? out[i] : out[i + w];
          const float send_q = upper ? qq[i] : qq[i + w];
          out[i] = (upper ? out[i + w] : out[i]) + LX_SHFL_XOR(send_o, w);
          qq[i] = (upper ? qq[i + w] : qq[i]) + LX_SHFL_XOR(send_q, w);
        }
      }
    }
    if (lane < nb) {
      const int hvt = (bi * T + t0 + lane) * Hv + hv;
      y[hvt * Dv + dv] = static_cast<YT>(out[0] * LX_RSQRT(qq[0] + 1e-6f) * qscale);
    }
  }
  if (!STEP) {
    for (int i = 0; i < NK; ++i) state_out[srow + lane + 32 * i] = S[i];
  }
"""

_BODIES = {"serial": _BODY, "batched": _BODY_BATCHED}
# The batched form from this T on: below it the serial form is faster, above it the batched one
# (docs/results/code_measurements.md, 'GDN kernel's two forms').
BATCHED_FROM_T = 16
_INPUTS = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_in")
_OUTPUTS = ("y", "state_out")


def supported(q: mx.array, v: mx.array) -> bool:
    """Shapes the kernel handles: Dk a multiple of 32 up to 256, Dv a multiple of 4, Hv a multiple of Hk."""
    Dk, Hk = q.shape[-1], q.shape[-2]
    Dv, Hv = v.shape[-1], v.shape[-2]
    return Dk % 32 == 0 and Dk <= 256 and Dv % 4 == 0 and Hv % Hk == 0 and v.shape[1] > 0


@_dialect.op(gated_delta_ref)
def gated_delta_kernel(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
    *,
    step_states: bool = False,
    form: str | None = None,
    init_value: float | None = None,
) -> tuple[mx.array, mx.array]:
    """The GPU kernel (Metal or CUDA); same contract as `gated_delta_ref`.

    `form` is "serial" or "batched" (default: by T, see BATCHED_FROM_T); `init_value` poisons outputs (tests).
    """
    B, T, Hk, Dk = k.shape
    form = form or ("batched" if T >= BATCHED_FROM_T else "serial")
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    kernel = _dialect.build(f"lattice_gated_delta_{form}", _BODIES[form], _INPUTS, _OUTPUTS)
    s_shape = (B, T, Hv, Dv, Dk) if step_states else (B, Hv, Dv, Dk)
    y, s = kernel(
        inputs=[q, k, v, a, b, A_log, dt_bias, state if state.dtype == mx.float32 else state.astype(mx.float32)],
        template=[("YT", v.dtype), ("Hk", Hk), ("Hv", Hv), ("Dk", Dk), ("Dv", Dv), ("STEP", step_states)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[v.shape, s_shape],
        output_dtypes=[v.dtype, mx.float32],
        init_value=init_value,
    )
    return y, s


# Prompt chunks at least this long take the chunked form where no kernel runs. On the 2-core CPU a 512-token demo
# prefill went 128 -> 131 tok/s only: MLX's CPU matmuls dominate there (~2 GFLOP/s, 18x slower than numpy's here).
CHUNKED_FROM_T = 32


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
    *,
    step_states: bool = False,
) -> tuple[mx.array, mx.array]:
    """The one entry point the model calls; same contract as `gated_delta_ref`."""
    if use_kernels() and supported(q, v):
        try:
            return gated_delta_kernel(q, k, v, a, b, A_log, dt_bias, state, step_states=step_states)
        except _dialect.KernelFailed:
            pass
    if not step_states and q.shape[1] >= CHUNKED_FROM_T:
        return gated_delta_chunked_ref(q, k, v, a, b, A_log, dt_bias, state)
    return gated_delta_ref(q, k, v, a, b, A_log, dt_bias, state, step_states=step_states)


# --- decode / verify with the causal conv fused in -----------------------------------------------------------------
# The GDN mixer's conv (depthwise, width KC, then SiLU) fed the kernel through concatenate + conv1d + SiLU + split +
# three contiguous copies: ~7 launches, costing more than the recurrence itself (the same page). This form
# reads the raw projection and the conv state, keeps each channel's window in registers, and writes the
# concatenated conv input [B, KC-1+T, C] that the cache slices (new conv state) or keeps (rollback).
# A warp takes DVW adjacent value rows (b, hv, dv .. dv + DVW - 1): the q/k conv, their norms and the gates, the
# same for every row of a head, are computed once for DVW rows. With one row per warp a batch's call was a dozen
# waves of warps running the same latency chain, and its time grew with the sequences as if each ran alone; four rows
# per warp cut it by a third at 16 sequences and by half at 64 (docs/results/code_measurements.md, 'GDN rows per
# warp'). Each row's arithmetic is the one-row form's, in the same order, whatever DVW is.
_BODY_CONV = _IDS.replace("v_shape[1]", "qkv_shape[1]").replace("LX_GID_Y;", "LX_GID_Y * DVW;  // the first row") + """
  // state_in [B, ST, Hv, Dv, Dk]: step pick[PR * bi + 1] (0 for a plain state, [B, 1, ...]). pick: [row, step, ..]
  // for every sequence (PR = 0), or a batch's rounds' [B, 2], each sequence's own (PR = 2)
  float S[DVW][NK];
  for (int d = 0; d < DVW; ++d) {
    const int si = (((bi * state_in_shape[1] + pick[PR * bi + 1]) * Hv + hv) * Dv + dv + d) * Dk + lane;
    for (int i = 0; i < NK; ++i) S[d][i] = state_in[si + 32 * i];
  }
  constexpr int C = 2 * Hk * Dk + Hv * Dv;
  constexpr int W = KC - 1;
  const bool qk_writer = (dv == 0) && (hv % (Hv / Hk) == 0);
  int cq[NK];
  float wq[NK][KC], wk[NK][KC], wv[DVW][KC], xq[NK][KC], xk[NK][KC], xv[DVW][KC];
  const int cv = 2 * Hk * Dk + hv * Dv + dv;  // row d's channel: cv + d
  for (int i = 0; i < NK; ++i) cq[i] = hk * Dk + lane + 32 * i;
  for (int j = 0; j < KC; ++j) {
    for (int i = 0; i < NK; ++i) {
      wq[i][j] = LX_F32(conv_w[cq[i] * KC + j]);
      wk[i][j] = LX_F32(conv_w[(Hk * Dk + cq[i]) * KC + j]);
    }
    for (int d = 0; d < DVW; ++d) wv[d][j] = LX_F32(conv_w[(cv + d) * KC + j]);
  }
  // Window rows 0..W-1 come from the conv state (rows pick[PR * bi] .. + W - 1 of conv_state [B, R, C]: a plain
  // window, or a previous verify's whole conv input); they are also the first rows of conv_in.
  for (int r = 0; r < W; ++r) {
    const int src = (bi * conv_state_shape[1] + pick[PR * bi] + r) * C;
    const int dst = (bi * (W + T) + r) * C;
    for (int i = 0; i < NK; ++i) {
      xq[i][r] = LX_F32(conv_state[src + cq[i]]);
      xk[i][r] = LX_F32(conv_state[src + Hk * Dk + cq[i]]);
      if (qk_writer) {
        conv_in[dst + cq[i]] = static_cast<YT>(xq[i][r]);
        conv_in[dst + Hk * Dk + cq[i]] = static_cast<YT>(xk[i][r]);
      }
    }
    for (int d = 0; d < DVW; ++d) {
      xv[d][r] = LX_F32(conv_state[src + cv + d]);
      if (lane == d) conv_in[dst + cv + d] = static_cast<YT>(xv[d][r]);
    }
  }
  for (int t = 0; t < T; ++t) {
    // qkv, b and a rows through their row strides and first columns (constants QKV_S, QKV_C, B_S, B_C, A_S, A_C):
    // separate arrays, or column ranges of the fused projection's output read in place
    const int bt = bi * T + t;
    const int src = bt * QKV_S + QKV_C;
    const int dst = (bi * (W + T) + W + t) * C;
    float qc[NK], kc[NK], vc[DVW];
    for (int i = 0; i < NK; ++i) {
      xq[i][W] = LX_F32(qkv[src + cq[i]]);
      xk[i][W] = LX_F32(qkv[src + Hk * Dk + cq[i]]);
      if (qk_writer) {
        conv_in[dst + cq[i]] = static_cast<YT>(xq[i][W]);
        conv_in[dst + Hk * Dk + cq[i]] = static_cast<YT>(xk[i][W]);
      }
    }
    // conv + SiLU, rounded to the activation type where the unfused path rounds (conv output, SiLU output)
    for (int d = 0; d < DVW; ++d) {
      xv[d][W] = LX_F32(qkv[src + cv + d]);
      if (lane == d) conv_in[dst + cv + d] = static_cast<YT>(xv[d][W]);
      float sv = 0.0f;
      for (int j = 0; j < KC; ++j) sv += wv[d][j] * xv[d][j];
      sv = LX_F32(static_cast<YT>(sv));
      vc[d] = LX_F32(static_cast<YT>(sv / (1.0f + LX_EXP(-sv))));
    }
    for (int i = 0; i < NK; ++i) {
      float sq = 0.0f, sk = 0.0f;
      for (int j = 0; j < KC; ++j) {
        sq += wq[i][j] * xq[i][j];
        sk += wk[i][j] * xk[i][j];
      }
      sq = LX_F32(static_cast<YT>(sq));
      sk = LX_F32(static_cast<YT>(sk));
      qc[i] = LX_F32(static_cast<YT>(sq / (1.0f + LX_EXP(-sq))));
      kc[i] = LX_F32(static_cast<YT>(sk / (1.0f + LX_EXP(-sk))));
    }
    for (int j = 0; j < W; ++j) {
      for (int i = 0; i < NK; ++i) {
        xq[i][j] = xq[i][j + 1];
        xk[i][j] = xk[i][j + 1];
      }
      for (int d = 0; d < DVW; ++d) xv[d][j] = xv[d][j + 1];
    }
    const int hvt = (bi * T + t) * Hv + hv;
    const float ac = LX_F32(a[bt * A_S + A_C + hv]) + dtb;
    const float bc = LX_F32(b[bt * B_S + B_C + hv]);

    // the delta-rule step (as _STEP), its norms and gates once for the DVW rows
""" + _GATES + """\
    for (int i = 0; i < NK; ++i) kc[i] *= kr;
    for (int d = 0; d < DVW; ++d) {
      float kv = 0.0f;
      for (int i = 0; i < NK; ++i) {
        S[d][i] *= g;
        kv += S[d][i] * kc[i];
      }
      const float delta = (vc[d] - LX_SIMD_SUM(kv)) * beta;
      float out = 0.0f;
      for (int i = 0; i < NK; ++i) {
        S[d][i] += kc[i] * delta;
        out += S[d][i] * qc[i];
      }
      out = LX_SIMD_SUM(out) * qr;
      if (lane == 0) y[hvt * Dv + dv + d] = static_cast<YT>(out);
      if (STEP) {
        const int so = (hvt * Dv + dv + d) * Dk + lane;
        for (int i = 0; i < NK; ++i) state_out[so + 32 * i] = S[d][i];
      }
    }
  }
  if (!STEP) {
    for (int d = 0; d < DVW; ++d) {
      const int so = (bh * Dv + dv + d) * Dk + lane;
      for (int i = 0; i < NK; ++i) state_out[so + 32 * i] = S[d][i];
    }
  }
"""
# Value rows per warp (DVW) of the fused form: one for a single sequence (its 2,048 warps on the 0.8B shape fit one
# wave; more rows per warp would lengthen the one chain it waits for), CONV_ROWS_PER_WARP for a batch with key
# heads of up to 128 (measured there; at 256 a thread's four rows of state and windows would double its registers).
CONV_ROWS_PER_WARP = 4


def conv_rows_per_warp(B: int, Dv: int, Dk: int = 128) -> int:
    """DVW for a call over B sequences with Dv value rows per head and key heads of Dk."""
    return CONV_ROWS_PER_WARP if B > 1 and Dk <= 128 and Dv % CONV_ROWS_PER_WARP == 0 else 1


# Offsets are 32-bit (the run-5 form: 96 registers against 108-110 with 64-bit ones); the wrapper checks the sizes.
# Without a pick (plain decode and verify) the body reads step 0 and window row 0 and takes no `pick` input.
_BODY_CONV_NO_PICK = _BODY_CONV.replace("pick[PR * bi]", "0").replace("pick[PR * bi + 1]", "0")
_CONV_INPUTS = ("qkv", "conv_state", "conv_w", "a", "b", "A_log", "dt_bias", "state_in", "pick")
_CONV_OUTPUTS = ("y", "state_out", "conv_in")
# The fused form serves decode and verify (T below this); longer prompts take conv1d + the batched form.
CONV_FUSED_MAX_T = BATCHED_FROM_T - 1


def conv_silu_ref(conv_in: mx.array, conv_w: mx.array) -> mx.array:
    """Depthwise causal conv + SiLU over conv_in [B, KC-1+T, C] with weight [C, KC]: [B, T, C].

    KC shifted multiply-adds accumulated in fp32, the sum rounded to the activation type before the SiLU (where
    conv1d and the fused kernel round), not `mx.conv1d`: on CUDA conv1d goes through cuDNN, which plans per input
    shape, so every new prompt length paid a plan once (docs/results/code_measurements.md)."""
    KC = conv_w.shape[1]
    T = conv_in.shape[1] - KC + 1
    w = conv_w.astype(mx.float32)
    acc = conv_in[:, :T].astype(mx.float32) * w[:, 0]
    for j in range(1, KC):
        acc = acc + conv_in[:, j : j + T].astype(mx.float32) * w[:, j]
    return nn.silu(acc.astype(conv_in.dtype))


def picked(conv_state: mx.array, state: mx.array | None, pick: mx.array | None, window: int):
    """With `pick` = [row, step, ..] (device int32): the window rows row .. row + window - 1 of conv_state [B, R, C]
    and step `step` of state [B, ST, Hv, Dv, Dk] (a previous verify's conv input and per-step states); with `pick`
    [B, 2], each sequence's own row and step (a batch's rounds); else as given."""
    if pick is None:
        return conv_state, state
    if pick.ndim == 2:
        rows = pick[:, :1] + iota(window)[None]  # [B, window]
        steps = pick[:, 1].reshape(-1, *([1] * (state.ndim - 1)))
        return (mx.take_along_axis(conv_state, rows[..., None], axis=1),
                mx.take_along_axis(state, steps, axis=1).squeeze(1))
    return mx.take(conv_state, pick[0] + iota(window), axis=1), mx.take(state, pick[1], axis=1)


def gated_delta_conv_ref(qkv, conv_state, conv_w, a, b, A_log, dt_bias, state, *, heads: tuple[int, int, int, int],
                         step_states: bool = False, pick: mx.array | None = None,
                         packed: tuple[mx.array, int, int] | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """Reference of the fused form: conv_in = [conv_state; qkv], conv + SiLU, split into q/k/v, the recurrence.
    heads = (Hk, Dk, Hv, Dv). Returns y [B, T, Hv, Dv], the state (final or per step) and conv_in. `pick`: see
    `picked`; `packed`: see `gated_delta_conv_kernel`."""
    Hk, Dk, Hv, Dv = heads
    if packed is not None:
        qkv, a, b = unpack(packed, 2 * Hk * Dk + Hv * Dv, Hv)
    B, T, _ = qkv.shape
    conv_state, state = picked(conv_state, state, pick, conv_w.shape[-1] - 1)
    conv_in = mx.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)
    q, k, v = mx.split(conv_silu_ref(conv_in, conv_w), [Hk * Dk, 2 * Hk * Dk], axis=-1)
    y, s = gated_delta_update(q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk), v.reshape(B, T, Hv, Dv), a, b,
                              A_log, dt_bias, state, step_states=step_states)
    return y, s, conv_in


def unpack(packed: tuple[mx.array, int, int], C: int, Hv: int) -> tuple[mx.array, mx.array, mx.array]:
    """(qkv, a, b) as views of a packed projection output (src, b_col, a_col)."""
    src, b_col, a_col = packed
    return src[..., :C], src[..., a_col : a_col + Hv], src[..., b_col : b_col + Hv]


@_dialect.op(gated_delta_conv_ref)
def gated_delta_conv_kernel(qkv, conv_state, conv_w, a, b, A_log, dt_bias, state, *,
                            heads: tuple[int, int, int, int], step_states: bool = False,
                            packed: tuple[mx.array, int, int] | None = None, pick: mx.array | None = None,
                            init_value: float | None = None, rows: int | None = None
                            ) -> tuple[mx.array, mx.array, mx.array]:
    """The GPU kernel of the fused form; same contract as `gated_delta_conv_ref`. With `packed` = (src, b_col,
    a_col), qkv, b and a are read in place as columns [0, C), [b_col, b_col + Hv), [a_col, a_col + Hv) of src
    [B, T, S] (the fused in_proj's output), and the qkv, a, b arguments are ignored: no copies of the slices.
    With `pick` the window and the state are read in place from a previous verify's conv input and per-step
    states (`picked`): no gathers (pipelined rounds). `rows`: value rows per warp (default `conv_rows_per_warp`)."""
    Hk, Dk, Hv, Dv = heads
    C = 2 * Hk * Dk + Hv * Dv
    KC = conv_w.shape[-1]
    if packed is not None:
        src, b_col, a_col = packed
        S = src.shape[-1]
        qkv = a = b = src
        cols = _dialect.constants(QKV_S=S, QKV_C=0, B_S=S, B_C=b_col, A_S=S, A_C=a_col)
    else:
        assert qkv.shape[-1] == C and a.shape[-1] == b.shape[-1] == Hv
        cols = _dialect.constants(QKV_S=C, QKV_C=0, B_S=Hv, B_C=0, A_S=Hv, A_C=0)
    B, T, _ = qkv.shape
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if pick is None:
        assert conv_state.shape[1:] == (KC - 1, C)
        state = state.reshape(B, 1, Hv, Dv, Dk)
        kernel = _dialect.build("lattice_gated_delta_conv", _BODY_CONV_NO_PICK, _CONV_INPUTS[:-1], _CONV_OUTPUTS,
                                consts=cols)
        extra = []
    else:
        assert conv_state.shape[1] >= KC - 1 and conv_state.shape[2] == C and state.ndim == 5
        assert pick.shape == (B, 2) or (pick.ndim == 1 and pick.size >= 2), pick.shape
        kernel = _dialect.build("lattice_gated_delta_conv_pick", _BODY_CONV, _CONV_INPUTS, _CONV_OUTPUTS,
                                consts=cols)
        extra = [pick if pick.dtype == mx.int32 else pick.astype(mx.int32)]
    # 32-bit offsets in the body
    assert max(qkv.size, conv_state.size, state.size, B * (KC - 1 + T) * C, B * T * Hv * Dv * Dk) < 2**31
    s_shape = (B, T, Hv, Dv, Dk) if step_states else (B, Hv, Dv, Dk)
    dvw = rows or conv_rows_per_warp(B, Dv, Dk)
    assert Dv % dvw == 0
    y, s, conv_in = kernel(
        inputs=[qkv, conv_state, conv_w, a, b, A_log, dt_bias,
                state if state.dtype == mx.float32 else state.astype(mx.float32), *extra],
        template=[("YT", qkv.dtype), ("Hk", Hk), ("Hv", Hv), ("Dk", Dk), ("Dv", Dv), ("KC", KC),
                  ("STEP", step_states), ("DVW", dvw), *([("PR", 2 if pick.ndim == 2 else 0)] if extra else [])],
        grid=(32, Dv // dvw, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), s_shape, (B, KC - 1 + T, C)],
        output_dtypes=[qkv.dtype, mx.float32, qkv.dtype],
        init_value=init_value,
    )
    return y, s, conv_in


def gated_delta_conv_update(qkv, conv_state, conv_w, a, b, A_log, dt_bias, state, *,
                            heads: tuple[int, int, int, int], step_states: bool = False,
                            packed: tuple[mx.array, int, int] | None = None, pick: mx.array | None = None
                            ) -> tuple[mx.array, mx.array, mx.array]:
    """The model's entry point for a GDN mixer step after its input projection: conv + SiLU + recurrence.
    conv_state [B, KC-1, C] (zeros when starting), conv_w [C, KC]. qkv, a, b may be None when `packed` (see
    `gated_delta_conv_kernel`) holds them. `pick`: the window and state chosen from a previous verify's arrays
    on the device (`picked`; pipelined rounds)."""
    Hk, Dk, Hv, Dv = heads
    T = (packed[0] if packed is not None else qkv).shape[1]
    if use_kernels() and T <= CONV_FUSED_MAX_T and Dk % 32 == 0 and Dk <= 256 and Dv % 4 == 0 and Hv % Hk == 0:
        try:
            return gated_delta_conv_kernel(qkv, conv_state, conv_w, a, b, A_log, dt_bias, state, heads=heads,
                                           step_states=step_states, packed=packed, pick=pick)
        except _dialect.KernelFailed:
            pass
    return gated_delta_conv_ref(qkv, conv_state, conv_w, a, b, A_log, dt_bias, state, heads=heads,
                                step_states=step_states, pick=pick, packed=packed)
