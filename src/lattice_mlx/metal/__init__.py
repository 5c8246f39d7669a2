"""GPU kernels (Metal primary, CUDA twin from the same body) and their plain-ops references.

`LATTICE_KERNELS=ref` forces the references everywhere; on the CPU backend the references always run.
"""

import os

import mlx.core as mx


def use_kernels() -> bool:
    """True when the custom kernels should run: a GPU backend and no `LATTICE_KERNELS=ref` override."""
    value = os.environ.get("LATTICE_KERNELS", "").lower()
    if value not in ("", "ref"):
        raise ValueError(f"LATTICE_KERNELS={value!r}: use ref (plain-ops references) or leave it unset")
    if value == "ref":
        return False
    return mx.default_device() == mx.gpu and (mx.metal.is_available() or mx.cuda.is_available())
