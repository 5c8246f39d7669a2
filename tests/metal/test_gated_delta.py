import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from _tol import assert_close, out_key

from lattice_mlx.metal import use_kernels
from lattice_mlx.metal.gated_delta import (
    conv_silu_ref,
    gated_delta_conv_kernel,
    gated_delta_conv_ref,
    gated_delta_conv_update,
    gated_delta_kernel,
    gated_delta_ref,
    gated_delta_update,
)

needs_gpu = pytest.mark.kernels  # a GPU backend, or the CPU render (tests/conftest.py)


def make_inputs(B, T, Hk, Hv, Dk, Dv, dtype, *, seed=0, with_state=True):
    """Raw GDN inputs with slow decay (g ~ 0.94..0.999) so that the state carries information for long runs."""
    rng = np.random.default_rng(seed)

    def arr(*shape, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)

    q, k, v = arr(B, T, Hk, Dk), arr(B, T, Hk, Dk), arr(B, T, Hv, Dv)
    a, b = arr(B, T, Hv), arr(B, T, Hv)
    A_log = mx.array(np.log(rng.uniform(0.01, 0.5, Hv)).astype(np.float32))
    dt_bias = mx.array(rng.uniform(-3.0, -1.0, Hv).astype(np.float32))
    state = mx.array((rng.standard_normal((B, Hv, Dv, Dk)) * 0.1).astype(np.float32)) if with_state else None
    return q, k, v, a, b, A_log, dt_bias, state


def numpy_gdn(q, k, v, a, b, A_log, dt_bias, state):
    """An independent float64 loop over (b, t, h), written from the maths in the module docstring."""
    q, k, v, a, b = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v, a, b))
    A_log, dt_bias = np.array(A_log, dtype=np.float64), np.array(dt_bias, dtype=np.float64)
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    S = np.zeros((B, Hv, Dv, Dk)) if state is None else np.array(state, dtype=np.float64)
    y = np.zeros((B, T, Hv, Dv))
    for bi in range(B):
        for t in range(T):
            for h in range(Hv):
                hk = h // (Hv // Hk)
                qv = q[bi, t, hk] / math.sqrt((q[bi, t, hk] ** 2).sum() + 1e-6) / math.sqrt(Dk)
                kv = k[bi, t, hk] / math.sqrt((k[bi, t, hk] ** 2).sum() + 1e-6)
                x = a[bi, t, h] + dt_bias[h]
                g = math.exp(-math.exp(A_log[h]) * math.log1p(math.exp(x)))
                beta = 1 / (1 + math.exp(-b[bi, t, h]))
                S[bi, h] *= g
                S[bi, h] += np.outer((v[bi, t, h] - S[bi, h] @ kv) * beta, kv)
                y[bi, t, h] = S[bi, h] @ qv
    return y, S


# --- reference and dispatch: these run everywhere, the CPU included ---


@pytest.mark.parametrize("Hk,Hv", [(2, 2), (1, 3)], ids=["Hk=Hv", "Hv=3Hk"])
def test_ref_matches_numpy_loop(Hk, Hv):
    inputs = make_inputs(2, 5, Hk, Hv, 32, 16, mx.float32)
    y, s = gated_delta_ref(*inputs)
    y_np, s_np = numpy_gdn(*inputs)
    np.testing.assert_allclose(np.array(y), y_np, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(s), s_np, rtol=1e-4, atol=1e-5)


