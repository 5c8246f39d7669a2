"""Kernel benchmark: plain-ops reference vs custom kernel vs MLX built-in: GDN recurrence, 4-bit matmul, and (added
after the first H200 run, not yet run there) the conv-fused GDN form, decode/verify attention and the tree GDN.

    python scripts/bench/bench_kernels.py --out docs/results/archive/kernels/results.json [--ops gdn,q4,conv,attention,tree]

Prints a table, then one JSON line. Times are microseconds per call: `inner` calls are queued and evaluated
together (so one eval round trip is spread over them), repeated `reps` times; min / median / max over repetitions.
"""

import argparse
import functools
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from lattice_mlx.metal.gated_delta import gate_ref, gated_delta_kernel, gated_delta_ref, normalize_qk_ref
from lattice_mlx.metal.q4_matmul import q4_matmul_kernel, q4_matmul_ref

DEFAULT_GDN_T = (1, 2, 4, 9, 128, 512, 2048)
DEFAULT_Q4_SHAPES = ((248320, 1024), (3584, 1024), (1024, 3584))
# Qwen3.5-0.8B GDN in_proj_qkv (6144 x 1024) and a 4B-sized MLP up projection (9728 x 2560).
EXTRA_Q4_SHAPES = ((6144, 1024), (9728, 2560))


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-ref-above", type=int, default=2048, help="largest T timed through the ops reference")
    p.add_argument("--ops", default="gdn,q4,conv,attention,tree", help="which sections to run")
    return p


def timeit(fn, *, inner: int, reps: int) -> dict:
    mx.eval(fn())
    per_call = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        per_call.append((time.perf_counter() - t0) / inner * 1e6)
    med = statistics.median(per_call)
    cv = statistics.pstdev(per_call) / med if len(per_call) > 1 else 0.0
    return {"us_min": min(per_call), "us_median": med, "us_max": max(per_call), "cv": cv}


def gdn_inputs(T: int, dtype=mx.bfloat16, B=1, H=16, D=128):
    rng = np.random.default_rng(T)

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q, k, v = arr(B, T, H, D), arr(B, T, H, D), arr(B, T, H, D)
    a, b = arr(B, T, H), arr(B, T, H)
    A_log = mx.array(np.log(rng.uniform(0.01, 0.5, H)).astype(np.float32))
    dt_bias = mx.array(rng.uniform(-3.0, -1.0, H).astype(np.float32))
    state = mx.array((rng.standard_normal((B, H, D, D)) * 0.1).astype(np.float32))
    mx.eval(q, k, v, a, b, A_log, dt_bias, state)
    return q, k, v, a, b, A_log, dt_bias, state


