"""Replays the pipelined tuner (speculative/tuning.PipelinedTuner) against measured costs and acceptance, with no
model: each pass costs its depth's cost times log-normal noise, each round accepts its drafts by Bernoulli draws at
the given conditional rates, and the rates reach the tuner two passes after the round's dispatch, as in the
pipelined loop. A process runs GENS generations on one tuner memory; the figure is plain decoding's time over the
default's, the median over the generations, then over SEEDS processes. Beside it: every fixed depth's expected
speedup from the same costs and rates.

The cases are run E's on the H200 (docs/adr/0008, 'Run E'): per-pass costs in ms, rounded, read from its fixed-K
legs' rounds (decode seconds / rounds) and plain legs, the conditional acceptance from the fixed legs' acceptance.
The 0.8B cases share the costs of the oracle-0.5 group (oracle 0.8 was not in run E: its rates are the oracle's).

    python scripts/bench/replay_tuner.py                 # the table
    python scripts/bench/replay_tuner.py --trace "demo 0.7"  # one process: per generation, passes per depth
"""

import argparse
import itertools
import math
import operator
import random
import statistics
from collections import Counter

from lattice_mlx.speculative import tuning
from lattice_mlx.speculative.options import SpecOptions, SpecStats
from lattice_mlx.speculative.tuning import PipelinedTuner, expected_tokens, fresh_memory, tuner_rates

# name: (P(draft i accepted | drafts before it accepted), {K: ms per pass})
CASES = {
    "demo 0.7": ([0.85, 0.83, 0.8, 0.78], {0: 0.85, 1: 1.4, 2: 1.8, 3: 2.1, 4: 2.5}),
    "0.8B p=0.5": ([0.5] * 4, {0: 2.2, 1: 2.8, 2: 3.2, 3: 3.5, 4: 3.85}),
    "0.8B p=0.3": ([0.3] * 4, {0: 2.2, 1: 2.7, 2: 3.1, 3: 3.4, 4: 3.85}),
    "0.8B p=0": ([0.0] * 4, {0: 2.2, 1: 2.7, 2: 3.1, 3: 3.4, 4: 3.85}),
    "0.8B p=0.8": ([0.8] * 4, {0: 2.2, 1: 2.8, 2: 3.2, 3: 3.5, 4: 3.85}),
    "demo greedy": ([0.99] * 4, {0: 0.7, 1: 1.05, 2: 1.25, 3: 1.4, 4: 1.55}),
    # run Q's (an H100, a quiet host): the demo at 0.7 over 1,024 tokens, per round of its fixed K=3 leg and the
    # tuner's readings; the rates are a guess that gives the K=3 leg's 3.0-3.9 tokens per round
    "demo 0.7 H100": ([0.9, 0.85, 0.85, 0.85], {0: 0.65, 1: 1.08, 2: 1.38, 3: 1.55, 4: 1.76}),
    # run R's 0.8B shape (pass_costs.py, steady passes of forced depths, an H100) at the oracle's rates
    "0.8B p=0.5 H100": ([0.5] * 4, {0: 1.52, 1: 1.80, 2: 2.12, 3: 2.54, 4: 3.36}),
    "0.8B p=0.8 H100": ([0.8] * 4, {0: 1.52, 1: 1.80, 2: 2.12, 3: 2.54, 4: 3.36}),
    # run V's (an H100, a host slow in spells): per round of the fixed legs (K=4: the default's, which ran there) in
    # its fast repetitions, the rates from the fixed legs' acceptance (bf16 verify rows disagree with the oracle's
    # recorded run: 0.8 asked for, 0.82 read at the first draft)
    "0.8B p=0.8 H100 V": ([0.82, 0.88, 0.69, 0.7], {0: 1.65, 1: 2.16, 2: 2.43, 3: 2.57, 4: 3.38}),
    # run W's (an H100, a host slow in spells): the tuner's readings in the oracle-0.3 group (K=4: the line's)
    "0.8B p=0.3 H100 W": ([0.3] * 4, {0: 2.35, 1: 2.8, 2: 3.2, 3: 3.9, 4: 4.3}),
    "0.8B p=0 H100 W": ([0.0] * 4, {0: 2.35, 1: 2.8, 2: 3.2, 3: 3.9, 4: 4.3}),
    # run Z's (an H100, a host slow in spells): per round of the fixed legs, medians (decode seconds / rounds), the
    # demo's conditional rates from its fixed legs' tokens per round (1.81, 2.49, 3.04, 3.47 at K=1..4)
    "0.8B p=0.5 H100 Z": ([0.5] * 4, {0: 1.62, 1: 1.95, 2: 2.29, 3: 2.61, 4: 3.46}),
    "0.8B p=0.8 H100 Z": ([0.8] * 4, {0: 1.62, 1: 2.06, 2: 2.26, 3: 2.75, 4: 3.41}),
    "demo 0.7 H100 Z": ([0.81, 0.84, 0.81, 0.78], {0: 0.64, 1: 1.03, 2: 1.28, 3: 1.44, 4: 1.63}),
    # MLX's CPU backend, the demo greedy on a 2-core x86-64 (docs/adr/0008, 'The CPU backend'): a forward over 1-4
    # rows 17.5, 31.4, 43.6, 56.4 ms (5 rows: the line's 69), the head's step 4.5 ms; no depth can pay
    "demo CPU": ([0.95] * 4, {0: 17.5, 1: 35.9, 2: 52.6, 3: 69.9, 4: 87.0}),
}
LAG = 2  # passes from a round's dispatch to its acceptance in the rates (pipelined.run_pipelined)