def test_ref_step_states_equal_one_step_at_a_time():
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(1, 6, 2, 4, 32, 16, mx.float32)
    _, steps = gated_delta_ref(q, k, v, a, b, A_log, dt_bias, state, step_states=True)
    y_all, final = gated_delta_ref(q, k, v, a, b, A_log, dt_bias, state)
    assert steps.shape == (1, 6, 4, 16, 32)
    s = state
    for t in range(6):
        y_t, s = gated_delta_ref(*(x[:, t : t + 1] for x in (q, k, v, a, b)), A_log, dt_bias, s)
        np.testing.assert_allclose(np.array(steps[:, t]), np.array(s), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.array(y_all[:, t]), np.array(y_t[:, 0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(steps[:, -1]), np.array(final), rtol=1e-6, atol=1e-6)


def test_ref_none_state_is_zeros():
    inputs = make_inputs(1, 3, 1, 1, 32, 8, mx.float32, with_state=False)
    y0, s0 = gated_delta_ref(*inputs)
    y1, s1 = gated_delta_ref(*inputs[:-1], mx.zeros((1, 1, 8, 32)))
    assert mx.array_equal(y0, y1) and mx.array_equal(s0, s1)


def test_dispatch_uses_reference_when_forced(monkeypatch):
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    assert not use_kernels()
    inputs = make_inputs(1, 2, 2, 2, 32, 8, mx.bfloat16)
    y, s = gated_delta_update(*inputs, step_states=True)
    y_ref, s_ref = gated_delta_ref(*inputs, step_states=True)
    assert y.dtype == mx.bfloat16 and s.dtype == mx.float32 and s.shape == (1, 2, 2, 8, 32)
    assert mx.array_equal(y, y_ref) and mx.array_equal(s, s_ref)


# --- the GPU kernel against the reference ---

# (B, T, Hk, Hv, Dk, Dv, dtype, step_states)
CASES = {
    "decode-T1-bf16": (1, 1, 16, 16, 128, 128, mx.bfloat16, False),
    "verify-T5-steps-bf16": (1, 5, 16, 16, 128, 128, mx.bfloat16, True),
    "verify-T9-steps-bf16": (1, 9, 16, 16, 128, 128, mx.bfloat16, True),
    "oddT7-B2-Hv2Hk-fp32": (2, 7, 2, 4, 64, 64, mx.float32, False),
    "oddT7-B2-Hv2Hk-steps-fp16": (2, 7, 2, 4, 64, 64, mx.float16, True),
    "T3-Hv3Hk-Dk64-Dv128-steps-fp32": (1, 3, 2, 6, 64, 128, mx.float32, True),
    "long-T300-Dk128-Dv64-bf16": (1, 300, 1, 2, 128, 64, mx.bfloat16, False),
    "T33-qwen-fp16": (1, 33, 16, 16, 128, 128, mx.float16, False),
}


FORMS = ["serial", "batched"]


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_matches_ref(case, form):
    B, T, Hk, Hv, Dk, Dv, dtype, steps = CASES[case]
    inputs = make_inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=len(case))
    y, s = gated_delta_kernel(*inputs, step_states=steps, form=form, init_value=float("nan"))
    y_ref, s_ref = gated_delta_ref(*inputs, step_states=steps)
    assert y.dtype == dtype and s.dtype == mx.float32 and s.shape == s_ref.shape
    assert_close(y, y_ref, out_key(dtype), f"{case} y")
    assert_close(s, s_ref, "fp32", f"{case} state")


@needs_gpu
def test_kernel_none_state_and_dispatch():
    inputs = make_inputs(1, 4, 2, 2, 128, 128, mx.bfloat16, with_state=False)
    y, s = gated_delta_update(*inputs)
    y_ref, s_ref = gated_delta_ref(*inputs)
    assert_close(y, y_ref, "bfloat16", "y")
    assert_close(s, s_ref, "fp32", "state")


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_kernel_drift_512_steps(dtype, form):
    inputs = make_inputs(1, 512, 2, 4, 128, 128, dtype, seed=7)
    y, s = gated_delta_kernel(*inputs, form=form)
    y_ref, s_ref = gated_delta_ref(*inputs)
    assert_close(y, y_ref, "fp32_drift" if dtype == mx.float32 else out_key(dtype), "y")
    assert_close(s, s_ref, "fp32_drift", "state after 512 steps")


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
def test_kernel_step_states_equal_decode_steps(form):
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(1, 9, 4, 8, 128, 128, mx.bfloat16, seed=3)
    y_all, steps = gated_delta_kernel(q, k, v, a, b, A_log, dt_bias, state, step_states=True, form=form)
    s = state
    for t in range(9):
        y_t, s = gated_delta_kernel(*(x[:, t : t + 1] for x in (q, k, v, a, b)), A_log, dt_bias, s, form=form)
        assert_close(steps[:, t], s, "same", f"state after step {t}")
        assert_close(y_all[:, t], y_t[:, 0], "bfloat16", f"y at step {t}")


@needs_gpu
@pytest.mark.parametrize("form", FORMS)
def test_kernel_split_prefill_equals_one_call(form):
    """A long prompt fed in pieces (state carried between calls) equals one call over the whole prompt."""
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(1, 300, 2, 4, 128, 128, mx.float32, seed=5)
    y_one, s_one = gated_delta_kernel(q, k, v, a, b, A_log, dt_bias, state, form=form)
    ys, s = [], state
    for lo, hi in [(0, 100), (100, 237), (237, 300)]:
        y_p, s = gated_delta_kernel(*(x[:, lo:hi] for x in (q, k, v, a, b)), A_log, dt_bias, s, form=form)
        ys.append(y_p)
    assert_close(mx.concatenate(ys, axis=1), y_one, "same", "y")
    assert_close(s, s_one, "same", "state")


@needs_gpu
def test_batched_form_equals_serial_form():
    inputs = make_inputs(1, 77, 2, 4, 128, 128, mx.float32, seed=9)
    y_s, s_s = gated_delta_kernel(*inputs, form="serial")
    y_b, s_b = gated_delta_kernel(*inputs, form="batched")
    assert_close(y_b, y_s, "fp32", "y")
    assert_close(s_b, s_s, "fp32", "state")


@pytest.mark.parametrize("T", [1, 31, 64, 65, 200])
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (1, 3)], ids=["Hk=Hv", "Hv=3Hk"])
def test_chunked_ref_equals_sequential_ref(T, Hk, Hv):
    from lattice_mlx.metal.gated_delta import gated_delta_chunked_ref

    inputs = make_inputs(1, T, Hk, Hv, 32, 16, mx.float32, seed=T)
    y_ref, s_ref = gated_delta_ref(*inputs)
    y, s = gated_delta_chunked_ref(*inputs, chunk=32)
    assert mx.allclose(y, y_ref, atol=1e-5).item() and mx.allclose(s, s_ref, atol=1e-5).item()


