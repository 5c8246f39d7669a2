"""GPU kernels (Metal primary, CUDA twin from the same body) and their plain-ops references.

`LATTICE_KERNELS=ref` forces the references everywhere; on the CPU backend the references run unless
`LATTICE_KERNELS=cpu` runs the kernel bodies through the CPU render (tests, `python -m lattice_mlx.doctor`).
"""

import mlx.core as mx

from lattice_mlx.metal import _dialect


def use_kernels() -> bool:
    """True when the custom kernels should run: a GPU backend, or the CPU render, and no `LATTICE_KERNELS=ref`."""
    mode = _dialect.mode()
    if mode == "ref":
        return False
    if mode == "cpu" or _dialect.collecting():
        return True
    return mx.default_device() == mx.gpu and (mx.metal.is_available() or mx.cuda.is_available())


def kernel_policy() -> tuple[bool, int]:
    """What decides the ops a forward is built from, besides shapes: use_kernels() and the rows from which a 4-bit
    matmul dequantizes (q4_matmul.dequant_rows). Traces are keyed on it, so a changed setting picks (or makes) the
    matching trace instead of replaying another."""
    from lattice_mlx.metal import q4_matmul

    return use_kernels(), q4_matmul.dequant_rows()
