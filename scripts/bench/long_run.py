"""A long generation: 8,192 tokens with MTP (K=2, fixed) against plain greedy, token for token, fp32 on the CPU, on
the embedded demo model and a random checkpoint; peak memory of each leg, so cache growth shows.

Usage: python scripts/bench/long_run.py --out docs/results/archive/long_run_cpu.json [--tokens 8192]
"""

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from lattice_mlx import load
from lattice_mlx.bench.report import provenance
from lattice_mlx.bench.synthetic import random_checkpoint
from lattice_mlx.decode import generate_step
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import SpecOptions, SpecStats, speculate

PROMPT = [5, 9, 33, 21, 7, 100, 3, 17]


def leg(stream, n: int) -> dict:
    mx.reset_peak_memory()
    tic = time.perf_counter()
    tokens = [t for t, _ in zip(stream, range(n))]
    return {"tokens": tokens, "seconds": time.perf_counter() - tic, "peak_memory_mb": mx.get_peak_memory() / 1e6}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=8192)
    args = p.parse_args()
    results = {**provenance(), "platform": platform.platform(), "tokens": args.tokens, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in (("demo", None), ("random", random_checkpoint(Path(tmp) / "r", seed=0))):
            model, _ = load(path, dtype="float32")
            ids = mx.array(PROMPT)
            plain = leg(generate_step(model, ids, sampler=Sampler()), args.tokens)
            options = SpecOptions(draft_tokens=2, adaptive=False)
            stats = SpecStats.of(options)
            spec = leg(speculate(model, ids, sampler=Sampler(), options=options, stats=stats), args.tokens)
            row = {"identical": spec["tokens"] == plain["tokens"],
                   "first_difference": next((i for i, (a, b) in enumerate(zip(spec["tokens"], plain["tokens"]))
                                             if a != b), None),
                   "plain_s": plain["seconds"], "mtp_s": spec["seconds"], "plain_peak_mb": plain["peak_memory_mb"],
                   "mtp_peak_mb": spec["peak_memory_mb"], "acceptance_rate": stats.to_dict()["acceptance_rate"],
                   "rounds": stats.rounds}
            results["models"][name] = row
            print(name, json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
