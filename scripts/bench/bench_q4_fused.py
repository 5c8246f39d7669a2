"""GPU kernel time of the fused 4-bit projections at the Qwen3.5-0.8B shapes by rows M (decode M = 1, verify M = K+1),
from CUPTI (`gpu_kernels.py` of ../shared/device, copied into --profiler-dir): how a projection's cost grows with the
rows of a verify, and what the SwiGLU epilogue (glu) saves against the SwiGLU prologue of the down projection.

    python scripts/bench/bench_q4_fused.py --profiler-dir .device-tools --out results.json

Each case is run `calls` times inside one profile (one eval per call, so every call is its own launch); the figure
is kernel microseconds per call. `--set dense`: the same body on unquantized bf16 weights (`dense_matmul_kernel`, the
MTP head's layer as `convert -q` keeps it) against the plain ops it replaces (cuBLAS matmul, norm, gate, add), with
the kernels each launches; the bf16 lm_head too.
"""

import argparse
import importlib.util
import json
import os

import mlx.core as mx
import numpy as np

from lattice_mlx.bench.run import profile_calls
from lattice_mlx.metal import q4_matmul as q4_module
from lattice_mlx.metal.q4_matmul import Pre, dense_matmul_kernel, q4_matmul_kernel, unfused

H, I, GDN_IN, GDN_V, ATT_O = 1024, 3584, 8224, 2048, 2048  # 0.8B: hidden, MLP, GDN in_proj rows, GDN values, o_proj in


def quantized(N: int, K: int, seed: int):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05).astype(mx.bfloat16)
    return mx.quantize(w, group_size=64, bits=4)


def arr(rng, *shape):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)


def cases(M: int):
    """name -> zero-argument function launching one kernel at M rows."""
    rng = np.random.default_rng(M)
    norm = Pre("rms", (1 + 0.1 * arr(rng, H)), 1e-6)
    x, res = arr(rng, 1, M, H), arr(rng, 1, M, H)
    gu, down, inp = quantized(2 * I, H, 1), quantized(H, I, 2), quantized(GDN_IN, H, 3)
    outp, oproj = quantized(H, GDN_V, 4), quantized(H, ATT_O, 5)
    h2 = arr(rng, 1, M, 2 * I)
    h = arr(rng, 1, M, I)
    y_gdn, src = arr(rng, 1, M, 16, 128), arr(rng, 1, M, GDN_IN)
    gated = Pre("gated_rms", 1 + 0.1 * arr(rng, 128), 1e-6, src=src, offset=6144)
    attn, qsrc = arr(rng, 1, 8, M, 256), arr(rng, 1, M, 2 * ATT_O + 1024)
    k = dict(group_size=64)
    out = {
        "gate_up rms (old)": lambda: q4_matmul_kernel(x, *gu, pre=norm, **k),
        "down swiglu+res (old)": lambda: q4_matmul_kernel(h2, *down, pre=Pre("swiglu"), residual=res, **k),
        "gate_up rms+glu (new)": lambda: q4_matmul_kernel(x, *gu, pre=norm, glu=True, **k),
        "down none+res (new)": lambda: q4_matmul_kernel(h, *down, residual=res, **k),
        "gdn in_proj rms": lambda: q4_matmul_kernel(x, *inp, pre=norm, **k),
        "gdn out_proj gated_rms+res": lambda: q4_matmul_kernel(y_gdn, *outp, pre=gated, residual=res, **k),
        "attn o_proj gate+res": lambda: q4_matmul_kernel(attn, *oproj, pre=Pre("gate", src=qsrc), residual=res, **k),
        "gdn in_proj none": lambda: q4_matmul_kernel(x, *inp, **k),
    }
    for rows in (1, 2, 4, 8):
        out[f"gdn in_proj rms R={rows}"] = lambda rows=rows: q4_matmul_kernel(x, *inp, pre=norm, rows=rows, **k)
        out[f"gate_up rms+glu R={rows}"] = lambda rows=rows: q4_matmul_kernel(x, *gu, pre=norm, glu=True, rows=rows,
                                                                              **k)
        # the gated prologues recompute their gate (an exp per element) in every block: more rows per block means
        # fewer blocks recomputing it, against fewer warps in flight (run 8: 13.6 / 13.4 us at M=4 vs 4.7 bare)
        out[f"gdn out_proj gated_rms+res R={rows}"] = lambda rows=rows: q4_matmul_kernel(
            y_gdn, *outp, pre=gated, residual=res, rows=rows, **k)
        out[f"attn o_proj gate+res R={rows}"] = lambda rows=rows: q4_matmul_kernel(
            attn, *oproj, pre=Pre("gate", src=qsrc), residual=res, rows=rows, **k)
    return out


def dense_cases(M: int):
    """name -> zero-argument function: the fused dense kernel (new) and the plain ops it replaces (ops), MTP head
    layer shapes (0.8B: qkv 5120 x 1024, o_proj 1024 x 2048, gate_up 7168 x 1024, down 1024 x 3584) and lm_head."""
    rng = np.random.default_rng(M)
    norm = Pre("rms", (1 + 0.1 * arr(rng, H)), 1e-6)
    x, res = arr(rng, 1, M, H), arr(rng, 1, M, H)
    w = {name: 0.05 * arr(rng, N, K) for name, (N, K) in
         {"qkv": (5120, H), "o": (H, ATT_O), "gu": (2 * I, H), "down": (H, I), "lm": (248320, H)}.items()}
    attn, qsrc = arr(rng, 1, 8, M, 256), arr(rng, 1, M, 5120)
    h = arr(rng, 1, M, I)
    calls = {
        "qkv rms": (x, "qkv", dict(pre=norm)),
        "o_proj gate+res": (attn, "o", dict(pre=Pre("gate", src=qsrc), residual=res)),
        "gate_up rms+glu": (x, "gu", dict(pre=norm, glu=True)),
        "down res": (h, "down", dict(residual=res)),
        "lm_head rms": (x, "lm", dict(pre=norm)),
    }
    out = {}
    for name, (xi, wn, kw) in calls.items():
        out[f"{name} (new)"] = lambda xi=xi, wn=wn, kw=kw: dense_matmul_kernel(xi, w[wn], **kw)
        out[f"{name} (ops)"] = lambda xi=xi, wn=wn, kw=kw: unfused(lambda v: v @ w[wn].T, xi, **kw)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profiler-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ms", default="1,2,4,8")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--set", choices=("q4", "dense"), default="q4")
    p.add_argument("--only", default="", help="comma list of case names: run these only")
    p.add_argument("--capacities", default=q4_module.CAPACITY,
                   help="comma list of q4_matmul.CAPACITIES: each case run under each (the rows a variant holds)")
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("gpu_kernels", os.path.join(args.profiler_dir, "gpu_kernels.py"))
    prof_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof_mod)
    results = {}
    policies = args.capacities.split(",")
    for M, policy in [(M, c) for M in map(int, args.ms.split(",")) for c in policies]:
        q4_module.CAPACITY = policy
        for name, fn in (cases if args.set == "q4" else dense_cases)(M).items():
            if args.only and name not in args.only.split(","):
                continue
            name = f"{name} [{policy}]" if len(policies) > 1 else name
            s = profile_calls(prof_mod.kernel_profile, fn, args.calls)
            results.setdefault(name, {})[M] = {"us": round(s["kernel_us_per_step"], 2),
                                               "kernels": s["kernels_per_step"]} if args.set == "dense" \
                else round(s["kernel_us_per_step"], 2)
            print(f"M={M} {name}: {s['kernel_us_per_step']:.2f} us ({s['kernels_per_step']:.1f} kernels)", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
