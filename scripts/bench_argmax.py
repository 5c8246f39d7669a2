"""GPU time per call (CUPTI, through `gpu_kernels.py` of ../shared/device copied into --profiler-dir) of the greedy
argmax kernel (metal/argmax.py) against MLX's argmax, at the 0.8B vocabulary (248,320) in bf16, rows 1 / 4 / 5; and
of the GDN mixer's conv-fused kernel at T = 1 with and without per-step states and at T = 4 (why a plain step's
launch measured 28.8 us against a K=3 verify's 19.9 us in run 16, and ~9.8 us in run 5): with its `cols` input
cached (now) or made per call (before), and with 1-16 rows dv per threadgroup (4 is the default).

Usage (device): python scripts/bench_argmax.py --profiler-dir .device-tools --out argmax.json
"""

import argparse
import importlib.util
import json
import os

import mlx.core as mx

from lattice_mlx.metal.argmax import argmax_kernel, argmax_ref
from lattice_mlx.metal import gated_delta
from lattice_mlx.metal.gated_delta import gated_delta_conv_kernel


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

    def conv_case(T, step, rows=4, fresh_cols=False):
        qkv = mx.random.normal((1, T, C)).astype(mx.bfloat16)
        a, b = mx.random.normal((1, T, Hv)).astype(mx.bfloat16), mx.random.normal((1, T, Hv)).astype(mx.bfloat16)
        conv = mx.random.normal((1, KC - 1, C)).astype(mx.bfloat16)
        mx.eval(qkv, a, b, conv)

        def fn():
            saved = gated_delta.CONV_ROWS, gated_delta._cols
            gated_delta.CONV_ROWS = rows
            if fresh_cols:  # a new host-made `cols` array per call (before the run-17 cache)
                gated_delta._cols = gated_delta._cols.__wrapped__
            try:
                return gated_delta_conv_kernel(qkv, conv, w, a, b, A_log, dt_bias, state, heads=(Hk, Dk, Hv, Dv),
                                               step_states=step)
            finally:
                gated_delta.CONV_ROWS, gated_delta._cols = saved
        return fn

    for T, step in ((1, False), (1, True), (4, True), (4, False)):
        out[f"gdn_conv_T{T}_step{int(step)}"] = conv_case(T, step)
        out[f"gdn_conv_T{T}_step{int(step)}_fresh_cols"] = conv_case(T, step, fresh_cols=True)
    for rows in (1, 2, 8, 16):
        out[f"gdn_conv_T1_step0_rows{rows}"] = conv_case(1, False, rows=rows)
        out[f"gdn_conv_T4_step1_rows{rows}"] = conv_case(4, True, rows=rows)
    return out


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
        for _ in range(3):
            mx.eval(fn())  # compile, warm
        with prof_mod.kernel_profile(steps=args.calls) as prof:
            for _ in range(args.calls):
                mx.eval(fn())
        s = prof.summary(top=3)
        results[name] = {"us": round(s["kernel_us_per_step"], 2), "kernels": s["kernels_per_step"]}
        print(f"{name}: {s['kernel_us_per_step']:.2f} us ({s['kernels_per_step']:.1f} kernels)", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
