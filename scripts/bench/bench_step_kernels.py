"""GPU time per call (CUPTI, through `gpu_kernels.py` of ../shared/device copied into --profiler-dir) of a decode step's
kernels in isolation: the greedy argmax kernel (metal/argmax.py) against MLX's argmax at the 0.8B vocabulary
(248,320, bf16, rows 1 / 4 / 5), the GDN mixer's conv-fused kernel at T = 1 and 4, the attention kernel over 128 keys
at T = 1 and 4, and the rms_pair and qk_norm_rope kernels at the 0.8B shape.

Run 18 found the conv-fused kernel's fixed cost: 23.7 us per launch at T = 1 as shipped then, with two small input
arrays made on the host (`cols`, strides and first columns; `pick`), against 7.1 us with their values as literals.
The kernels now take such parameters as literals (`_dialect.constants`). The GDN `pick` variants here tell whether
an input made on the host is what costs: the pipelined rounds' pick (an input by nature, it changes per round) as
an array computed on the device (`pick_dev`, as the rounds make it), as one made on the host (`pick_host`), and at
the head of device arrays of 16 bytes and 16 KB (`pick_dev16`, `pick_dev4k`);
likewise the attention kernel's key count (`len_dev`, `len_host`). Each variant's outputs are compared bitwise with
the plain kernel's before it is timed; a case that fails is recorded as an error and the others still run.

Usage (device): python scripts/bench/bench_step_kernels.py --profiler-dir .device-tools --out step_kernels.json
"""

import argparse
import importlib.util
import json
import os

import mlx.core as mx

from lattice_mlx.bench.run import profile_calls
from lattice_mlx.metal import attention
from lattice_mlx.metal.argmax import argmax_kernel, argmax_ref
from lattice_mlx.metal.gated_delta import gated_delta_conv_kernel
from lattice_mlx.metal.qk_norm_rope import qk_norm_rope_kernel
from lattice_mlx.metal.rms_pair import rms_pair_kernel


def cases() -> dict:
    out = {}
    for rows in (1, 4, 5):
        x = (mx.random.normal((rows, 248320)) * 4).astype(mx.bfloat16)
        mx.eval(x)
        out[f"argmax_kernel_rows{rows}"] = lambda x=x: argmax_kernel(x)
        out[f"mx_argmax_rows{rows}"] = lambda x=x: argmax_ref(x)
    Hk, Dk, Hv, Dv, KC = 16, 128, 16, 128, 4
    C = 2 * Hk * Dk + Hv * Dv
    w = (mx.random.normal((C, KC)) * 0.3).astype(mx.bfloat16)
    A_log, dt_bias = mx.zeros((Hv,)), mx.zeros((Hv,), dtype=mx.bfloat16)
    state = mx.random.normal((1, Hv, Dv, Dk)) * 0.1
    mx.eval(w, state, A_log, dt_bias)

    def conv_case(T, step, variant="prod"):
        qkv = mx.random.normal((1, T, C)).astype(mx.bfloat16)
        a, b = mx.random.normal((1, T, Hv)).astype(mx.bfloat16), mx.random.normal((1, T, Hv)).astype(mx.bfloat16)
        conv = mx.random.normal((1, KC - 1, C)).astype(mx.bfloat16)
        mx.eval(qkv, a, b, conv)
        heads = (Hk, Dk, Hv, Dv)

        def prod():
            return gated_delta_conv_kernel(qkv, conv, w, a, b, A_log, dt_bias, state, heads=heads, step_states=step)

        if variant == "prod":
            return prod
        # pick_dev16 / pick_dev4k: the same values at the head of a device-made array of 16 bytes / 16 KB (MLX's
        # CUDA allocator serves <= 8 bytes from one shared managed pool and rounds sizes under 16 KB to a power of 2)
        size = {"pick_dev16": 4, "pick_dev4k": 4096}.get(variant, 2)
        pick = mx.array([0, 0], dtype=mx.int32) if variant == "pick_host" else (mx.arange(size) * 0).astype(mx.int32)
        mx.eval(pick)
        state5 = state.reshape(1, 1, Hv, Dv, Dk)

        def fn():
            return gated_delta_conv_kernel(qkv, conv, w, a, b, A_log, dt_bias, state5, heads=heads, step_states=step,
                                           pick=pick)

        fn.check = lambda: all(mx.array_equal(x, y).item() for x, y in zip(fn(), prod()))
        return fn

    for T, step in ((1, False), (1, True), (4, True), (4, False)):
        out[f"gdn_conv_T{T}_step{int(step)}"] = conv_case(T, step)
    for T, step in ((1, False), (4, True)):
        for variant in ("pick_dev", "pick_host", "pick_dev16", "pick_dev4k"):
            out[f"gdn_conv_T{T}_step{int(step)}_{variant}"] = conv_case(T, step, variant)
    for T in (1, 4):  # the 0.8B attention (Hq 8, Hkv 2, D 256) over 128 keys
        for variant in ("prod", "len_dev", "len_host"):
            out[f"sdpa_T{T}_L128" + ("" if variant == "prod" else f"_{variant}")] = sdpa_case(T, variant)
    for rows in (1, 4):
        out[f"rms_pair_rows{rows}"] = rms_pair_case(rows)
        out[f"qk_norm_rope_T{rows}"] = qk_norm_rope_case(rows)
    return out


