"""Host (Python) time to build one decode step's and one verify's graph, layer-by-layer vs compiled
(LATTICE_COMPILE=1): the part of a speculative round that plain decoding hides behind the GPU and a round cannot.

Usage: python scripts/host_overhead.py [--shape 0.8b] [--out docs/bench/host_overhead_cpu.json]
Times only graph construction (the model call, no evaluation); evaluation runs untimed between calls.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from lattice_mlx import cache as caches
from lattice_mlx.bench import git_revision
from lattice_mlx.generate import prefill
from lattice_mlx.synthetic import QWEN3_5_0_8B, random_model


def build_ms(model, T: int, reps: int = 30) -> float:
    cache = model.make_cache()
    prefill(model, mx.arange(32) % 1000, cache)
    times = []
    for i in range(reps + 3):
        caches.begin(cache)
        tic = time.perf_counter()
        out = model(mx.arange(T)[None] + 7, cache)
        dt = time.perf_counter() - tic
        mx.eval(out)
        caches.rollback(cache, T)
        caches.commit(cache)
        if i >= 3:  # the first calls trace the compiled functions
            times.append(dt)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--small", action="store_true", help="0.8B structure at small widths (same node count)")
    args = p.parse_args()
    shape = dict(QWEN3_5_0_8B)
    if args.small:
        shape.update(hidden_size=256, intermediate_size=512, vocab_size=4096, linear_key_head_dim=32,
                     linear_value_head_dim=32, head_dim=64)
    mx.random.seed(0)
    model = random_model(**shape, bits=4, group_size=64, dtype=mx.float32)
    res = {}
    for T in (1, 3, 4):
        for flag in ("0", "1"):
            os.environ["LATTICE_COMPILE"] = flag
            res[f"T{T}_{'compiled' if flag == '1' else 'layers'}_ms"] = round(build_ms(model, T), 3)
    os.environ["LATTICE_COMPILE"] = "0"
    meta = {"device": str(mx.default_device()), "mlx": mx.__version__, "platform": platform.platform(),
            "git": git_revision()[0], "shape": "0.8b structure" + (" (small widths)" if args.small else ""),
            "what": "median ms of Python graph construction for one cached forward over T tokens"}
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": res}, indent=1))


if __name__ == "__main__":
    main()
