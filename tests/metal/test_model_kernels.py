"""The whole model with the GPU kernels on equals the reference path (runs where kernels run; skipped on the CPU)."""

import mlx.core as mx
import pytest

from lattice_mlx import SpecOptions, generate, load
from lattice_mlx.metal import use_kernels

pytestmark = pytest.mark.skipif(not use_kernels(), reason="no GPU kernels on this backend (CPU runs the references)")


def test_demo_logits_with_kernels_equal_the_reference(monkeypatch):
    model, _ = load()
    ids = mx.array([[(i * 7919) % 8000 for i in range(37)]])
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    # The reference on the CPU stream: on CUDA, MLX's fp32 matmuls run in TF32, which the chunked GDN reference
    # (37 tokens >= CHUNKED_FROM_T) would turn into ~1e-3 logit errors of its own.
    with mx.stream(mx.cpu):
        ref = model(ids)
        mx.eval(ref)
    monkeypatch.delenv("LATTICE_KERNELS")
    # fp32 activations; the kernels reorder sums: measured 2.8e-5 on the H200 with logits up to 25.
    assert mx.abs(model(ids) - ref).max().item() < 1e-3


@pytest.mark.parametrize("k", [1, 2, 4])
def test_demo_greedy_mtp_with_kernels_equals_plain(k):
    model, tok = load()
    prompt = "class Queue:\n    def __init__(self):\n"
    spec = SpecOptions(draft_tokens=k, adaptive=False)
    assert generate(model, tok, prompt, max_tokens=120, speculation=spec).tokens == \
        generate(model, tok, prompt, max_tokens=120).tokens
