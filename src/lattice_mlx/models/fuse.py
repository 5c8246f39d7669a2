"""Projection fusion: linears that read the same input become one matmul (exact; a load-time transform).

On MLX's CUDA backend every op costs host dispatch whatever its size, so a decode step is bound by its op count:
the GDN mixer's four input projections, the attention's q/k/v and the MLP's gate/up each become one matmul
(docs/results/code_measurements.md, 'Launch costs').
Rows of a weight are independent (affine quantization groups run along the input dimension), so stacking the
quantized rows, scales and biases is the same as quantizing the stacked matrix. Checkpoints keep Hugging Face
names: conversion works on unfused models and `hf_parameters` splits a fused model's tensors back.
"""

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# module attribute holding the fused linear -> the attributes it replaces, in output order
FUSIONS = {
    "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # GatedDeltaNet
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),  # Attention
    "gate_up_proj": ("gate_proj", "up_proj"),  # MLP
}
_TENSORS = ("weight", "scales", "biases")


def _same_kind(parts: list[nn.Module]) -> bool:
    first = parts[0]
    if any(type(p) is not type(first) or "bias" in p for p in parts):
        return False
    if isinstance(first, nn.QuantizedLinear):
        return all((p.bits, p.group_size, p.mode) == (first.bits, first.group_size, first.mode) for p in parts)
    return isinstance(first, nn.Linear)


def _concat(parts: list[nn.Module]) -> nn.Module:
    fused = copy.copy(parts[0])
    for name in _TENSORS:
        if name in parts[0] and parts[0][name] is not None:
            fused[name] = mx.concatenate([p[name] for p in parts], axis=0)
    return fused


def fuse_projections(model: nn.Module, *, evaluate: bool = True) -> nn.Module:
    """Fuse every group in FUSIONS whose members are the same kind of linear (same quantization, no bias).
    The owner records the output sizes of the parts as `<fused name>_sizes` and the offsets to split the fused
    output at as `<fused name>_points` (on the owner, so that re-quantizing the fused linear keeps them; computed
    once here, not per call). `evaluate=False` leaves the fused weights lazy (placeholder models that are never
    computed: lattice_mlx.variants). Returns the model."""
    for _, module in list(model.named_modules()):
        for fused_name, names in FUSIONS.items():
            if not all(n in module for n in names):
                continue
            parts = [module[n] for n in names]
            if not _same_kind(parts):
                continue
            fused = _concat(parts)
            sizes = [int(p["weight"].shape[0]) for p in parts]
            object.__setattr__(module, f"{fused_name}_sizes", tuple(sizes))
            object.__setattr__(module, f"{fused_name}_points", [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)])
            for n in names:
                del module[n]
            module[fused_name] = fused
            # evaluated group by group: the parts (lazy checkpoint tensors, or a tensor-parallel rank's slices of
            # them) are freed as each group is built, so loading peaks near the model's size, not near twice it
            if evaluate:
                mx.eval(fused.parameters())
    if evaluate:
        mx.eval(model.parameters())
    return model


def hf_parameters(model: nn.Module) -> dict[str, mx.array]:
    """The model's parameters under the checkpoint's names, fused projections split back into their parts (MoE
    experts keep the stacked `switch_mlp` names that mlx-lm and this package's conversions use)."""
    fused_paths = {}
    for path, module in model.named_modules():
        for fused_name, names in FUSIONS.items():
            if fused_name in module:
                sizes = getattr(module, f"{fused_name}_sizes")
                fused_paths[f"{path}.{fused_name}" if path else fused_name] = (sizes, names)
    out = {}
    for key, value in tree_flatten(model.parameters()):
        prefix, _, tensor = key.rpartition(".")
        if prefix not in fused_paths:
            out[key] = value
            continue
        rows, names = fused_paths[prefix]
        parent = prefix.rpartition(".")[0]
        start = 0
        for name, n in zip(names, rows):
            out[f"{parent}.{name}.{tensor}" if parent else f"{name}.{tensor}"] = value[start:start + n]
            start += n
    return out
