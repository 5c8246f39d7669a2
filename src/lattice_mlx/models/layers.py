"""The layers the model is built of beside its blocks: 4-bit linears and embeddings whose matmuls (with their
prologue and residual) go through the fused-kernel dispatchers, the projection helpers, the GDN gated norm, RoPE at
per-token positions."""

import mlx.core as mx
import mlx.nn as nn

from ..metal.q4_embedding import q4_embedding
from ..metal.q4_matmul import (
    Pre,
    SplitK,
    dense_matmul,
    prologue_ref,
    q4_matmul,
    quantized_matmul,
    split_k_layout,
    unfused,
)


def rope_at(x: mx.array, positions: mx.array, dims: int, base: float) -> mx.array:
    """Split-half RoPE on the first `dims` of x [B, H, T, D] at per-token positions [T] (tree verify)."""
    inv = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    ang = positions.astype(mx.float32)[:, None] * inv[None, :]  # [T, dims/2]
    cos, sin = mx.cos(ang).astype(x.dtype), mx.sin(ang).astype(x.dtype)
    x1, x2, rest = x[..., : dims // 2], x[..., dims // 2 : dims], x[..., dims:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


class Q4Linear(nn.QuantizedLinear):
    """A 4-bit linear whose matmul, with its prologue and residual, goes through the q4_matmul dispatcher (with its
    weight's split-K layout once `prepare_split_k` made one)."""

    split_k: SplitK | None = None

    def __call__(self, x: mx.array, *, pre: Pre | None = None, residual: mx.array | None = None,
                 glu: bool = False) -> mx.array:
        if self.bits != 4 or self.mode != "affine" or "bias" in self:
            return unfused(self._other, x, pre=pre, residual=residual, glu=glu)
        # (no check of the layout against the weight here: inside a trace the weight is a tracer; Model.update drops
        # the layouts, and the traces built with them, when weights change)
        return q4_matmul(x, self["weight"], self["scales"], self["biases"], group_size=self.group_size, pre=pre,
                         residual=residual, glu=glu, split=self.split_k)

    def _other(self, x: mx.array) -> mx.array:
        """Other widths and modes (8-bit routers), with a bias if any: nn.QuantizedLinear's maths."""
        y = quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                             bits=self.bits, mode=self.mode)
        return y + self["bias"] if "bias" in self else y


class Q4Embedding(nn.QuantizedEmbedding):
    """A 4-bit embedding whose lookup is one kernel on a GPU (metal/q4_embedding.py) and whose tied-lm_head use goes
    through the q4_matmul dispatcher."""

    def __call__(self, ids: mx.array) -> mx.array:
        return q4_embedding(ids, self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                            bits=self.bits, mode=self.mode)

    def as_linear(self, x: mx.array, *, pre: Pre | None = None) -> mx.array:
        if self.bits != 4 or self.mode != "affine":
            return quantized_matmul(prologue_ref(pre, x), self["weight"], self["scales"], self.get("biases"),
                                    group_size=self.group_size, bits=self.bits, mode=self.mode)
        return q4_matmul(x, self["weight"], self["scales"], self["biases"], group_size=self.group_size, pre=pre)


def prepare_split_k(model: nn.Module) -> int:
    """Give every 4-bit linear whose weight gains from it (q4_matmul.split_k_layout) its split-K layout, once (a
    batch engine that runs more rows than the fused kernel takes, on a CUDA device: the layouts are a second copy of
    those weights). Returns how many linears have one."""
    count = 0
    for _, m in model.named_modules():
        if isinstance(m, Q4Linear) and m.bits == 4 and m.mode == "affine" and "bias" not in m:
            if m.split_k is None or m.split_k.source is not m["weight"]:
                m.split_k = split_k_layout(m["weight"], m["scales"], m.get("biases"), group_size=m.group_size,
                                           bits=m.bits)
            count += m.split_k is not None
    return count


def drop_split_k(model: nn.Module) -> bool:
    """Remove every split-K layout (weights about to change, or changed); returns whether there was one."""
    had = False
    for _, m in model.named_modules():
        if isinstance(m, Q4Linear) and m.split_k is not None:
            m.split_k, had = None, True
    return had


def route_quantized(model: nn.Module) -> None:
    """After nn.quantize: send the quantized layers' matmuls through the dispatcher (same parameters, same maths)."""
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            m.__class__ = Q4Linear
        elif type(m) is nn.QuantizedEmbedding:
            m.__class__ = Q4Embedding


def project(linear: nn.Module, x: mx.array, *, pre: Pre | None = None, residual: mx.array | None = None,
            glu: bool = False):
    """residual + linear(P(x)), or with `glu` silu(gate) * up of linear(P(x)) = [gate | up]: one fused kernel for a
    4-bit or an unquantized bias-free linear on a GPU, the same maths in plain ops otherwise."""
    if isinstance(linear, Q4Linear):
        return linear(x, pre=pre, residual=residual, glu=glu)
    if type(linear) is nn.Linear and "bias" not in linear:  # unquantized: the same fused kernel on dense rows
        return dense_matmul(x, linear.weight, pre=pre, residual=residual, glu=glu)
    return unfused(linear, x, pre=pre, residual=residual, glu=glu)


def rms_pre(norm: nn.RMSNorm | None) -> Pre | None:
    return Pre("rms", norm.weight, norm.eps) if norm is not None else None


def project_out(module: nn.Module, linear: nn.Module, x: mx.array, *, pre: Pre | None = None,
                residual: mx.array | None = None) -> mx.array:
    """A block's output projection: residual + linear(P(x)), with the partial sums of every rank added first when
    the block is tensor-parallel (`sharding_group`; the residual then joins after the all_sum, once)."""
    group = module.sharding_group
    if group is None:
        return project(linear, x, pre=pre, residual=residual)
    y = mx.distributed.all_sum(project(linear, x, pre=pre), group=group)
    return y if residual is None else residual + y


class RMSNormGated(nn.Module):
    """rms(y) * w * silu(z), applied as the output projection's prologue; the weight is stored as is (no +1 shift)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps
