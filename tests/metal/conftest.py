"""Where kernel tests run. A test marked `kernels` runs on a GPU backend (Metal or CUDA), or on any machine with
LATTICE_KERNELS=cpu (the CPU render: lattice_mlx/metal/cpu_render.py). Without either, the tests listed in
CPU_RENDER still run, through the CPU render: small shapes of every kernel, each dtype, T = 1 and odd T, more value
heads than key heads, per-step states, picks, trees, splits. The rest skip there."""

import re

import pytest

from lattice_mlx.metal import cpu_render, use_kernels

GPU = use_kernels()  # as the run's environment has it (LATTICE_KERNELS=cpu: every kernel test on the render)
# (file, test id pattern): the kernel tests the CPU render runs where there is no GPU, ~1 s each
CPU_RENDER = [
    ("test_gated_delta.py", "test_kernel_matches_ref[oddT7-B2-Hv2Hk-fp32-*]"),
    ("test_gated_delta.py", "test_kernel_matches_ref[oddT7-B2-Hv2Hk-steps-fp16-serial]"),
    ("test_gated_delta.py", "test_kernel_matches_ref[T3-Hv3Hk-Dk64-Dv128-steps-fp32-serial]"),
    ("test_gated_delta.py", "test_kernel_none_state_and_dispatch"),
    ("test_gated_delta.py", "test_conv_kernel_matches_ref[verify-T9-Hv2Hk-fp32]"),
    ("test_gated_delta.py", "test_conv_kernel_matches_ref[T15-Dk64-fp16]"),
    ("test_gated_delta.py", "test_conv_kernel_reads_the_picked_window_and_state_in_place[2-fp32]"),
    ("test_gated_delta.py", "test_conv_kernel_reads_packed_projection_in_place[bf16-4-record]"),
    ("test_gated_delta_tree.py", "test_kernel_matches_ref[drafter-2-2-1-Hv=2Hk-Dk64-Dv128-bf16]"),
    ("test_gated_delta_tree.py", "test_kernel_matches_ref[random13-Hv=2Hk-Dk64-Dv128-fp32]"),
    ("test_q4_matmul.py", "test_kernel_matches_ref[M2-g32-fp32]"),
    ("test_q4_matmul.py", "test_kernel_matches_ref[M5-g32-bf16]"),
    ("test_q4_matmul.py", "test_kernel_matches_ref[M1-g128-bf16]"),
    ("test_q4_matmul.py", "test_fused_kernel_matches_ref[residual-gated_rms-M8-K1024-fp32]"),
    ("test_q4_matmul.py", "test_fused_kernel_matches_ref[plain-gate-M4-K512-fp16]"),
    ("test_q4_matmul.py", "test_fused_kernel_matches_ref[residual-rms-M1-K1024-bf16]"),
    ("test_q4_matmul.py", "test_fused_kernel_matches_ref[plain-swiglu-M8-K256-fp32]"),
    ("test_q4_matmul.py", "test_glu_kernel_matches_ref[rms-M3-bf16]"),
    ("test_q4_matmul.py", "test_kernel_any_rows_per_block[R=2]"),
    ("test_dense_matmul.py", "test_kernel_matches_spec[M2-fp16]"),
    ("test_dense_matmul.py", "test_fused_kernel_matches_ref[residual-gated_rms-M1-bf16]"),
    ("test_dense_matmul.py", "test_glu_kernel_matches_ref[rms-M4-fp16]"),
    ("test_attention.py", "test_kernel_matches_ref[T1-L7-D64-8q2kv-bf16-full]"),
    ("test_attention.py", "test_kernel_matches_ref[T5-L100-D128-4q4kv-fp16-causal]"),
    ("test_attention.py", "test_kernel_any_split_count[T5-3]"),
    ("test_attention.py", "test_kernel_any_split_count[T5-64]"),
    ("test_attention.py", "test_kernel_is_batch_invariant[short-bf16]"),
    ("test_q4_embedding.py", "test_kernel_is_bitwise_mlx_lookup[shape3-32-*]"),
    ("test_q4_embedding.py", "test_kernel_takes_unsigned_ids"),
    ("test_rms_pair.py", "test_kernel_matches_ref[shape0-*]"),
    ("test_rms_pair.py", "test_pre_kernel_matches_ref[shape1-dtype1]"),
    ("test_qk_norm_rope.py", "test_kernel_matches_ref[D64-r64-T1-fp32]"),
    ("test_qk_norm_rope.py", "test_kernel_matches_ref[D128-r32-T9-bf16]"),
    ("test_qk_norm_rope.py", "test_kernel_matches_ref[D256-r64-T4-fp16]"),
    ("test_qk_norm_rope.py", "test_kernel_array_offset_and_batch_invariance"),
    ("test_argmax.py", "test_kernel_matches_mlx_argmax[True-shape3-*]"),
    ("test_argmax.py", "test_kernel_matches_mlx_argmax[False-shape1-dtype0]"),
    ("test_argmax.py", "test_kernel_rows_of_minus_infinity_and_a_single_maximum_at_the_end"),
    ("test_fallback.py", "*"),
]


def _matches(item, f: str, pattern: str) -> bool:
    """The item is test `pattern` of file `f` (`*` matches anything; brackets are literal)."""
    return item.path.name == f and re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), item.name) is not None


def _selected(item) -> bool:
    return any(_matches(item, f, pattern) for f, pattern in CPU_RENDER)


def pytest_collection_modifyitems(config, items):
    """Marks the CPU_RENDER tests; a pattern of a collected file that matches nothing is an error (a renamed test
    would otherwise drop out of the CPU run unnoticed)."""
    files = {item.path.name for item in items}
    for f, pattern in CPU_RENDER:
        if f in files and not any(_matches(item, f, pattern) for item in items):
            raise pytest.UsageError(f"tests/metal/conftest.py CPU_RENDER: {f}::{pattern} matches no test")
    for item in items:
        if _selected(item):
            item.add_marker("cpu_render")


@pytest.fixture(autouse=True)
def kernel_backend(request, monkeypatch):
    if request.node.get_closest_marker("kernels") is None or GPU:
        return
    if request.node.get_closest_marker("cpu_render") is None:
        pytest.skip("a kernel test: needs an MLX GPU backend, or LATTICE_KERNELS=cpu (the CPU render)")
    if not cpu_render.available():
        pytest.skip("the CPU render needs a C++ compiler")
    monkeypatch.setenv("LATTICE_KERNELS", "cpu")
