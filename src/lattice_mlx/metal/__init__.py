"""GPU kernels (Metal primary, CUDA twin from the same body) and their plain-ops references.

`LATTICE_KERNELS=ref` forces the references everywhere; on the CPU backend the references run unless
`LATTICE_KERNELS=cpu` runs the kernel bodies through the CPU render (tests, `python -m lattice_mlx.doctor`).
"""

import functools

import mlx.core as mx
import numpy as np

from lattice_mlx import settings
from lattice_mlx.metal import _dialect


@functools.lru_cache(maxsize=256)
def iota(n: int) -> mx.array:
    """[0, 1, .., n - 1] int32 from host data: inside a traced step or round a constant of the trace, where
    mx.arange is an op its every replay launches (a kernel on a GPU, a node for the host to dispatch). Shared: never
    written to (docs/results/code_measurements.md, 'Index arrays in traced rounds')."""
    return mx.array(np.arange(n, dtype=np.int32))


@functools.lru_cache(maxsize=256)
def _held(n: int) -> mx.array:
    return mx.array(np.array([n], dtype=np.int32))


def number(n: int) -> mx.array:
    """n as an int32 scalar array for index arithmetic in traced steps and rounds: a view of host data, so an input
    of the fused kernel it joins, where a Python int is a scalar constant, and MLX names a fused kernel by its scalar
    constants' values: one kernel per depth or capacity (docs/results/code_measurements.md, 'First use of a depth')."""
    return _held(n)[0]


def use_kernels() -> bool:
    """True when the custom kernels should run: a GPU backend, or the CPU render, and no `LATTICE_KERNELS=ref`."""
    mode = _dialect.mode()
    if mode == "ref":
        return False
    if mode == "cpu" or _dialect.collecting():
        return True
    return mx.default_device() == mx.gpu and (mx.metal.is_available() or mx.cuda.is_available())


@functools.cache
def _cuda() -> bool:
    return mx.cuda.is_available()


def cuda_gpu() -> bool:
    """Whether ops run on MLX's CUDA backend (a CUDA device, the GPU the default device)."""
    return _cuda() and mx.default_device() == mx.gpu


def dequant_rows() -> int:
    """LATTICE_DEQUANT_ROWS: from how many rows a 4-bit matmul on a CUDA device dequantizes its weight and runs
    cuBLAS instead of MLX's quantized matmul (0: never; q4_matmul.quantized_matmul). Rows up to the fused kernel's
    max_rows() take that kernel where it applies, so it matters for a batch's steps and verifies."""
    value = settings.raw("dequant_rows") or "0"
    if not value.isdigit():
        raise ValueError(f"LATTICE_DEQUANT_ROWS={value!r}: {settings.SETTINGS['dequant_rows'].hint}")
    return int(value)


def kernel_policy() -> tuple[bool, int, bool, str]:
    """What decides the ops a forward is built from, besides shapes: use_kernels(), dequant_rows(), whether split-K
    may apply (LATTICE_SPLIT_K) and the fused kernel's rows (LATTICE_FUSED_ROWS). Traces are keyed on it, so a changed
    setting picks (or makes) the matching trace instead of replaying another."""
    return use_kernels(), dequant_rows(), settings.on("split_k"), settings.raw("fused_rows")
