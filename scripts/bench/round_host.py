"""Where the host's time goes in a plain step and in a pipelined MTP round: building the graph in Python, handing it
to MLX (`mx.async_eval`: MLX's C++ walks the graph and launches every kernel), and waiting for the previous result.

Usage: python scripts/bench/round_host.py [--shape 0.8b] [--dtype bfloat16] [--k 3] [--steps 64] [--out FILE]

Plain decoding and a pipelined round each queue step n + 1 before reading step n, so a loop whose "wait" share is
near zero is bound by the host (build + dispatch), one whose wait dominates is bound by the GPU. Also counts the
graph nodes (primitives) of one plain step and of one round, from `mx.export_to_dot`. Median microseconds per step
(plain) or per round (MTP), oracle drafts at per-position acceptance --p (synthetic: random weights).
"""

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from lattice_mlx.bench.oracles import DeviceOracle
from lattice_mlx.bench.run import DTYPES, SHAPES
from lattice_mlx.bench.synthetic import random_model
from lattice_mlx.decode import TracedSteps, prefill
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative.pipelined import PipelinedRounds, tracing


def graph_nodes(*outs: mx.array) -> dict:
    """Primitive nodes in the lazy graph behind `outs` (before evaluation): their number and how many of each."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        labels = re.findall(r'label ="([^"]+)", shape=rectangle', Path(f.name).read_text())
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return {"total": len(labels), "by_primitive": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def median_us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 1)


def plain(model, ids: list[int], steps: int, sampler: Sampler, *, traced: bool = False) -> tuple[dict, list[int]]:
    """`traced`: each step one replay of decode.TracedSteps's trace (generate_step's default since run 14)."""
    cache = model.make_cache(trimmable=False)  # as generate_step makes it (runs before f4dbf81: trimmable)
    logits, _ = prefill(model, mx.array(ids), cache)
    y = sampler(logits)
    mx.eval(y)
    traced_steps = TracedSteps(model, sampler, cache) if traced else None
    build, dispatch, wait, tokens = [], [], [], []
    nodes = None
    for i in range(steps):
        t0 = time.perf_counter()
        nxt = traced_steps.step(y) if traced else sampler(model(y.reshape(1, 1), cache)[0, -1])
        t1 = time.perf_counter()
        if nodes is None and i == steps // 2:
            nodes = graph_nodes(nxt)
            t1 = time.perf_counter()
            t0 = t1  # not timed
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        tokens.append(y.item())
        t3 = time.perf_counter()
        y = nxt
        if i >= 4:
            build.append(t1 - t0), dispatch.append(t2 - t1), wait.append(t3 - t2)
    return ({"traced": traced, "build_us": median_us(build), "dispatch_us": median_us(dispatch),
             "wait_us": median_us(wait),
             "total_us": median_us([a + b + c for a, b, c in zip(build, dispatch, wait)]), "graph_nodes": nodes},
            tokens)


def pipelined(model, ids: list[int], reference: list[int], rounds_n: int, k: int, p: float, *,
              read: str = "whole", traced: bool = False) -> dict:
    """`read`: how the host reads round r's tokens after dispatching round r + 1: "whole" (tokens.tolist(), then
    sliced in Python) or "slice" (tokens[: n + 1].tolist(), what rounds.py did up to run 12: a new array, evaluated
    on the stream behind round r + 1, so reading it waits for round r + 1). `traced`: steady-state rounds replay
    one mx.compile trace (PipelinedRounds.round; its build time is then all in draft_build_us)."""
    with tracing(traced):
        return _pipelined(model, ids, reference, rounds_n, k, p, read=read, traced=traced)


def _pipelined(model, ids, reference, rounds_n, k, p, *, read, traced):
    sampler = Sampler(temp=0.0)
    cache = model.make_cache(trimmable=False)
    logits, hidden = prefill(model, mx.array(ids), cache, return_hidden=True)
    first = sampler(logits).item()
    oracle = DeviceOracle(reference, p, model.args.vocab_size, k, seed=0)
    rounds = PipelinedRounds(model, sampler, k, ids, first, hidden, cache, oracle)
    verified, pending = 0, None
    draft_b, verify_b, dispatch, wait, accepted = [], [], [], [], []
    nodes = None
    for r in range(rounds_n):
        t0 = time.perf_counter()
        rounds.bounds(r, verified)
        if traced:
            out = rounds.round(r, k)
            t1 = time.perf_counter()
        else:
            drafts, q = rounds.draft(r)
            t1 = time.perf_counter()
            out = rounds.verify(drafts, q)
        t2 = time.perf_counter()
        if nodes is None and r == rounds_n // 2:
            nodes = graph_nodes(*out)
            t2 = time.perf_counter()
            t0, t1 = t2, t2
        mx.async_eval(*out)
        t3 = time.perf_counter()
        if pending is not None:
            n = pending[1].item()
            toks = pending[0][: n + 1].tolist() if read == "slice" else pending[0].tolist()[: n + 1]
            verified += len(toks)
            accepted.append(n)
        t4 = time.perf_counter()
        pending = out
        if r >= 4:
            draft_b.append(t1 - t0), verify_b.append(t2 - t1), dispatch.append(t3 - t2), wait.append(t4 - t3)
    tokens_per_round = statistics.mean(accepted) + 1
    total = median_us([a + b + c + d for a, b, c, d in zip(draft_b, verify_b, dispatch, wait)])
    return {"k": k, "p": p, "read": read, "traced": traced, "draft_build_us": median_us(draft_b),
            "verify_build_us": median_us(verify_b),
            "dispatch_us": median_us(dispatch), "wait_us": median_us(wait), "total_us": total,
            "tokens_per_round": round(tokens_per_round, 3), "us_per_token": round(total / tokens_per_round, 1),
            "graph_nodes": nodes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--k", default="2,3")
    ap.add_argument("--p", type=float, default=0.8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="alternating plain / round runs")
    ap.add_argument("--out")
    args = ap.parse_args()
    mx.random.seed(0)
    log(f"building {args.shape} on {mx.default_device()}")
    model = random_model(**SHAPES[args.shape], bits=args.bits or None, dtype=DTYPES[args.dtype])
    log("built; warming up plain")
    ids = mx.random.randint(0, model.args.vocab_size, (32,)).tolist()
    sampler = Sampler(temp=0.0)
    result = {"shape": args.shape, "dtype": args.dtype, "bits": args.bits, "device": str(mx.default_device()),
              "plain": [], "rounds": []}
    _, reference = plain(model, ids, args.steps * 4 + 8, sampler)  # warm-up, and the oracle's greedy continuation
    plain(model, ids, 8, sampler, traced=True)  # and the traced step's trace
    for k in map(int, args.k.split(",")):
        log(f"warming up rounds of K={k}")
        pipelined(model, ids, reference, 8, k, args.p)  # warm-up: kernels of K + 1 rows
        pipelined(model, ids, reference, 8, k, args.p, traced=True)  # and the round's trace
    log("timing")
    for rep in range(args.reps):
        for traced in (False, True):
            row, _ = plain(model, ids, args.steps, sampler, traced=traced)
            result["plain"].append(row)
            print("plain", json.dumps({key: v for key, v in row.items() if key != "graph_nodes"}), flush=True)
        if args.out:  # after every row: a run cut by its time limit keeps what it measured
            Path(args.out).write_text(json.dumps(result, indent=1))
        for k in map(int, args.k.split(",")):
            for read, traced in (("whole", False), ("whole", True)):
                row = pipelined(model, ids, reference, args.steps // 2, k, args.p, read=read, traced=traced)
                result["rounds"].append(row)
                print("round", json.dumps({key: v for key, v in row.items() if key != "graph_nodes"}), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