def test_chunked_ref_survives_decay_that_underflows():
    """exp(A_log) ~ 30 drives g below fp32's range; the chunked form works in log space and must stay finite."""
    from lattice_mlx.metal.gated_delta import gated_delta_chunked_ref

    q, k, v, a, b, A_log, dt_bias, state = make_inputs(1, 96, 2, 2, 32, 16, mx.float32, seed=1)
    A_log = mx.array([3.4, -1.5], dtype=mx.float32)
    dt_bias = mx.array([2.0, 1.0], dtype=mx.float32)
    y_ref, s_ref = gated_delta_ref(q, k, v, a, b, A_log, dt_bias, state)
    y, s = gated_delta_chunked_ref(q, k, v, a, b, A_log, dt_bias, state)
    assert mx.isfinite(y).all().item()
    assert mx.allclose(y, y_ref, atol=1e-5).item() and mx.allclose(s, s_ref, atol=1e-5).item()


# --- the fused conv form (decode / verify): conv + SiLU + recurrence in one kernel ---


def make_conv_inputs(B, T, Hk, Hv, Dk, Dv, dtype, *, seed=0, KC=4):
    rng = np.random.default_rng(seed)
    C = 2 * Hk * Dk + Hv * Dv

    def arr(*shape, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)

    _, _, _, a, b, A_log, dt_bias, state = make_inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=seed)
    return arr(B, T, C), arr(B, KC - 1, C), arr(C, KC, scale=0.5), a, b, A_log, dt_bias, state


def test_conv_ref_equals_conv_then_recurrence():
    """The fused form's reference is conv1d + SiLU + split + the plain recurrence, written out here by hand."""
    Hk, Hv, Dk, Dv = 1, 2, 32, 16
    qkv, cs, cw, a, b, A_log, dt_bias, state = make_conv_inputs(2, 5, Hk, Hv, Dk, Dv, mx.float32)
    y, s, conv_in = gated_delta_conv_ref(qkv, cs, cw, a, b, A_log, dt_bias, state, heads=(Hk, Dk, Hv, Dv))
    x = np.concatenate([np.array(cs), np.array(qkv)], axis=1)
    assert np.array_equal(np.array(conv_in), x)
    w = np.array(cw)
    conv = np.stack([(x[:, t:t + 4] * w.T[None]).sum(1) for t in range(5)], axis=1)
    conv = conv / (1 + np.exp(-conv))
    q, k, v = (mx.array(c) for c in np.split(conv, [Hk * Dk, 2 * Hk * Dk], axis=-1))
    y_ref, s_ref = gated_delta_ref(q.reshape(2, 5, Hk, Dk), k.reshape(2, 5, Hk, Dk), v.reshape(2, 5, Hv, Dv), a, b,
                                   A_log, dt_bias, state)
    np.testing.assert_allclose(np.array(y), np.array(y_ref), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(s), np.array(s_ref), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_conv_silu_ref_equals_mx_conv1d(dtype):
    """The shifted multiply-add conv (no cuDNN plan per shape on CUDA) equals MLX's depthwise conv1d at a prompt
    length, up to the rounding of the conv1d's own dtype."""
    C, KC, T = 96, 4, 300
    conv_in = mx.random.normal((2, KC - 1 + T, C), key=mx.random.key(3)).astype(dtype)
    w = (0.5 * mx.random.normal((C, KC), key=mx.random.key(4))).astype(dtype)
    got = conv_silu_ref(conv_in, w)
    want = nn.silu(mx.conv1d(conv_in.astype(mx.float32), w[:, :, None].astype(mx.float32), groups=C))
    assert got.dtype == dtype and got.shape == (2, T, C)
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), rtol=tol, atol=tol)


