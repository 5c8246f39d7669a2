"""How many `mx.compile` traces (runs of a traced function's Python body) one leg's first generation in a fresh
process builds: on a GPU each trace compiles kernels (seconds on MLX's CUDA backend), so this counts the first-use
cost without a GPU. Usage (tracing forced on, as on a GPU):
  LATTICE_TRACE_ROUNDS=1 LATTICE_TRACE_STEPS=1 LATTICE_COMPILE=1 python scripts/bench/count_traces.py LEG P N
LEG: kK (fixed K) or default (SpecOptions()); P: the oracle's acceptance (bench/oracles.DeviceOracle); N: tokens.
Prints one JSON line: the traces by function, the whole-round / whole-step traces by kind, and the tuner's log."""

import collections
import functools
import json
import sys
import time

import mlx.core as mx

counts = collections.Counter()
_compile = mx.compile


def _counting(fun=None, *args, **kw):
    if fun is None:
        return lambda f: _counting(f, *args, **kw)
    name = getattr(fun, "__qualname__", None) or getattr(getattr(fun, "func", None), "__qualname__", repr(fun))

    def body(*a, **k):
        counts[name] += 1
        return fun(*a, **k)

    return _compile(functools.wraps(fun)(body) if hasattr(fun, "__name__") else body, *args, **kw)


mx.compile = _counting  # before the package builds its compiled functions

from lattice_mlx import SpecOptions, SpecStats, speculate, traces  # noqa: E402
from lattice_mlx.bench.oracles import DeviceOracle  # noqa: E402
from lattice_mlx.bench.run import load_target  # noqa: E402
from lattice_mlx.decode import generate_step  # noqa: E402
from lattice_mlx.sample import Sampler  # noqa: E402

_traced = traces.compile_traced


def _counting_traced(body, fallback, captured):
    def counted(owner, state, extras):
        counts["whole " + body.__qualname__.split(".")[0]] += 1
        return body(owner, state, extras)

    return _traced(counted, fallback, captured)


traces.compile_traced = _counting_traced


def main() -> int:
    leg, p, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    model = load_target("tiny", bits=0, group_size=64, dtype="float32", seed=0, stock=False).model
    ids = list(range(3, 67))
    ref = [x for x, _ in zip(generate_step(model, mx.array(ids), sampler=Sampler()), range(n + 8))]  # (warms plain)
    counts.clear()
    options = SpecOptions() if leg == "default" else SpecOptions(draft_tokens=int(leg[1:]), adaptive=False)
    stats = SpecStats.of(options)
    tic = time.perf_counter()
    drafter = DeviceOracle(ref, p, model.args.vocab_size, options.draft_tokens)
    out = [x for x, _ in zip(speculate(model, mx.array(ids), sampler=Sampler(), options=options, stats=stats,
                                       drafter=drafter), range(n))]
    print(json.dumps({"leg": leg, "p": p, "tokens": n, "seconds": round(time.perf_counter() - tic, 2),
                      "greedy_identical": out == ref[:n], "traces": sum(counts.values()),
                      "by_function": dict(counts.most_common()), "tuner_log": stats.tuner_log[:8]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
