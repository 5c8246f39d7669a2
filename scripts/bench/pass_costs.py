"""What each pass of the adaptive pipelined loop costs as its tuner times it, under forced depth schedules (no
decisions): generations at one depth from their start, and generations that change depth every BLOCK passes. It
answers what the tuner's readings cannot tell apart on their own: how many passes after a generation's start or a
change of depth cost more than the depth's steady passes (the tuner leaves PipelinedTuner.SKIP of them untimed), and
how a depth's steady pass compares with the fixed legs' whole-generation cost per round. Every pass's seconds are
recorded (the loop's own clock: dispatch to dispatch, the consumer's handling of the tokens included), as are
plain stretches run as plain decoding's loop, and of each pass the loop decided on its own, the host's share: the
time spent building its graph (PipelinedRounds.round: a round's, with the caches' settling after a change of depth,
or a plain step's) and in mx.async_eval (on a GPU backend, where MLX launches its kernels); the rest of the pass is
waiting for the GPU and the loop's bookkeeping. Greedy, SYNTHETIC drafts (bench/oracles.DeviceOracle at --p) on a
random shape, or the demo's own head.

Usage: python scripts/bench/pass_costs.py --model 0.8b [--p 0.8] [--tokens 256] [--reps 3] [--profile DIR]
         [--out FILE.json]
With --profile (a folder holding gpu_kernels.py): one more generation per schedule under CUPTI, its kernels per
generated token, GPU kernel time, busy and span (bench/run.profile_stream), so a pass's cost can be told apart into
GPU work and host time.
"""

import argparse
import json
import sys
import time

import mlx.core as mx

from lattice_mlx import SpecOptions, SpecStats, speculate
from lattice_mlx.bench.oracles import DeviceOracle
from lattice_mlx.bench.report import provenance
from lattice_mlx.bench.run import load_profiler, load_target, profile_stream, workload_prompts
from lattice_mlx.decode import generate_step
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import pipelined, tuning

BLOCK = 12
SCHEDULES = {  # name: the depths of successive blocks of BLOCK passes, cycled (one entry: that depth throughout)
    "k0": [0], "k1": [1], "k2": [2], "k3": [3], "k4": [4],
    "changes": [3, 2, 3, 4, 3, 1, 3, 0, 2, 4, 1, 0, 4, 2, 1, 3],
}
# this generation's passes: [depth, ms, passes at this depth before it, ms building its graph, ms in mx.async_eval]
# (None where a plain stretch's passes, run as one loop and reported at its end, cannot be told apart)
PASSES: list = []
HOST = {"build": 0.0, "launch": 0.0}  # host seconds of the pass in progress


def host_timed():
    """Wrappers of PipelinedRounds.round and mx.async_eval that add their time to HOST; returns a function that puts
    the originals back."""
    real_round, real_eval = pipelined.PipelinedRounds.round, mx.async_eval

    inside = []  # (an mx.async_eval inside PipelinedRounds.round, the head's catch-up's, is the build's time)

    def round_(self, r, k):
        tic = time.perf_counter()
        inside.append(1)
        try:
            return real_round(self, r, k)
        finally:
            inside.pop()
            HOST["build"] += time.perf_counter() - tic

    def async_eval(*arrays):
        tic = time.perf_counter()
        try:
            return real_eval(*arrays)
        finally:
            if not inside:
                HOST["launch"] += time.perf_counter() - tic

    pipelined.PipelinedRounds.round, mx.async_eval = round_, async_eval

    def restore():
        pipelined.PipelinedRounds.round, mx.async_eval = real_round, real_eval

    return restore


