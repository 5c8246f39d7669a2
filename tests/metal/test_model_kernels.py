"""The whole model with the GPU kernels on equals the reference path (runs where kernels run; skipped on the CPU)."""

import mlx.core as mx
import pytest

from lattice_mlx import SpecOptions, generate, load

pytestmark = pytest.mark.kernels  # a GPU backend, or LATTICE_KERNELS=cpu (tests/conftest.py)


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


@pytest.mark.parametrize("k", [2, 3])
def test_bf16_greedy_mtp_equals_plain_bitwise_verify(k):
    """bf16 activations, 0.8B layer shapes (4 layers, Q4): a verify row is bitwise the decode step at its position,
    so oracle drafts equal to plain's tokens are all accepted and MTP's tokens are plain's, past the attention
    kernel's first key-split boundary (SPLIT_KEYS) too. Random weights make near-ties common: a single differing
    bit anywhere in a verify row shows up here as a rejected correct draft or a changed token."""
    import numpy as np

    from lattice_mlx.bench.oracles import OracleDrafter
    from lattice_mlx.bench.synthetic import QWEN3_5_0_8B, random_model
    from lattice_mlx.decode import generate_step
    from lattice_mlx.metal.attention import SPLIT_KEYS
    from lattice_mlx.sample import Sampler
    from lattice_mlx.speculative import SpecStats, speculate

    model = random_model(**{**QWEN3_5_0_8B, "num_hidden_layers": 4}, bits=4, dtype=mx.bfloat16)
    ids = mx.array(np.random.default_rng(k).integers(1, 248320, SPLIT_KEYS - 20).tolist())
    n = 60
    plain = [t for t, _ in zip(generate_step(model, ids, sampler=Sampler()), range(n + 8))]
    for p in (1.0, 0.7):
        opts = SpecOptions(draft_tokens=k, adaptive=False)
        stats = SpecStats.of(opts)
        drafter = OracleDrafter(model, Sampler(), plain, p, seed=1)
        got = [t for t, _ in zip(speculate(model, ids, sampler=Sampler(), options=opts, stats=stats,
                                                  drafter=drafter), range(n))]
        assert got == plain[:n], f"p={p}: MTP left plain decoding"
        if p == 1.0:
            assert stats.to_dict()["acceptance_rate"] == 1.0, "a correct draft was rejected: verify row != step"


def test_demo_bf16_greedy_mtp_equals_plain():
    model, tok = load()
    model.set_dtype(mx.bfloat16)
    prompt = "def fib(n):\n"
    spec = SpecOptions(draft_tokens=3, adaptive=False)
    assert generate(model, tok, prompt, max_tokens=100, speculation=spec).tokens == \
        generate(model, tok, prompt, max_tokens=100).tokens