# (B, T, Hk, Hv, Dk, Dv, dtype, step_states)
CONV_CASES = {
    "decode-0.8b-bf16": (1, 1, 16, 16, 128, 128, mx.bfloat16, False),
    "verify-T5-step-bf16": (1, 5, 16, 16, 128, 128, mx.bfloat16, True),
    "verify-T9-Hv2Hk-fp32": (2, 9, 2, 4, 128, 128, mx.float32, True),
    "T15-Dk64-fp16": (1, 15, 2, 2, 64, 64, mx.float16, False),
    "T3-Dv64-Hv4Hk-bf16": (2, 3, 1, 4, 128, 64, mx.bfloat16, True),
}


@needs_gpu
@pytest.mark.parametrize("case", list(CONV_CASES), ids=list(CONV_CASES))
def test_conv_kernel_matches_ref(case):
    B, T, Hk, Hv, Dk, Dv, dtype, step = CONV_CASES[case]
    inputs = make_conv_inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=len(case))
    heads = (Hk, Dk, Hv, Dv)
    # The reference spelled out with the plain-ops recurrence (gated_delta_conv_ref would dispatch the GDN kernel).
    qkv, cs, cw, a, b, A_log, dt_bias, state = inputs
    c_ref = mx.concatenate([cs, qkv], axis=1)
    q, k, v = mx.split(conv_silu_ref(c_ref, cw), [Hk * Dk, 2 * Hk * Dk], axis=-1)
    y_ref, s_ref = gated_delta_ref(q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk), v.reshape(B, T, Hv, Dv), a, b,
                                   A_log, dt_bias, state, step_states=step)
    y, s, c = gated_delta_conv_kernel(*inputs, heads=heads, step_states=step, init_value=float("nan"))
    assert mx.array_equal(c, c_ref), "conv_in must be the exact concatenation"
    assert_close(y, y_ref, out_key(dtype), "y")
    assert_close(s, s_ref, "fp32" if dtype == mx.float32 else out_key(dtype), "state")


@needs_gpu
@pytest.mark.parametrize("T,step", [(1, False), (2, True)], ids=["decode", "verify"])
def test_conv_kernel_rows_per_warp_change_no_result(T, step):
    """A warp taking 1, 2 or 4 value rows (a batch's calls take 4: the q/k conv and gates computed once for them)
    gives bitwise the same outputs, and each sequence of a batch is bitwise its own one-sequence call (1 row per
    warp): a sequence's tokens do not depend on its batch-mates through this kernel."""
    from lattice_mlx.metal.gated_delta import conv_rows_per_warp

    B, Hk, Hv, Dk, Dv = 3, 2, 4, 64, 64
    inputs = make_conv_inputs(B, T, Hk, Hv, Dk, Dv, mx.bfloat16, seed=23)
    heads = (Hk, Dk, Hv, Dv)
    assert conv_rows_per_warp(B, Dv, Dk) == 4 and conv_rows_per_warp(1, Dv, Dk) == 1
    assert conv_rows_per_warp(B, Dv, 256) == 1  # (not measured there)
    got = {r: gated_delta_conv_kernel(*inputs, heads=heads, step_states=step, rows=r, init_value=float("nan"))
           for r in (1, 2, 4)}
    for r in (2, 4):
        for name, one, other in zip(("y", "state", "conv_in"), got[1], got[r]):
            assert mx.array_equal(one, other), (r, name)
    for i in range(B):
        per_sequence = (0, 1, 3, 4, 7)  # qkv, the conv state, a, b, the state (not the weights)
        alone = gated_delta_conv_kernel(*(x[i : i + 1] if n in per_sequence else x for n, x in enumerate(inputs)),
                                        heads=heads, step_states=step)
        for name, one, batch in zip(("y", "state", "conv_in"), alone, got[4]):
            assert mx.array_equal(one, batch[i : i + 1]), (i, name)