def host_factor(host: dict, rng: random.Random, drift: tuple[float, float], spells: tuple[float, float, int]) -> float:
    """The host's speed factor for the next pass, moving `host` ({"x": the drift's log-AR(1) value, "spell": passes
    of a slow spell left}) on: `drift` (sigma, rho) and `spells` (rate, factor, length) as `generation` takes them."""
    sigma, rho = drift
    if sigma:
        host["x"] = rho * host.get("x", 0.0) + math.sqrt(1 - rho * rho) * sigma * rng.gauss(0.0, 1.0)
    factor = math.exp(host.get("x", 0.0))
    if host.get("spell", 0) <= 0 and spells[0] and rng.random() < spells[0]:
        host["spell"] = spells[2]
    if host.get("spell", 0) > 0:
        host["spell"] -= 1
        factor *= spells[1]
    return factor


def generation(memory: dict, cond: list[float], costs: dict, rng: random.Random, tokens: int = 256,
               noise: float = 0.2, seen: Counter | None = None, switch: float = 1.0, probe: float = 0.0,
               drift: tuple[float, float] = (0.0, 0.0), host: dict | None = None,
               spells: tuple[float, float, int] = (0.0, 1.0, 0), first: tuple[float, int] = (1.0, 0),
               settle: tuple[float, ...] = (), slow_gen: tuple[float, float] = (0.0, 1.0),
               start: tuple[float, int] = (1.0, 0), host_ms: tuple[float, float] | None = None,
               fixed_k: int | None = None) -> float:
    """One generation of `tokens` on a tuner with `memory`; returns plain's time over this one's. `switch`: what the
    first two passes after a change of depth cost, as a multiple of their depth's (an untraced round, the pipeline
    refilling; 1: nothing more); `probe`: ms added to a round after plain steps (the head catching up, the
    round built op by op); `drift` (sigma, rho): a host factor common to every depth, log-AR(1) per pass with that
    stationary sigma, carried across the process's generations in `host` (on the GPU a depth's cost drifted 1.6-2.7
    ms in one process while i.i.d. noise of the same size averages out); `spells` (rate, factor, length): slow
    spells of the host, each pass starting one with that probability, every pass in it costing `factor` times more
    for `length` passes (run M's demo read K=2 at twice its cost in one); plain's time is then its cost times the
    generation's mean factor. `first` (factor, passes): in a process's first generation each depth's first `passes`
    passes cost `factor` times more (runs N and O: the process's first rounds of a depth, after the untimed ones,
    read K=3 at 1.6x its later cost on the demo). `settle`: what the passes after a change of depth (or the
    generation's start) cost, as multiples of their depth's, by their place after it (overrides `switch`; run R's
    pass_costs.py: about 2, 1.1, 1.05, 1.03 on the H100). `slow_gen` (share, factor): that share of the generations
    runs on a host that many times slower throughout (run R's host ran whole generations 1.4x slower). `start`
    (factor, tokens): over the generation's first tokens the deeper drafts (all but the first) pass at their rates
    times the factor (run Q's demo at 0.7 read position 1 at 0.35 early, and position 0 at 0.92-0.94 later).
    `host_ms` (a, b): a host-bound loop: a pass of depth k costs max(its depth's cost, (a + b * k) ms times the
    host's factor), so the host's spells and drift raise the shallow depths' costs more than a deep depth's that the
    GPU bounds (run V: a slow spell read K=3 at 1.4x its cost and K=4 at 1.2x), and plain's time is the same max over
    the generation's factors. `fixed_k`: every pass at that depth (a fixed leg on the same simulated host), the tuner
    only told its costs."""
    stats = SpecStats.of(SpecOptions(draft_tokens=4))
    fresh, runs = not memory.get("cost"), Counter()  # (the process's first generation)
    host = {} if host is None else host
    factors = 0.0
    plain_floor = host_ms[0] if host_ms else 0.0
    gen_factor = slow_gen[1] if slow_gen[0] and rng.random() < slow_gen[0] else 1.0
    tuner = PipelinedTuner(4, memory, lag=LAG)
    done, spent, pending, last = 1, 0.0, [], []
    stretch, left = [], 0  # a plain stretch's passes, run as plain decoding's loop (pipelined.run_pipelined): no
    # decision per pass, reported to the tuner at once (PipelinedTuner.plain_ran) at its end or the generation's
    while done < tokens:
        inner = left > 0
        if inner:
            k, left = 0, left - 1
        else:
            k = tuner.next_k(tuner_rates(stats), lambda: tuner_rates(stats, tuning.OFF_HOPE)) if fixed_k is None \
                else fixed_k
        factor = host_factor(host, rng, drift, spells) * gen_factor
        factors += max(costs[0], plain_floor * factor) if host_ms else factor
        since = next((i for i, d in enumerate(reversed(last)) if d != k), len(last))
        settled = (settle[since] if since < len(settle) else 1.0) if settle else \
            (switch if k not in last[-2:] else 1.0)
        bound = max(costs[k], (host_ms[0] + host_ms[1] * k) * factor) if host_ms else costs[k] * factor
        cost = bound * rng.lognormvariate(0.0, noise) * settled
        runs[k] += 1
        if fresh and k and runs[k] <= first[1]:
            cost *= first[0]
        cost += probe if k and last and last[-1] == 0 else 0.0
        last.append(k)
        if inner:
            stretch.append(cost)
            if not left:
                tuner.plain_ran(stretch)
                stretch = []
        else:
            tuner.observe(k, cost)
            left = tuner.plain_left() if k == 0 else 0
        spent += cost
        accepted = 0
        while accepted < k and rng.random() < cond[accepted] * (start[0] if done < start[1] and accepted else 1.0):
            accepted += 1
        pending.append((k, accepted))
        if len(pending) >= LAG:  # (recorded in the pass after its own, as the loop does: in the rates 2 passes on)
            pk, pn = pending.pop(0)
            if pk:
                stats.record(pk, pn)
        done += accepted + 1
        if seen is not None:
            seen[k] += 1
    tuner.plain_ran(stretch)  # (a stretch the generation ended inside)
    # (plain's mean pass: the noise's mean is above 1)
    return (1.0 if host_ms else costs[0]) * math.exp(noise**2 / 2) * tokens * (factors / len(last)) / spent


