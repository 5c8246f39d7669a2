"""GPU kernels per forward, from CUPTI (the profiler in ../shared/device/gpu_kernels.py, copied into .device-tools/):
kernels, GPU kernel time, busy and span per forward, and its wall time with and without the profiler, over T = 1, 2,
4, 8 tokens (a decode step and verifies that record per-step GDN states and roll back), for lattice and for mlx-lm's
own model on the same weights, plus the kernel names by count for T = 1.

Usage (GPU machine): python scripts/bench/profile_kernels.py --out DIR [--shape 0.8b] [--dtype bfloat16] [--tools DIR]
Writes DIR/profile_kernels.json and prints one line per measurement.
"""

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

from lattice_mlx import cache as caches
from lattice_mlx.bench.report import provenance
from lattice_mlx.bench.run import SHAPES, build_stock
from lattice_mlx.bench.synthetic import hub_config, random_model
from lattice_mlx.decode import prefill

STEPS = 30


def profile(kernel_profile, fn, steps: int = STEPS) -> dict:
    for _ in range(5):
        fn()
    mx.synchronize()
    tic = time.perf_counter()
    for _ in range(steps):  # wall time without the profiler's own cost
        fn()
    mx.synchronize()
    bare = (time.perf_counter() - tic) / steps
    tic = time.perf_counter()
    with kernel_profile(steps=steps) as prof:
        for _ in range(steps):
            fn()
    wall = (time.perf_counter() - tic) / steps
    s = prof.summary(top=12)
    counts = collections.Counter(e["name"][:90] for e in prof.events if e["cat"] == "kernel")
    s["by_count"] = [{"name": k, "per_step": c / steps} for k, c in counts.most_common(25)]
    s["wall_us_per_step"] = wall * 1e6
    s["wall_us_bare"] = bare * 1e6
    return s


def profile_stock(kernel_profile, stock, prompt: mx.array, tok: mx.array) -> dict:
    cache = stock.make_cache()
    mx.eval(stock(prompt[None], cache=cache))

    def step():
        mx.eval(stock(tok, cache=cache))
        for c in cache:
            if c.is_trimmable():
                c.trim(1)

    return profile(kernel_profile, step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--shape", default="0.8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tools", default=".device-tools", help="folder holding gpu_kernels.py")
    p.add_argument("--ts", default="1,2,4,8", help="verify sizes T to profile")
    p.add_argument("--no-stock", action="store_true", help="skip mlx-lm's model")
    args = p.parse_args()
    sys.path.insert(0, args.tools)
    from gpu_kernels import kernel_profile

    dtype = getattr(mx, args.dtype)
    mx.random.seed(0)
    model = random_model(**SHAPES[args.shape], bits=4, group_size=64, dtype=dtype)
    config = hub_config(**SHAPES[args.shape])
    config["quantization"] = {"group_size": 64, "bits": 4}
    stock, diff = build_stock(model, config)
    prompt = mx.random.randint(1, 1000, (64,))
    results = {**provenance(), "shape": args.shape, "dtype": args.dtype, "stock_logit_diff": diff}

    cache = model.make_cache()
    prefill(model, prompt, cache)
    tok = mx.array([[7]])

    def decode():  # one step, then the KV rows it wrote are dropped so every step sees the same length
        mx.eval(model(tok, cache))
        for c in cache:
            if isinstance(c, caches.KVCache):
                c.trim(1)

    def verify(T):
        ids = mx.arange(T)[None] + 7

        def run():
            caches.begin(cache)
            mx.eval(model(ids, cache))
            caches.rollback(cache, T)
            caches.commit(cache)
        return run

    results["lattice_T1_decode"] = profile(kernel_profile, decode)
    for T in map(int, args.ts.split(",")):
        results[f"lattice_T{T}_verify"] = profile(kernel_profile, verify(T))
    if not args.no_stock:
        results["stock_T1"] = profile_stock(kernel_profile, stock, prompt, tok)
    for name, s in results.items():
        if isinstance(s, dict):
            print(f"{name:22s} kernels {s['kernels_per_step']:6.1f}  kernel_us {s['kernel_us_per_step']:8.1f}  "
                  f"busy_us {s['busy_us_per_step']:8.1f}  span_us {s['span_us_per_step']:8.1f}  "
                  f"wall_us {s['wall_us_per_step']:8.1f}  bare_wall_us {s['wall_us_bare']:8.1f}", flush=True)
    print("T=1 decode kernels by count:")
    for k in results["lattice_T1_decode"]["by_count"]:
        print(f"  {k['per_step']:5.1f}  {k['name']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