@needs_gpu
def test_conv_kernel_decode_chain_equals_one_verify_call():
    """Nine decode steps (conv window carried through conv_in) equal one T=9 call with per-step states."""
    Hk, Hv, Dk, Dv = 2, 4, 128, 128
    qkv, cs, cw, a, b, A_log, dt_bias, state = make_conv_inputs(1, 9, Hk, Hv, Dk, Dv, mx.float32, seed=11)
    heads = (Hk, Dk, Hv, Dv)
    y_all, steps, conv_all = gated_delta_conv_kernel(qkv, cs, cw, a, b, A_log, dt_bias, state, heads=heads,
                                                     step_states=True)
    s, window = state, cs
    for t in range(9):
        y_t, s, conv_in = gated_delta_conv_kernel(qkv[:, t:t + 1], window, cw, a[:, t:t + 1], b[:, t:t + 1], A_log,
                                                  dt_bias, s, heads=heads)
        window = conv_in[:, 1:]
        assert_close(steps[:, t], s, "same", f"state after step {t}")
        assert_close(y_all[:, t], y_t[:, 0], "same", f"y at step {t}")
    assert mx.array_equal(window, conv_all[:, -3:])


def test_conv_dispatch_uses_reference_when_forced(monkeypatch):
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    inputs = make_conv_inputs(1, 2, 2, 2, 32, 8, mx.bfloat16)
    got = gated_delta_conv_update(*inputs, heads=(2, 32, 2, 8), step_states=True)
    ref = gated_delta_conv_ref(*inputs, heads=(2, 32, 2, 8), step_states=True)
    assert all(mx.array_equal(g, r) for g, r in zip(got, ref))
    y, s, c = got
    assert y.shape == (1, 2, 2, 8) and y.dtype == mx.bfloat16 and s.shape == (1, 2, 2, 8, 32)
    assert s.dtype == mx.float32 and c.shape == (1, 5, 2 * 2 * 32 + 2 * 8)


def packed_projection(qkv: mx.array, a: mx.array, b: mx.array, *, z: int = 24) -> tuple[mx.array, int, int]:
    """The fused in_proj's output layout [qkv | z | b | a] holding the given qkv, b and a (z filled with noise)."""
    B, T, _ = qkv.shape
    noise = mx.random.normal((B, T, z), key=mx.random.key(5)).astype(qkv.dtype)
    src = mx.concatenate([qkv, noise, b, a], axis=-1)
    C, Hv = qkv.shape[-1], a.shape[-1]
    return src, C + z, C + z + Hv


@pytest.mark.parametrize("T", [1, 4])
def test_conv_dispatch_packed_equals_separate_arrays(T, monkeypatch):
    """qkv, b and a passed as column ranges of one projection output give the separate arrays' result (the reference
    path here: it slices them out)."""
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    qkv, cs, cw, a, b, A_log, dt_bias, state = make_conv_inputs(1, T, 2, 4, 32, 8, mx.float32, seed=T)
    packed = packed_projection(qkv, a, b)
    got = gated_delta_conv_update(None, cs, cw, None, None, A_log, dt_bias, state, heads=(2, 32, 4, 8),
                                  step_states=True, packed=packed)
    ref = gated_delta_conv_update(qkv, cs, cw, a, b, A_log, dt_bias, state, heads=(2, 32, 4, 8), step_states=True)
    assert all(mx.array_equal(g, r) for g, r in zip(got, ref))


@needs_gpu
@pytest.mark.parametrize("step", [False, True], ids=["decode", "record"])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "fp32"])
def test_conv_kernel_reads_packed_projection_in_place(dtype, T, step):
    """The kernel reading qkv, b and a in place from the fused projection output is bitwise the kernel on separate
    contiguous arrays (the model's path since the slices stopped being copied)."""
    Hk, Hv, Dk, Dv = 16, 16, 128, 128
    qkv, cs, cw, a, b, A_log, dt_bias, state = make_conv_inputs(1, T, Hk, Hv, Dk, Dv, dtype, seed=7 + T)
    heads = (Hk, Dk, Hv, Dv)
    got = gated_delta_conv_kernel(None, cs, cw, None, None, A_log, dt_bias, state, heads=heads, step_states=step,
                                  packed=packed_projection(qkv, a, b), init_value=float("nan"))
    ref = gated_delta_conv_kernel(qkv, cs, cw, a, b, A_log, dt_bias, state, heads=heads, step_states=step)
    for name, g, r in zip(("y", "state", "conv_in"), got, ref):
        assert mx.array_equal(g, r), name


