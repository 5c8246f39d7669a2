"""First vs repeated prefill at new prompt lengths: the one-off cost a new shape pays, split by op.

H200 run 3 (docs/bench/h200/run3/first_call.json): on CUDA every new prompt length cost ~190 ms once (then 3-5 ms).
Suspects: cuDNN plans built per shape (MLX's CUDA conv and its prefill attention go through cuDNN), or JIT work.
Per-shape caches live in the process, so each measurement below uses lengths no earlier one used.

1. Ops alone, each at fresh lengths (first / second call): depthwise `mx.conv1d`, the shifted multiply-add conv the
   model now uses, `mx.fast.scaled_dot_product_attention` (causal, T = L), attention from plain ops, and
   `mx.quantized_matmul` with M = T rows.
2. The whole model at fresh lengths in three variants: as in run 3 (conv1d conv), the current code, and the current
   code with prefill attention from plain ops (patched in here only, to decide whether it should ship).

Usage: python scripts/first_call.py [--model demo] [--out FILE]
"""

import argparse
import json
import time
from contextlib import ExitStack
from unittest.mock import patch

import mlx.core as mx
import mlx.nn as nn

from lattice_mlx.bench import load_target
from lattice_mlx.metal import attention, gated_delta

_fresh = iter(range(37, 100000, 2))  # odd lengths, each used once


def fresh() -> int:
    return next(_fresh)


def times(fn, reps: int = 3) -> list[float]:
    out = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - tic) * 1e3)
    return out


def conv1d_silu(conv_in: mx.array, conv_w: mx.array) -> mx.array:
    """The conv as run 3 ran it (cuDNN on CUDA)."""
    return nn.silu(mx.conv1d(conv_in, conv_w[:, :, None].astype(conv_in.dtype), groups=conv_in.shape[-1]))


def sdpa_ops(q, k, v, *, scale, mask=None):
    """Causal (or unmasked) attention from matmuls and a softmax; GQA by grouping query heads per kv head."""
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    qg = (q * scale).reshape(B, Hkv, Hq // Hkv * T, D)
    s = (qg @ k.swapaxes(-1, -2)).astype(mx.float32).reshape(B, Hkv, Hq // Hkv, T, L)
    if isinstance(mask, str):
        keep = mx.arange(L)[None] <= (L - T + mx.arange(T))[:, None]
        s = mx.where(keep, s, -mx.inf)
    elif mask is not None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    p = mx.softmax(s, axis=-1).astype(v.dtype).reshape(B, Hkv, Hq // Hkv * T, L)
    return (p @ v).reshape(B, Hq, T, D)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo")
    p.add_argument("--out")
    args = p.parse_args()
    target = load_target(args.model, bits=4, group_size=64, dtype=None, seed=0, stock=False)
    model, margs = target.model, target.model.args
    dtype = model.model.norm.weight.dtype
    result = {"device": str(mx.default_device()), "model": target.label, "ops": [], "model_variants": []}
    # process-wide first-use costs out of the way: a decode-sized call (compiled path) and a prefill-sized one (T > 16)
    mx.eval(model(mx.array([[1, 2, 3]]), model.make_cache()))
    mx.eval(model(mx.array([list(range(1, 34))]), model.make_cache()))

    C = 2 * margs.linear_num_key_heads * margs.linear_key_head_dim + \
        margs.linear_num_value_heads * margs.linear_value_head_dim
    KC, Hq, Hkv, D = margs.linear_conv_kernel_dim, margs.num_attention_heads, margs.num_key_value_heads, margs.head_dim
    w = mx.random.normal((C, KC)).astype(dtype)
    wq, sq, bq = mx.quantize(mx.random.normal((margs.intermediate_size, margs.hidden_size)), 64, 4)
    mx.eval(w, wq, sq, bq)

    def ready(*arrays):  # inputs evaluated before the timed call, so it times the op alone
        mx.eval(*arrays)
        return arrays if len(arrays) > 1 else arrays[0]

    def op_conv1d(T):
        x = ready(mx.random.normal((1, T + KC - 1, C)).astype(dtype))
        return lambda: conv1d_silu(x, w)

    def op_conv_shifted(T):
        x = ready(mx.random.normal((1, T + KC - 1, C)).astype(dtype))
        return lambda: gated_delta.conv_silu_ref(x, w)

    def qkv(T):
        return ready(*[mx.random.normal(s).astype(dtype) for s in ((1, Hq, T, D), (1, Hkv, T, D), (1, Hkv, T, D))])

    def op_sdpa_fast(T):
        q, k, v = qkv(T)
        return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal")

    def op_sdpa_ops(T):
        q, k, v = qkv(T)
        return lambda: sdpa_ops(q, k, v, scale=D**-0.5, mask="causal")

    def op_qmm(T):
        x = ready(mx.random.normal((1, T, margs.hidden_size)).astype(dtype))
        return lambda: mx.quantized_matmul(x, wq, sq, bq, transpose=True, group_size=64, bits=4)

    for name, make in [("conv1d", op_conv1d), ("conv_shifted", op_conv_shifted), ("sdpa_fast", op_sdpa_fast),
                       ("sdpa_ops", op_sdpa_ops), ("quantized_matmul", op_qmm)]:
        for T in (fresh(), fresh(), 1000 + fresh()):
            fn = make(T)
            t = times(fn)
            result["ops"].append({"op": name, "T": T, "first_ms": t[0], "then_ms": t[1:]})
            print(f"op {name:17s} T={T:5d} first {t[0]:8.2f} ms  then {t[1]:7.2f} / {t[2]:7.2f} ms", flush=True)

    variants = [("run3: conv1d", [(gated_delta, "conv_silu_ref", conv1d_silu)]),
                ("current", []),
                ("current + ops attention", [(attention, "sdpa_ref", sdpa_ops)])]
    for label, patches in variants:
        for T in (fresh(), fresh(), fresh(), 1500 + fresh()):
            ids = mx.array([[(i * 7919) % 1000 + 1 for i in range(T)]])
            with ExitStack() as stack:
                for module, name, value in patches:
                    stack.enter_context(patch.object(module, name, value))
                t = times(lambda: model(ids, model.make_cache()))
            result["model_variants"].append({"variant": label, "T": T, "first_ms": t[0], "then_ms": t[1:]})
            print(f"model {label:24s} T={T:5d} first {t[0]:8.1f} ms  then {t[1]:7.1f} / {t[2]:7.1f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
