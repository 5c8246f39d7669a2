"""Tree GDN recurrence: node i continues from the state after node parents[i] (parents[i] < i; -1 = `state`).

Shapes: q, k [B, N, Hk, Dk]; v [B, N, Hv, Dv]; a, b [B, N, Hv]; A_log, dt_bias [Hv]; state [B, Hv, Dv, Dk] fp32;
parents N ints. Returns y [B, N, Hv, Dv] in v's dtype and the state after every node [B, N, Hv, Dv, Dk] fp32.
"""

from collections.abc import Sequence

import mlx.core as mx

from lattice_mlx.metal import _dialect, use_kernels
from lattice_mlx.metal.gated_delta import _PREAMBLE, _STEP, _prefetch_loop, gated_delta_tree_ref, supported

# The chain kernel's serial form with T = N nodes and a parent lookup per node. The preamble has loaded the
# committed state into S; node t reloads S only when its parent is not t - 1 (node 0's parent is -1, so a chain
# never reloads), from state_in or from the parent's row of state_out, which this same thread wrote.
_BODY = _PREAMBLE + _prefetch_loop("  int pn = -1, pc = -1;\n", "    pc = pn;\n", "      pn = parents[t + 1];\n") + """
    if (pc != t - 1) {
      if (pc < 0) {
        for (int i = 0; i < NK; ++i) S[i] = state_in[srow + lane + 32 * i];
      } else {
        const int prow = (((bi * T + pc) * Hv + hv) * Dv + dv) * Dk + lane;
        for (int i = 0; i < NK; ++i) S[i] = state_out[prow + 32 * i];
      }
    }

""" + _STEP + """\
    const int hvt = (bi * T + t) * Hv + hv;
    if (lane == 0) y[hvt * Dv + dv] = static_cast<YT>(out);
    const int so = (hvt * Dv + dv) * Dk + lane;
    for (int i = 0; i < NK; ++i) state_out[so + 32 * i] = S[i];
  }
"""

_INPUTS = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_in", "parents")
_OUTPUTS = ("y", "state_out")


def _check_parents(parents: Sequence[int]) -> None:
    assert all(-1 <= p < i for i, p in enumerate(parents)), f"parents[i] must be in [-1, i): {list(parents)}"


@_dialect.op(gated_delta_tree_ref)
def gated_delta_tree_kernel(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
    parents: Sequence[int] | mx.array,
    *,
    init_value: float | None = None,
) -> tuple[mx.array, mx.array]:
    """The GPU kernel (Metal or CUDA); same contract as `gated_delta_tree_ref`. `init_value` poisons outputs.

    `parents` as an mx.array (int32 [N]) is not checked: it must already satisfy -1 <= parents[i] < i.
    """
    B, N, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if not isinstance(parents, mx.array):
        _check_parents(parents)
        parents = mx.array(list(parents), dtype=mx.int32)
    assert parents.shape == (N,), f"parents has shape {parents.shape} for {N} nodes"
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    kernel = _dialect.build("lattice_gated_delta_tree", _BODY, _INPUTS, _OUTPUTS)
    y, s = kernel(
        inputs=[q, k, v, a, b, A_log, dt_bias, state.astype(mx.float32), parents.astype(mx.int32)],
        template=[("YT", v.dtype), ("Hk", Hk), ("Hv", Hv), ("Dk", Dk), ("Dv", Dv)],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[v.shape, (B, N, Hv, Dv, Dk)],
        output_dtypes=[v.dtype, mx.float32],
        init_value=init_value,
    )
    return y, s


def gated_delta_tree(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
    parents: Sequence[int],
) -> tuple[mx.array, mx.array]:
    """Tree-verify entry point; same contract as `gated_delta_tree_ref`."""
    if use_kernels() and supported(q, v):
        try:
            return gated_delta_tree_kernel(q, k, v, a, b, A_log, dt_bias, state, parents)
        except _dialect.KernelFailed:
            pass
    return gated_delta_tree_ref(q, k, v, a, b, A_log, dt_bias, state, list(parents))
