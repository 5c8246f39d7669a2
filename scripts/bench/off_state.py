"""What the pipelined loop's off state (speculation off: plain steps inside run_pipelined) costs against plain
decoding, and why: whole greedy generations with the tuner held at K = 0, legs interleaved, and variants that take
one difference away each.

Usage: python scripts/bench/off_state.py [--shape 0.8b] [--dtype bfloat16] [--tokens 256] [--reps 10]
         [--profile .device-tools] [--out FILE.json]

Legs (every one decodes the same tokens; the off legs never speculate):
  plain          generate_step, plain decoding's own loop
  plain-aa       the same again (A/A control)
  off            run_pipelined with the adaptive tuner in one plain stretch (K = 0) for the whole generation: the
                 loop as an off decision runs it
  off-untuned    the same with the tuner's timing of passes (observe) skipped: in a stretch only its first pass
                 and last few are timed, so little is left to take away (a check that it stays so)
  off-unheld     the same without keeping each step's hidden for the head's catch-up (the backlog): what holding a
                 buffer per step costs the allocator
  off-nohidden   the step's trace without the hidden output, nothing held: the step's graph as plain decoding's
  off-bare       PipelinedRounds.plain_step driven in generate_step's order with none of run_pipelined's loop (no
                 tuner, no stats, no pending bookkeeping): the off state's step and caches alone
Per leg: median wall seconds, the ratio to plain's paired by repetition, the median wait between two tokens, and
the waits for the first token (prefill) and the second (the loop's set-up after the first). With --profile: CUPTI kernels, kernel time, busy
and span per token over a generation of each leg.
"""

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import time

import mlx.core as mx

from lattice_mlx import SpecOptions, SpecStats, speculate
from lattice_mlx.bench import stats as bs
from lattice_mlx.bench.report import device_name, provenance
from lattice_mlx.bench.run import load_profiler, load_target, profile_stream
from lattice_mlx.decode import generate_step, resume
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import pipelined, tuning

LEGS = ("plain", "plain-aa", "off", "off-untuned", "off-unheld", "off-nohidden", "off-bare")


class _Dropped(list):
    def append(self, item) -> None:  # (never caught up on: the off legs never speculate)
        pass


@contextlib.contextmanager
def _patched(leg: str):
    """The off legs' changes to the loop, undone after."""
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    if leg.startswith("off"):  # one plain stretch longer than any generation, as the tuner runs an off decision's
        tuner_init = tuning.PipelinedTuner.__init__

        def held(self, *a, **kw):
            tuner_init(self, *a, **kw)
            self.k, self.left = 0, 1 << 40
        patch(tuning.PipelinedTuner, "__init__", held)
    if leg == "off-untuned":
        patch(tuning.PipelinedTuner, "observe", lambda self, k, seconds: None)
    if leg in ("off-unheld", "off-nohidden"):
        init = pipelined.PipelinedRounds.__init__

        def unheld(self, *a, **kw):
            init(self, *a, **kw)
            self.backlog = _Dropped()
            if leg == "off-nohidden":
                steps = pipelined.TracedSteps(self.model, self.sampler, self.cache, hidden=False,
                                              traced=self.steps.traced)
                hid = self.phid[-1:]
                self.steps.step = lambda y: (steps.step(y), hid)
        patch(pipelined.PipelinedRounds, "__init__", unheld)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def bare(model, ids: list[int]):
    """The off state's plain steps (PipelinedRounds.plain_step on the loop's caches, the head's slots held) in
    generate_step's order: the next step queued, then the token read."""
    sampler = Sampler(temp=0.0)
    cache, _, logits, hidden, _ = resume(model, mx.array(ids), None, return_hidden=True)
    y = sampler(logits)
    mx.async_eval(y)
    rounds = pipelined.PipelinedRounds(model, sampler, 3, ids, y, hidden, cache)
    for r in itertools.count():
        rounds.bounds(r, max(r - 1, 0))  # (the passes read before pass r: all but the one in flight)
        nxt, _ = rounds.plain_step()
        mx.async_eval(nxt)
        yield y.item()
        y = nxt