def bench_gdn(args) -> list[dict]:
    rows = []
    for T in DEFAULT_GDN_T:
        inputs = gdn_inputs(T)
        inner = max(1, min(50, 4096 // (T * 4)))
        legs = {}
        for form in ("serial", "batched"):
            legs[f"kernel_{form}"] = functools.partial(gated_delta_kernel, *inputs, form=form)
            if T <= 512:
                legs[f"kernel_steps_{form}"] = functools.partial(
                    gated_delta_kernel, *inputs, step_states=True, form=form
                )
        if T <= args.skip_ref_above:
            legs["ref_ops"] = functools.partial(gated_delta_ref, *inputs)
        q, k, v, a, b, A_log, dt_bias, state = inputs
        qn, kn = normalize_qk_ref(q, k)
        g, beta = gate_ref(a, b, A_log, dt_bias)
        qn, kn = qn.astype(q.dtype), kn.astype(k.dtype)
        mx.eval(qn, kn, g, beta)
        legs["mlx_fast_gdn_recurrence_only"] = functools.partial(mx.fast.gated_delta_update, qn, kn, v, g, beta, state)
        for leg, fn in legs.items():
            reps = args.reps if leg != "ref_ops" or T <= 128 else 2
            n = 1 if leg == "ref_ops" and T > 128 else inner
            try:
                r = timeit(fn, inner=n, reps=reps)
            except Exception as e:  # a built-in that refuses these shapes is recorded, not fatal
                r = {"error": f"{type(e).__name__}: {e}"[:200]}
            rows.append({"op": "gated_delta", "T": T, "leg": leg, "dtype": "bfloat16", **r})
            msg = f"{r['us_median']:10.1f} us" if "us_median" in r else r["error"]
            print(f"gdn T={T:5d} {leg:30s} {msg}", flush=True)
    return rows


def q4_case(N, K, gs, seed=0):
    rng = np.random.default_rng(seed + N + K)
    w_full = mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05).astype(mx.bfloat16)
    w, s, b = mx.quantize(w_full, group_size=gs, bits=4)
    mx.eval(w, s, b)
    return w, s, b


def q4_row(N, K, gs, M, leg, fn, w, s, b, x, reps) -> dict:
    inner = 20 if N * K > 1e8 else 100
    r = timeit(fn, inner=inner if leg != "ref_ops" else 5, reps=reps)
    nbytes = w.nbytes + s.nbytes + b.nbytes + x.nbytes + M * N * 2
    r["GBps"] = nbytes / (r["us_median"] * 1e-6) / 1e9
    print(f"q4 N={N:6d} K={K:4d} g{gs} M={M} {leg:22s} {r['us_median']:9.1f} us {r['GBps']:8.0f} GB/s", flush=True)
    return {"op": "q4_matmul", "N": N, "K": K, "group_size": gs, "M": M, "leg": leg, **r}


def bench_q4(args) -> list[dict]:
    rows = []
    sweeps = [(N, K, gs, range(1, 9)) for N, K in DEFAULT_Q4_SHAPES for gs in (64, 32)]
    sweeps += [(N, K, 64, (1, 2, 4, 8)) for N, K in EXTRA_Q4_SHAPES]
    for N, K, gs, Ms in sweeps:
        w, s, b = q4_case(N, K, gs)
        for M in Ms:
            x = mx.array(np.random.default_rng(M).standard_normal((1, M, K)).astype(np.float32)).astype(mx.bfloat16)
            mx.eval(x)
            args4 = (x, w, s, b)
            legs = {
                "kernel": functools.partial(q4_matmul_kernel, *args4, group_size=gs),
                "mx_quantized_matmul": functools.partial(
                    mx.quantized_matmul, *args4, transpose=True, group_size=gs, bits=4
                ),
            }
            if M in (1, 8) and gs == 64 and (N, K) in DEFAULT_Q4_SHAPES:
                legs["ref_ops"] = functools.partial(q4_matmul_ref, *args4, group_size=gs)
            if (N, K, gs) == (248320, 1024, 64) and M in (1, 2, 3, 4, 6, 8):
                for R in (2, 4, 8):
                    legs[f"kernel_R{R}"] = functools.partial(q4_matmul_kernel, *args4, group_size=gs, rows=R)
            for leg, fn in legs.items():
                rows.append(q4_row(N, K, gs, M, leg, fn, w, s, b, x, args.reps))
    return rows


def _timed_legs(op: str, key: dict, legs: dict, args, inner: int) -> list[dict]:
    rows = []
    for leg, fn in legs.items():
        try:
            r = timeit(fn, inner=inner, reps=args.reps)
        except Exception as e:  # recorded, not fatal (e.g. a kernel on a backend without it)
            r = {"error": f"{type(e).__name__}: {e}"[:200]}
        rows.append({"op": op, **key, "leg": leg, **r})
        msg = f"{r['us_median']:10.1f} us" if "us_median" in r else r["error"]
        print(f"{op} {key} {leg:28s} {msg}", flush=True)
    return rows


def bench_conv(args) -> list[dict]:
    """The model's GDN mixer step after its input projection, 0.8B shape: conv-fused kernel vs concatenate + conv1d
    + SiLU + split + the recurrence kernel (the path it replaced; gated_delta_conv_ref dispatches that kernel)."""
    from lattice_mlx.metal.gated_delta import gated_delta_conv_kernel, gated_delta_conv_ref

    rows, heads = [], (16, 128, 16, 128)
    C = 2 * 16 * 128 + 16 * 128
    for T in (1, 2, 4, 9, 15):
        rng = np.random.default_rng(T)
        qkv = mx.array(rng.standard_normal((1, T, C)).astype(np.float32)).astype(mx.bfloat16)
        conv_state = mx.array(rng.standard_normal((1, 3, C)).astype(np.float32)).astype(mx.bfloat16)
        conv_w = mx.array(rng.standard_normal((C, 4)).astype(np.float32) * 0.5).astype(mx.bfloat16)
        _, _, _, a, b, A_log, dt_bias, state = gdn_inputs(T)
        inputs = (qkv, conv_state, conv_w, a, b, A_log, dt_bias, state)
        mx.eval(*inputs)
        legs = {"conv_fused_kernel": functools.partial(gated_delta_conv_kernel, *inputs, heads=heads, step_states=T > 1),
                "unfused_path": functools.partial(gated_delta_conv_ref, *inputs, heads=heads, step_states=T > 1)}
        rows += _timed_legs("gdn_conv", {"T": T}, legs, args, inner=50)
    return rows


def bench_attention(args) -> list[dict]:
    """0.8B attention (8 query heads, 2 KV heads, head_dim 256, bf16) reading a KV-cache view: kernel vs
    mx.fast.scaled_dot_product_attention (on CUDA: its ops fallback at head_dim 256)."""
    from lattice_mlx.metal.attention import sdpa_kernel

    rows = []
    for L in (256, 1024, 4096, 16384):
        rng = np.random.default_rng(L)
        buf_k = mx.array(rng.standard_normal((1, 2, L + 256, 256)).astype(np.float32)).astype(mx.bfloat16)
        buf_v = mx.array(rng.standard_normal((1, 2, L + 256, 256)).astype(np.float32)).astype(mx.bfloat16)
        mx.eval(buf_k, buf_v)
        k, v = buf_k[..., :L, :], buf_v[..., :L, :]
        for T in (1, 4, 9):
            q = mx.array(rng.standard_normal((1, 8, T, 256)).astype(np.float32)).astype(mx.bfloat16)
            mx.eval(q)
            causal = T > 1
            legs = {"kernel": functools.partial(sdpa_kernel, q, k, v, scale=256**-0.5, causal=causal),
                    "mx_fast_sdpa": functools.partial(mx.fast.scaled_dot_product_attention, q, k, v, scale=256**-0.5,
                                                      mask="causal" if causal else None)}
            rows += _timed_legs("attention", {"T": T, "L": L}, legs, args, inner=50)
    return rows


def bench_tree(args) -> list[dict]:
    """Tree-verify GDN recurrence, 0.8B GDN shape: kernel vs the plain-ops reference, for the shapes of ADR 0004."""
    from lattice_mlx.metal.gated_delta import gated_delta_tree_ref
    from lattice_mlx.metal.gated_delta_tree import gated_delta_tree_kernel

    rows = []
    trees = {"chain-4": [-1, 0, 1, 2], "width-4": [-1, -1, -1, -1], "2-2": [-1, -1, 0, 0, 1, 1],
             "3-1": [-1, -1, -1, 0, 1, 2]}
    for name, parents in trees.items():
        inputs = gdn_inputs(len(parents))
        legs = {"kernel": functools.partial(gated_delta_tree_kernel, *inputs, parents),
                "ref_ops": functools.partial(gated_delta_tree_ref, *inputs, parents)}
        rows += _timed_legs("gated_delta_tree", {"tree": name, "nodes": len(parents)}, legs, args, inner=50)
    return rows


def main():
    args = setup_arg_parser().parse_args()
    info = {"mlx": mx.__version__, "backend": "metal" if mx.metal.is_available() else "cuda"}
    sections = {"gdn": bench_gdn, "q4": bench_q4, "conv": bench_conv, "attention": bench_attention, "tree": bench_tree}
    rows = []
    for name in args.ops.split(","):
        rows += sections[name](args)
    result = {"info": info, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({"info": info, "n_rows": len(rows)}))


if __name__ == "__main__":
    main()