def forced(schedule: list[int]):
    """PipelinedTuner methods that follow `schedule` and record every pass."""

    def next_k(self, rates, hopeful=None):
        i = self.__dict__.setdefault("_forced", 0)
        self._forced = i + 1
        if i == 0:  # (the prefill's and the first token's launches are no pass's)
            HOST["build"] = HOST["launch"] = 0.0
        k = schedule[(i // BLOCK) % len(schedule)]
        # a plain block's other passes run as the loop's plain stretch (plain decoding's own loop), as the tuner's do
        self.k, self.left = k, (BLOCK - 1 - i % BLOCK if k == 0 else 0)
        return k

    def observe(self, k, seconds, build=True, launch=True):
        since = PASSES[-1][2] + 1 if PASSES and PASSES[-1][0] == k else 0
        PASSES.append([k, round(seconds * 1e3, 4), since, round(HOST["build"] * 1e3, 4) if build else None,
                       round(HOST["launch"] * 1e3, 4) if launch else None])
        HOST["build"] = HOST["launch"] = 0.0

    def plain_ran(self, seconds):
        # the stretch's first pass went through the loop (its graph built in PipelinedRounds.round); the launches of
        # the stretch's other passes are summed with its own, and nothing of theirs is per pass
        for i, s in enumerate(seconds):
            observe(self, 0, s, build=i == 0, launch=False)
        self._forced += len(seconds)
        self.left = 0

    return next_k, observe, plain_ran


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="0.8b")
    ap.add_argument("--p", type=float, default=0.8, help="SYNTHETIC acceptance of the oracle drafts (random shapes)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", metavar="DIR", help="a folder with gpu_kernels.py: CUPTI per schedule")
    ap.add_argument("--out", default="pass_costs.json")
    args = ap.parse_args()
    target = load_target(args.model, bits=4, group_size=64, dtype="bfloat16", seed=0, stock=False)
    model = target.model
    ids = workload_prompts(target, "random", 1, tokens=64, seed=0)[0] if target.tokenizer is None else \
        list(target.tokenizer.encode("def fibonacci(n):\n"))
    greedy = Sampler(temp=0.0)
    reference = []
    for t in generate_step(model, mx.array(ids), sampler=greedy):
        reference.append(t)
        if len(reference) == args.tokens + 8:
            break
    tuner = tuning.PipelinedTuner
    originals = tuner.next_k, tuner.observe, tuner.plain_ran
    out = {"meta": provenance(), "model": target.label, "p": args.p, "tokens": args.tokens, "block": BLOCK,
           "schedules": SCHEDULES, "generations": []}
    def stream(seed: int):
        options = SpecOptions(draft_tokens=4)
        stats = SpecStats.of(options)
        drafter = DeviceOracle(reference, args.p, model.args.vocab_size, 4, seed=seed) \
            if target.tokenizer is None else None
        return speculate(model, mx.array(ids), sampler=greedy, options=options, stats=stats, drafter=drafter), stats

    for rep in range(args.reps + 1):  # (rep 0 warms every schedule: not recorded)
        for name, schedule in SCHEDULES.items():
            tuner.next_k, tuner.observe, tuner.plain_ran = forced(schedule)
            PASSES.clear()
            HOST["build"] = HOST["launch"] = 0.0
            restore = host_timed()
            tic, n = time.perf_counter(), 0
            tokens, stats = stream(rep)
            try:
                for _ in tokens:
                    n += 1
                    if n == args.tokens:
                        break
            finally:
                # closed here, under this schedule: a stream stopped inside a plain stretch reports that stretch's
                # passes when it closes, and a later close recorded them under the next schedule
                tokens.close()
                restore()
                tuner.next_k, tuner.observe, tuner.plain_ran = originals
            seconds = time.perf_counter() - tic
            if rep:
                out["generations"].append({"rep": rep, "schedule": name, "seconds": seconds, "rounds": stats.rounds,
                                           "accepted": sum(stats.accepted_at), "passes": list(PASSES)})
            print(f"rep {rep} {name}: {seconds * 1e3:.1f} ms, {len(PASSES)} passes, {stats.rounds} rounds",
                  file=sys.stderr, flush=True)
    if args.profile:
        kernel_profile, out["gpu_profile"] = load_profiler(args.profile), {}
        for name, schedule in SCHEDULES.items():
            tuner.next_k, tuner.observe, tuner.plain_ran = forced(schedule)
            try:
                tokens, stats = stream(999)
                out["gpu_profile"][name] = profile_stream(kernel_profile, tokens, stats, args.tokens - 1)
            finally:
                tuner.next_k, tuner.observe, tuner.plain_ran = originals
            print(f"profile {name}: {out['gpu_profile'][name]}", file=sys.stderr, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