def _picked_inputs(dtype, step):
    """A previous verify's whole conv input [B, 3 + 5, C] and per-step states [B, 5, Hv, Dv, Dk], and a pick."""
    B, T, Hk, Hv, Dk, Dv = 2, 4, 2, 4, 64, 32
    qkv, _, cw, a, b, A_log, dt_bias, _ = make_conv_inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=11)
    rng = np.random.default_rng(12)
    prev = mx.array(rng.standard_normal((B, 3 + 5, qkv.shape[-1])).astype(np.float32)).astype(dtype)
    states = mx.array(rng.standard_normal((B, 5, Hv, Dv, Dk)).astype(np.float32) * 0.1)
    return (qkv, prev, cw, a, b, A_log, dt_bias, states), mx.array([step + 1, step], dtype=mx.int32), (Hk, Dk, Hv, Dv)


@pytest.mark.parametrize("step", [0, 2, 4])
def test_conv_ref_reads_a_picked_window_and_state(step):
    """`pick` = [n + 1, n]: the window is rows n + 1 .. n + 3 of the previous conv input, the state its step n."""
    inputs, pick, heads = _picked_inputs(mx.float32, step)
    qkv, prev, cw, a, b, A_log, dt_bias, states = inputs
    got = gated_delta_conv_ref(*inputs, heads=heads, step_states=True, pick=pick)
    want = gated_delta_conv_ref(qkv, prev[:, step + 1 : step + 4], cw, a, b, A_log, dt_bias, states[:, step],
                                heads=heads, step_states=True)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


def _rows_picked(inputs, steps):
    """Each sequence b's window rows steps[b] + 1 .. + 3 and state at step steps[b], as separate arrays."""
    qkv, prev, cw, a, b, A_log, dt_bias, states = inputs
    window = mx.stack([prev[i, s + 1 : s + 4] for i, s in enumerate(steps)])
    state = mx.stack([states[i, s] for i, s in enumerate(steps)])
    return qkv, window, cw, a, b, A_log, dt_bias, state


@pytest.mark.parametrize("steps", [(0, 4), (3, 1)])
def test_conv_ref_reads_each_sequences_own_pick(steps):
    """A batch's rounds: `pick` [B, 2] holds each sequence's [n_b + 1, n_b]."""
    inputs, _, heads = _picked_inputs(mx.float32, 0)
    pick = mx.array([[s + 1, s] for s in steps], dtype=mx.int32)
    got = gated_delta_conv_ref(*inputs, heads=heads, step_states=True, pick=pick)
    want = gated_delta_conv_ref(*_rows_picked(inputs, steps), heads=heads, step_states=True)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("steps", [(0, 4), (3, 1)])
def test_conv_kernel_reads_each_sequences_pick_in_place(steps, dtype):
    """A batch's rounds: the kernel reading each sequence's window and state at its own device index ([B, 2]) is
    bitwise the kernel given those rows as separate arrays (no gathers)."""
    inputs, _, heads = _picked_inputs(dtype, 0)
    pick = mx.array([[s + 1, s] for s in steps], dtype=mx.int32)
    got = gated_delta_conv_kernel(*inputs, heads=heads, step_states=True, pick=pick, init_value=float("nan"))
    want = gated_delta_conv_kernel(*_rows_picked(inputs, steps), heads=heads, step_states=True,
                                   init_value=float("nan"))
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("step", [0, 2, 4])
def test_conv_kernel_reads_the_picked_window_and_state_in_place(step, dtype):
    """Pipelined rounds: the kernel reading the window and state at a device index from the previous verify's
    arrays is bitwise the kernel given those rows as separate arrays (no gathers)."""
    inputs, pick, heads = _picked_inputs(dtype, step)
    qkv, prev, cw, a, b, A_log, dt_bias, states = inputs
    got = gated_delta_conv_kernel(*inputs, heads=heads, step_states=True, pick=pick, init_value=float("nan"))
    want = gated_delta_conv_kernel(qkv, prev[:, step + 1 : step + 4], cw, a, b, A_log, dt_bias, states[:, step],
                                   heads=heads, step_states=True, init_value=float("nan"))
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()
