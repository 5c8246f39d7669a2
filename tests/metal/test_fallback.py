"""A kernel that fails to build falls back to its reference, alone, with one line on stderr, and the generation is
the all-reference one; and the CPU render catches an off-by-one planted in a kernel body. Runs on a GPU backend, or
through the CPU render (tests/conftest.py)."""

import mlx.core as mx
import numpy as np
import pytest
from _tol import assert_close
from test_gated_delta import make_inputs

from lattice_mlx.bench.synthetic import random_model
from lattice_mlx.decode import generate_step
from lattice_mlx.metal import _dialect, argmax, cpu_render, gated_delta, use_kernels
from lattice_mlx.sample import Sampler

pytestmark = pytest.mark.kernels

# every kernel applies at these shapes: K % 32, Dk = 32, head_dim 64, 4-bit in groups of 32
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
             head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
             linear_value_head_dim=32, vocab_size=512)


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(model, mx.array(prompt), sampler=Sampler())
    return [next(steps) for _ in range(n)]


@pytest.fixture
def fresh_failures(monkeypatch):
    monkeypatch.setattr(_dialect, "_FAILED", {})


@pytest.fixture
def eager(monkeypatch):
    """The layer path, untraced: the CPU render runs only outside mx.compile traces."""
    monkeypatch.setenv("LATTICE_COMPILE", "0")
    monkeypatch.setenv("LATTICE_TRACE_STEPS", "0")


def test_a_kernel_that_fails_to_build_falls_back_alone(monkeypatch, capfd, fresh_failures, eager):
    mx.random.seed(3)
    model = random_model(**SMALL, mtp=False, bits=4, group_size=32, dtype=mx.float32)
    prompt = [5, 17, 99, 3, 250, 41]
    kernels = _dialect.mode()
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    expected = _greedy(model, prompt, 6)
    monkeypatch.setenv("LATTICE_KERNELS", kernels)
    assert use_kernels()
    # a body no compiler takes: a new source, so a new build (the name carries the source's hash)
    monkeypatch.setattr(argmax, "_BODY", argmax._BODY + "\n  this is not a statement;\n")
    capfd.readouterr()
    assert _greedy(model, prompt, 6) == expected
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "lattice_argmax" in err[0] and "lattice_mlx.doctor" in err[0], err
    assert list(_dialect.failed()) == ["lattice_argmax"]
    ran = {k.name for k in _dialect.kernels() if k.launched}
    assert {"lattice_gated_delta_conv", "lattice_sdpa", "lattice_q4_rms"} <= ran, ran


def test_ref_mode_still_forces_the_reference_everywhere(monkeypatch):
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    assert not use_kernels()
    x = mx.array(np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32))
    with _dialect.recording(spy=True) as calls:
        argmax.argmax(x)
    assert calls == []  # no kernel was even asked for


# An off-by-one in the per-step state index of the GDN body (the state after step t written at step t + 1's row):
# the step-states comparison must catch it, on the CPU render too.
PLANT = ("const int so = (hvt * Dv + dv) * Dk + lane;", "const int so = ((hvt + Hv) * Dv + dv) * Dk + lane;")


@pytest.mark.skipif(not cpu_render.available(), reason="the CPU render needs a C++ compiler")
def test_a_planted_state_index_off_by_one_fails_the_kernel_test(monkeypatch, fresh_failures):
    monkeypatch.setenv("LATTICE_KERNELS", "cpu")  # the CPU render, wherever the suite runs
    inputs = make_inputs(1, 3, 2, 4, 32, 8, mx.float32, seed=1)
    y_ref, s_ref = gated_delta.gated_delta_ref(*inputs, step_states=True)
    y, s = gated_delta.gated_delta_kernel(*inputs, step_states=True, form="serial", init_value=float("nan"))
    assert_close(s, s_ref, "fp32", "unplanted")  # the check passes the shipped body
    assert PLANT[0] in gated_delta._BODY
    monkeypatch.setitem(gated_delta._BODIES, "serial", gated_delta._BODY.replace(*PLANT))
    with pytest.raises((AssertionError, cpu_render.RenderError, _dialect.KernelFailed)):
        y, s = gated_delta.gated_delta_kernel(*inputs, step_states=True, form="serial", init_value=float("nan"))
        assert_close(s, s_ref, "fp32", "planted")


def test_a_batch_of_up_to_16_in_the_fused_kernel_keeps_every_sequence_exact(monkeypatch, eager):
    """LATTICE_FUSED_ROWS=16: a batch's steps of 9 rows take the fused 4-bit kernels (their variant of 16 rows) and
    each sequence keeps its single generation's greedy tokens (the plain-ops reference's here: the render is slow;
    that each of the kernel's rows is its one-row call is tests/metal/test_q4_matmul.py's)."""
    from lattice_mlx import settings
    from lattice_mlx.batch import BatchDecoder
    from lattice_mlx.metal import q4_matmul

    mx.random.seed(4)
    model = random_model(**SMALL, mtp=False, bits=4, group_size=32, dtype=mx.float32)
    prompts = [[(11 * i + 3 * j) % 500 + 1 for j in range(2 + i % 3)] for i in range(9)]
    kernels = _dialect.mode()
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    solo = [_greedy(model, p, 3) for p in prompts]
    monkeypatch.setenv("LATTICE_KERNELS", kernels)
    seen = []
    real = q4_matmul.capacity
    monkeypatch.setattr(q4_matmul, "capacity", lambda M: seen.append(M) or real(M))
    with settings.override(fused_rows="16"):
        engine = BatchDecoder(model, max_batch=9)
        seqs = [engine.add(p, max_tokens=3) for p in prompts]
        while engine.busy:
            engine.step()
    assert [s.tokens for s in seqs] == solo
    assert 9 in seen, sorted(set(seen))  # (the steps of all nine rows, in the fused kernel)