def replay(cond: list[float], costs: dict, gens: int = 10, seeds: int = 20, switch: float = 1.0,
           probe: float = 0.0, tokens: int = 256, drift: tuple[float, float] = (0.0, 0.0),
           vary: tuple[float, float] = (0.0, 1.0), spells: tuple[float, float, int] = (0.0, 1.0, 0),
           first: tuple[float, int] = (1.0, 0), settle: tuple[float, ...] = (),
           slow_gen: tuple[float, float] = (0.0, 1.0), start: tuple[float, int] = (1.0, 0),
           host_ms: tuple[float, float] | None = None, fixed_k: int | None = None) -> list[float]:
    """Per seed (a process): the median over its generations of the default's speedup (`fixed_k`: that fixed
    depth's). `vary` (share, factor): that share of the generations (texts) drafts at the rates times the factor."""
    share, factor = vary
    return [statistics.median(generation(memory, [c * factor for c in cond] if rng.random() < share else cond, costs,
                                         rng, tokens, switch=switch, probe=probe, drift=drift, host=host,
                                         spells=spells, first=first, settle=settle, slow_gen=slow_gen,
                                         start=start, host_ms=host_ms, fixed_k=fixed_k)
                              for _ in range(gens))
            for rng, memory, host in ((random.Random(s), fresh_memory(), {}) for s in range(seeds))]


def fixed(cond: list[float], costs: dict, k: int) -> float:
    """A fixed depth's expected speedup over plain decoding (the tuner's own tokens-per-round model)."""
    return expected_tokens(k, list(itertools.accumulate(cond, operator.mul))) * costs[0] / costs[k]


