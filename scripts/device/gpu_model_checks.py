"""Model-level checks for a GPU backend: kernels vs reference logits, forward cost over T = 1..9, exact greedy MTP.

Usage: python scripts/device/gpu_model_checks.py --out DIR   (writes model_checks.json; prints a summary)
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx


def with_kernels(on: bool):
    os.environ["LATTICE_KERNELS"] = "" if on else "ref"


def logits_kernels_vs_ref(model, ids: mx.array) -> float:
    with_kernels(False)
    ref = model(ids).astype(mx.float32)
    mx.eval(ref)
    with_kernels(True)
    out = model(ids).astype(mx.float32)
    return mx.abs(out - ref).max().item(), mx.abs(ref).max().item()


def forward_cost(model, *, reps: int = 30) -> dict[int, float]:
    """Median seconds of one cached forward over T tokens (after a 64-token prefill), T = 1..9."""
    from lattice_mlx import cache as caches
    from lattice_mlx.decode import prefill

    cache = model.make_cache()
    prefill(model, mx.arange(64) % 1000, cache)
    out = {}
    for T in range(1, 10):
        times = []
        for _ in range(reps):
            caches.begin(cache)
            tic = time.perf_counter()
            mx.eval(model(mx.arange(T)[None] + 7, cache))
            times.append(time.perf_counter() - tic)
            caches.rollback(cache, T)
            caches.commit(cache)
        out[T] = statistics.median(times)
    return out


def greedy_mtp_exact(model, tokenizer) -> dict:
    from lattice_mlx import SpecOptions, generate

    prompt = "class Queue:\n    def __init__(self):\n"
    plain = generate(model, tokenizer, prompt, max_tokens=200)
    res = {}
    for k in (1, 2, 3, 4):
        spec = generate(model, tokenizer, prompt, max_tokens=200, speculation=SpecOptions(draft_tokens=k, adaptive=False))
        res[k] = {"equal": spec.tokens == plain.tokens, "acceptance": spec.speculation["acceptance_rate"]}
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--small", action="store_true", help="a small random shape instead of 0.8B (CPU dry run)")
    args = p.parse_args()
    from lattice_mlx import load
    from lattice_mlx.bench.report import provenance
    from lattice_mlx.bench.synthetic import QWEN3_5_0_8B, random_model

    result = {"device": str(mx.default_device()), "mlx": mx.__version__, "platform": platform.platform(),
              **provenance()}
    ids = mx.array([[(i * 7919) % 8000 for i in range(37)]])
    demo, tok = load()
    result["demo_kernels_vs_ref"] = logits_kernels_vs_ref(demo, ids)
    result["demo_greedy_mtp"] = greedy_mtp_exact(demo, tok)
    print("demo checks done", result["demo_kernels_vs_ref"], result["demo_greedy_mtp"], flush=True)
    shape = dict(QWEN3_5_0_8B, hidden_size=256, num_hidden_layers=4, vocab_size=8192) if args.small else QWEN3_5_0_8B
    big = random_model(**shape, bits=4, group_size=64, dtype=mx.bfloat16)
    print("built the random model", flush=True)
    result["q4_0.8b_kernels_vs_ref"] = logits_kernels_vs_ref(big, ids)
    for on in (True, False):
        with_kernels(on)
        cost = forward_cost(big)
        result[f"forward_cost_{'kernels' if on else 'ref'}"] = {T: c / cost[1] for T, c in cost.items()}
        result[f"forward_T1_ms_{'kernels' if on else 'ref'}"] = cost[1] * 1e3
    with_kernels(True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "model_checks.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