def sdpa_case(T: int, variant: str):
    q = mx.random.normal((1, 8, T, 256)).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, 2, 128, 256)).astype(mx.bfloat16) for _ in range(2))
    length = mx.array([128], dtype=mx.int32) if variant == "len_host" else (mx.arange(1) + 128).astype(mx.int32)
    mx.eval(q, k, v, length)

    def prod():
        return attention.sdpa_kernel(q, k, v, scale=256 ** -0.5, causal=T > 1)

    if variant == "prod":
        return prod

    def fn():
        return attention.sdpa_kernel(q, k, v, scale=256 ** -0.5, causal=T > 1, length=length)

    fn.check = lambda: mx.array_equal(fn(), prod()).item()
    return fn


def rms_pair_case(rows: int):
    import mlx.nn as nn

    H = 1024
    e, h = ((mx.random.normal((1, rows, H)) * 2).astype(mx.bfloat16) for _ in range(2))
    norms = [nn.RMSNorm(H, eps=1e-6) for _ in range(3)]
    for n in norms:
        n.weight = (1 + 0.1 * mx.random.normal((H,))).astype(mx.bfloat16)
    mx.eval(e, h, *[n.weight for n in norms])
    return lambda: rms_pair_kernel(e, h, *norms)


def qk_norm_rope_case(T: int):
    import mlx.nn as nn

    Hq, Hkv, D = 8, 2, 256
    src = mx.random.normal((1, T, (2 * Hq + 2 * Hkv) * D)).astype(mx.bfloat16)
    qn, kn = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
    qn.weight, kn.weight = (mx.ones((D,), dtype=mx.bfloat16) for _ in range(2))
    offset = (mx.arange(1) + 100).astype(mx.int32)  # a device scalar, as the traced steps pass it
    mx.eval(src, qn.weight, kn.weight, offset)
    return lambda: qk_norm_rope_kernel(src, qn, kn, offset, heads=(Hq, Hkv, D), rope_dims=64, base=10_000_000.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profiler-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("gpu_kernels", os.path.join(args.profiler_dir, "gpu_kernels.py"))
    prof_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof_mod)
    results = {}
    for name, fn in cases().items():
        try:  # one case's failure is recorded, the others still run
            if hasattr(fn, "check") and not fn.check():
                raise AssertionError("outputs differ from the shipped kernel's")
            s = profile_calls(prof_mod.kernel_profile, fn, args.calls)
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {results[name]['error']}", flush=True)
            continue
        results[name] = {"us": round(s["kernel_us_per_step"], 2), "kernels": s["kernels_per_step"]}
        print(f"{name}: {s['kernel_us_per_step']:.2f} us ({s['kernels_per_step']:.1f} kernels)", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