def fixed_host(cond: list[float], costs: dict, k: int, host_ms: tuple[float, float], spells: tuple[float, float, int],
               drift: tuple[float, float], slow_gen: tuple[float, float], passes: int = 200_000) -> float:
    """fixed() on a host-bound loop (`host_ms`): plain's and depth k's mean pass over the same host factors (the
    spells', the drift's, the slow generations' in proportion)."""
    rng, host, plain, deep = random.Random(1), {}, 0.0, 0.0
    for i in range(passes):
        factor = host_factor(host, rng, drift, spells) * (slow_gen[1] if i < slow_gen[0] * passes else 1.0)
        plain += max(costs[0], host_ms[0] * factor)
        deep += max(costs[k], (host_ms[0] + host_ms[1] * k) * factor)
    return expected_tokens(k, list(itertools.accumulate(cond, operator.mul))) * plain / deep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", choices=list(CASES), help="one process of this case, generation by generation")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--switch", type=float, default=1.0, help="the cost of the 2 passes after a change of depth, as a "
                    "multiple of the depth's")
    ap.add_argument("--probe-ms", type=float, default=0.0, help="ms added to the first round after plain steps")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per generation")
    ap.add_argument("--vary", default="0,1", help="SHARE,FACTOR: that share of the generations (texts) drafts at "
                    "the case's rates times FACTOR")
    ap.add_argument("--drift", default="0,0",
                    help="SIGMA,RHO: a host factor common to every depth (log-AR(1) per pass)")
    ap.add_argument("--first", default="1,0", help="FACTOR,PASSES: in a process's first generation each depth's first "
                    "PASSES passes cost FACTOR times more")
    ap.add_argument("--spells", default="0,1,0", help="RATE,FACTOR,LENGTH: slow spells of the host (each pass starts "
                    "one with probability RATE; its LENGTH passes cost FACTOR times more)")
    ap.add_argument("--settle", default="", help="F0,F1,..: the passes after a change of depth, as multiples of "
                    "their depth's cost, by their place after it (overrides --switch)")
    ap.add_argument("--slow-gen", default="0,1", help="SHARE,FACTOR: that share of the generations on a host that "
                    "many times slower")
    ap.add_argument("--start", default="1,0", help="FACTOR,TOKENS: over each generation's first TOKENS tokens the "
                    "drafts after the first pass at the case's rates times FACTOR")
    ap.add_argument("--host-ms", default="", help="A,B: a host-bound loop, each pass at least (A + B * K) ms "
                    "times the host's factor (--drift, --spells, --slow-gen then slow the host alone)")
    ap.add_argument("--cases", default="", help="NAME,..: only these cases")
    ap.add_argument("--realized", action="store_true", help="each fixed depth run through the same simulated "
                    "processes (host, texts, switch costs) as the default, instead of its expected speedup")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a constant of speculative/tuning.py for the replay (e.g. SPECULATE_MIN_GAIN=1.02)")
    args = ap.parse_args()
    for item in args.set:
        name, value = item.split("=", 1)
        if not hasattr(tuning, name):
            ap.error(f"tuning.py has no constant {name}")
        setattr(tuning, name, type(getattr(tuning, name))(float(value)))
    host_ms = tuple(float(x) for x in args.host_ms.split(",")) if args.host_ms else None
    settle = tuple(float(x) for x in args.settle.split(",")) if args.settle else ()
    slow_gen = tuple(float(x) for x in args.slow_gen.split(","))
    start = (float(args.start.split(",")[0]), int(args.start.split(",")[1]))
    drift = tuple(float(x) for x in args.drift.split(","))
    rate, factor, length = args.spells.split(",")
    spells = (float(rate), float(factor), int(length))
    first = (float(args.first.split(",")[0]), int(args.first.split(",")[1]))
    if args.trace:
        cond, costs = CASES[args.trace]
        rng, memory, host = random.Random(0), fresh_memory(), {}
        for g in range(10):
            seen = Counter()
            speedup = generation(memory, cond, costs, rng, args.tokens, seen=seen, switch=args.switch,
                                 probe=args.probe_ms, drift=drift, host=host, spells=spells, first=first,
                                 settle=settle, slow_gen=slow_gen, start=start, host_ms=host_ms)
            print(g, f"{speedup:.2f}", dict(sorted(seen.items())), {k: round(v, 2) for k, v in
                                                                   sorted(memory.get("cost", {}).items())})
        return
    for name, (cond, costs) in CASES.items():
        if args.cases and name not in args.cases.split(","):
            continue
        def runs_of(fixed_k: int | None) -> list[float]:
            return replay(cond, costs, seeds=args.seeds, switch=args.switch, probe=args.probe_ms, tokens=args.tokens,
                          drift=drift, vary=tuple(float(x) for x in args.vary.split(",")), spells=spells,
                          first=first, settle=settle, slow_gen=slow_gen, start=start, host_ms=host_ms,
                          fixed_k=fixed_k)

        if args.realized:
            best, k = max((statistics.median(runs_of(k)), k) for k in range(1, 5))
        else:
            best, k = max((fixed_host(cond, costs, k, host_ms, spells, drift, slow_gen) if host_ms else
                           fixed(cond, costs, k), k) for k in range(1, 5))
        runs = runs_of(None)
        med = statistics.median(runs)
        p10 = sorted(runs)[len(runs) // 10]
        print(f"{name:12s} default {med:.2f} (seeds {min(runs):.2f}-{max(runs):.2f}, tenth {p10:.2f})  best fixed "
              f"K={k} {best:.2f}"
              f"  default / max(best, 1) {med / max(best, 1.0):.2f}")


if __name__ == "__main__":
    main()
