"""GPU kernel time of a batch's two costliest kernel families at the Qwen3.5-0.8B shape by sequences B, from CUPTI
(`gpu_kernels.py` of ../shared/device, copied into --profiler-dir): the fused GDN conv + recurrence step with one
value row per warp against the default (several for a batch), and the 4-bit projections in MLX's quantized matmul
(what a batch's steps of more than the fused kernel's MAX_ROWS take) beside the fused kernel where it applies, and
a round's per-row state pick (two forms), and the down projection and a block's output projection split over K into 2 or 4 batched quantized matmuls
(q4_matmul.split_k_matmul, the path a batch's steps of more than MAX_ROWS rows take on a CUDA device).

    python scripts/bench/bench_batch_kernels.py --profiler-dir .device-tools --out results.json [--bs 1,4,16,64]

Each case runs `calls` times inside one profile (one eval per call, each its own launch); the figure is kernel
microseconds per call, and per case the kernels each call launched.
"""

import argparse
import json

import mlx.core as mx
import numpy as np

from lattice_mlx.bench.report import device_name
from lattice_mlx.bench.run import load_profiler, profile_calls
from lattice_mlx.metal import q4_matmul as q4_module
from lattice_mlx.metal.gated_delta import conv_rows_per_warp, gated_delta_conv_kernel
from lattice_mlx.metal.q4_matmul import Pre, q4_matmul_kernel

H, I, GDN_IN, GDN_V = 1024, 3584, 8224, 2048  # 0.8B: hidden, MLP, GDN in_proj rows, GDN values
HK, HV, DK, DV, KC = 16, 16, 128, 128, 4


def arr(rng, *shape, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(mx.bfloat16)


def quantized(N: int, K: int, seed: int):
    return mx.quantize(arr(np.random.default_rng(seed), N, K, scale=0.05), group_size=64, bits=4)


def gdn_cases(B: int) -> dict:
    rng = np.random.default_rng(B)
    C = 2 * HK * DK + HV * DV
    inputs = (arr(rng, B, 1, C), arr(rng, B, KC - 1, C), arr(rng, C, KC, scale=0.5), arr(rng, B, 1, HV),
              arr(rng, B, 1, HV), mx.zeros((HV,), dtype=mx.float32) - 1.0, mx.zeros((HV,), dtype=mx.float32),
              mx.array(rng.standard_normal((B, HV, DV, DK)).astype(np.float32) * 0.1))
    heads = (HK, DK, HV, DV)
    out = {"gdn conv 1 row/warp": lambda: gated_delta_conv_kernel(*inputs, heads=heads, rows=1)}
    if conv_rows_per_warp(B, DV, DK) > 1:
        out[f"gdn conv {conv_rows_per_warp(B, DV, DK)} rows/warp (default)"] = \
            lambda: gated_delta_conv_kernel(*inputs, heads=heads)
    out["gdn conv 2 rows/warp"] = lambda: gated_delta_conv_kernel(*inputs, heads=heads, rows=2)
    # a K = 3 round's rollback: each row's float32 state at its accepted step n_b out of the verify's per-step states
    # [B, K + 1, Hv, Dv, Dk] (speculative/batched.py), by row-and-step indexing (what the round runs) and by
    # take_along_axis
    states = mx.array(rng.standard_normal((B, 4, HV, DV, DK)).astype(np.float32))
    n = mx.array(rng.integers(0, 4, B).astype(np.int32))
    rows = mx.arange(B)
    out["state pick [rows, n]"] = lambda: states[rows, n]
    out["state pick take_along_axis"] = lambda: mx.take_along_axis(states, n[:, None, None, None, None], axis=1)
    return out


def q4_cases(B: int) -> dict:
    rng = np.random.default_rng(100 + B)
    norm = Pre("rms", (1 + 0.1 * arr(rng, H)), 1e-6)
    x, res, h = arr(rng, B, 1, H), arr(rng, B, 1, H), arr(rng, B, 1, I)
    gu, down, inp = quantized(2 * I, H, 1), quantized(H, I, 2), quantized(GDN_IN, H, 3)
    v, out_proj = arr(rng, B, 1, GDN_V), quantized(H, GDN_V, 4)  # a GDN block's output projection (values -> hidden)
    k = dict(group_size=64, bits=4)
    out = {
        "mlx gate_up": lambda: q4_module.quantized_matmul(x, *gu, **k),
        "mlx down": lambda: q4_module.quantized_matmul(h, *down, **k),
        "mlx gdn in_proj": lambda: q4_module.quantized_matmul(x, *inp, **k),
        "mlx out_proj": lambda: q4_module.quantized_matmul(v, *out_proj, **k),
    }
    q4_cases.down = (h, down)  # (for main's error check)
    for S in (2, 4):  # (bound now: the lambdas run later)
        for name, (a, parts) in (("down", (h, down)), ("out_proj", (v, out_proj))):
            layout = q4_module.split_k_layout(*parts, parts=S, **k)
            out[f"mlx {name} split-K {S}"] = (lambda a, layout: lambda: q4_module.split_k_matmul(
                a.reshape(-1, a.shape[-1]), layout, **k))(a, layout)
    if B <= q4_module.MAX_ROWS:
        out |= {
            "fused gate_up rms+glu": lambda: q4_matmul_kernel(x, *gu, pre=norm, glu=True, group_size=64),
            "fused down +res": lambda: q4_matmul_kernel(h, *down, residual=res, group_size=64),
            "fused gdn in_proj rms": lambda: q4_matmul_kernel(x, *inp, pre=norm, group_size=64),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profiler-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--bs", default="1,4,16,64")
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    kernel_profile = load_profiler(args.profiler_dir)
    results: dict = {"device": device_name()}
    for B in map(int, args.bs.split(",")):
        cases = gdn_cases(B) | q4_cases(B)
        # each down projection's largest error against the same product in float32 (one call, x and the scales in
        # float32): a split's sum of S bf16 partial products against the one bf16 call's
        x, parts = q4_cases.down
        f32 = lambda a: a if a.dtype == mx.uint32 else a.astype(mx.float32)  # noqa: E731
        ref = mx.quantized_matmul(f32(x), *map(f32, parts), transpose=True, group_size=64, bits=4)
        for name in ("mlx down", "mlx down split-K 2", "mlx down split-K 4"):
            err = mx.abs(cases[name]().astype(mx.float32).reshape(ref.shape) - ref).max().item()
            results.setdefault(name, {})[f"max_abs_err_{B}"] = round(err, 4)
        for name, fn in cases.items():
            s = profile_calls(kernel_profile, fn, args.calls, top=2)
            results.setdefault(name, {})[B] = {"us": round(s["kernel_us_per_step"], 2),
                                               "kernels": s["kernels_per_step"],
                                               "top": [t["name"][:80] for t in s.get("top_kernels", [])]}
            print(f"B={B} {name}: {s['kernel_us_per_step']:.1f} us ({s['kernels_per_step']:.1f} kernels)", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