def stream(model, leg: str, ids: list[int]):
    sampler = Sampler(temp=0.0)
    if leg.startswith("plain"):
        return generate_step(model, mx.array(ids), sampler=sampler), None
    if leg == "off-bare":
        return bare(model, ids), None
    stats = SpecStats.of(SpecOptions())
    return speculate(model, mx.array(ids), sampler=sampler, options=SpecOptions(), stats=stats), stats


def run(model, leg: str, ids: list[int], n: int) -> tuple[float, list[float], list[int]]:
    """(wall seconds, the waits from the call to the first token and between tokens, the tokens) of one whole
    generation of n tokens."""
    with _patched(leg):
        tic = time.perf_counter()
        it, _ = stream(model, leg, ids)
        tokens, times = [], []
        for t in it:
            times.append(time.perf_counter())
            tokens.append(t)
            if len(tokens) == n:
                break
        it.close()
    return times[-1] - tic, [b - a for a, b in zip([tic, *times], times)], tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="0.8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--legs", default=",".join(LEGS))
    p.add_argument("--profile", default=None, help="folder holding gpu_kernels.py (CUPTI per leg)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    legs = args.legs.split(",")
    target = load_target(args.shape, bits=4, group_size=64, dtype=args.dtype, seed=0, stock=False)
    model = target.model
    ids = [int(x) for x in mx.random.randint(0, model.args.vocab_size, (args.prompt_tokens,), key=mx.random.key(1))]
    ref = None
    for leg in legs:  # every leg once, untimed (traces, kernel builds)
        _, _, tokens = run(model, leg, ids, args.tokens)
        ref = ref or tokens
        if tokens != ref:
            print(f"{leg}: not plain greedy's tokens", file=sys.stderr)
            return 1
    rec = {leg: {"wall_s": [], "gap_median_us": [], "first_us": [], "second_gap_us": []} for leg in legs}
    for rep in range(args.reps):
        for leg in bs.abba_order(legs, rep):
            wall, gaps, _ = run(model, leg, ids, args.tokens)
            rec[leg]["wall_s"].append(wall)
            rec[leg]["gap_median_us"].append(round(1e6 * statistics.median(gaps[2:]), 1))
            rec[leg]["first_us"].append(round(1e6 * gaps[0], 1))
            rec[leg]["second_gap_us"].append(round(1e6 * gaps[1], 1))
        print(f"rep {rep}: " + " ".join(f"{leg} {rec[leg]['wall_s'][-1]:.4f}" for leg in legs), file=sys.stderr)
    summary = {}
    for leg in legs:
        ratios = [a / b for a, b in zip(rec["plain"]["wall_s"], rec[leg]["wall_s"])]
        summary[leg] = {"wall_s_median": statistics.median(rec[leg]["wall_s"]), "vs_plain": bs.summarize(ratios),
                        "gap_median_us": statistics.median(rec[leg]["gap_median_us"]),
                        "first_us": statistics.median(rec[leg]["first_us"]),
                        "second_gap_us": statistics.median(rec[leg]["second_gap_us"])}
        print(f"{leg:13s} {summary[leg]['wall_s_median']:.4f} s  plain/leg {summary[leg]['vs_plain']['median']:.3f} "
              f"({summary[leg]['vs_plain']['min']:.3f}-{summary[leg]['vs_plain']['max']:.3f})  gap "
              f"{summary[leg]['gap_median_us']:.0f} us  first {summary[leg]['first_us']:.0f} us  second "
              f"{summary[leg]['second_gap_us']:.0f} us")
    profiles = {}
    if args.profile:
        kernel_profile = load_profiler(args.profile)
        for leg in legs:
            if leg != "plain-aa":
                with _patched(leg):
                    it, stats = stream(model, leg, ids)
                    profiles[leg] = profile_stream(kernel_profile, it, None, min(args.tokens, 128))
                print(f"profile {leg}: " + " ".join(f"{k} {profiles[leg][k]:.1f}" for k in (
                    "kernels_per_step", "kernel_us_per_step", "busy_us_per_step", "span_us_per_step")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": {**provenance(), "device": device_name(), "shape": args.shape, "dtype": args.dtype,
                                "tokens": args.tokens, "reps": args.reps, "command": " ".join(sys.argv)},
                       "legs": rec, "summary": summary, "gpu_profile": profiles or None}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
