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
