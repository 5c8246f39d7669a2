"""Aggregate decode throughput of continuous batching against mlx-lm's batch_generate on the same weights: B streams
of random prompts, whole generations (prefill included), legs interleaved (ABBA) with an A/A leg, one process.

Usage: python scripts/bench/batch_throughput.py --model 0.8b [--streams 1,4,16,64] [--tokens 128] [--reps 10]
         [--dtype bfloat16] [--bits 4] [--profile DIR] [--out FILE.json]
Legs: `ours` (lattice_mlx.batch_generate, max_batch = B), `ours-aa` (the same again: the A/A control), `ours-mtp`
(MTP rounds of depth --mtp-k over the batch, SYNTHETIC acceptance at --oracle-p: bench/oracles.py),
`ours-mtp-auto` (the same drafts, the depth up to 4 or plain steps tuned for the batch, the tuner's memory kept across
generations as a server's engine keeps it), `mlx-lm`
(mlx_lm.batch_generate on mlx-lm's qwen3_5 sharing our weight arrays), `ours-untraced` (--untraced 1: plain steps
built op by op, LATTICE_TRACE_STEPS=0, against `ours`' traced batch steps; `ours-mtp-untraced`: the rounds built op by
op, LATTICE_TRACE_ROUNDS=0, against `ours-mtp`' traced rounds), `ours-dequant` and `ours-mtp-dequant`
(--dequant-ab N: `ours` and `ours-mtp` with LATTICE_DEQUANT_ROWS=N, the 4-bit matmuls of N rows or more dequantized
and multiplied instead of MLX's quantized matmul), `ours-nosplit` and `ours-mtp-nosplit` (--split-k-ab 1: with
LATTICE_SPLIT_K=0, no projection split over K past 8 rows: q4_matmul.SplitK), `ours-bprefill` and
`ours-mtp-bprefill` (--batch-prefill-ab 1: with LATTICE_BATCH_PREFILL=1, waiting prompts prefilled in one forward,
left-padded where --prompt-spread makes their lengths unequal, the default; the other legs then run with it off), `ours-f16` and `ours-mtp-f16` (--fused-rows-ab 16: with
LATTICE_FUSED_ROWS=16, a batch's steps and rounds of up to 16 rows in the fused 4-bit kernel), `solo` (B = 1 only:
plain generate_step, the single-stream reference). --oracle forced (the default): the head drafts and the target
verifies for real, and each position's draft is kept with probability --oracle-p whatever the target says
(ForcedBatchRounds), so the MTP legs run on the bench's model in its dtype and are paired against `ours`. --oracle recorded: the drafts are plain's recorded greedy
continuation with probability p (OracleBatchRounds); a row whose verify disagrees with plain's argmax leaves that
continuation and its drafts are never right again (batch runs 2-4, even in float32 on a GPU), so these legs run on the
model in --mtp-dtype (float32 by default on a random shape) against `ours-mtp-base`, batched plain steps on that model,
and `mtp_rounds` counts the rows that left. --skip drops legs by name. Each leg runs once untimed per B first. On a
GPU, with the adaptive leg, a process of its own runs every kind of pass that leg runs at each B first (`warm_kinds`,
--machine-warmup 1: what MLX builds once per machine is then on disk; the seconds are meta.machine_warmup_s).
With --profile (CUPTI, DIR/gpu_kernels.py): kernels, GPU kernel time, busy against span and the costliest kernels
per decode step of `ours` (and `ours-untraced`, `ours-dequant`, `ours-mtp-base`) and per round of `ours-mtp` at each
B, after every B's timings, from the first step after every sequence joined; then three more steps' (rounds')
kernels in launch order, with the copy kernels' neighbours (`one_step`, `one_round`), then the host's time by part
(`host_split`) and its costliest Python calls (`host_top`), each over as many passes again. Per MTP leg and timed
repetition, `mtp_rounds` holds the tokens per round (a fixed depth K at p keeps 1 + p + .. + p^K on average) and,
with --oracle recorded, how many rows left plain's recorded continuation. After each B's timings, `timeline`: one more
generation of `ours` and `ours-mtp` pass by pass, its time by phase (prefills, the pass after a join, steady passes,
the tail as sequences leave).
"""

import argparse
import json
import subprocess
import sys
import time
import types

import mlx.core as mx
import mlx_lm
import numpy as np

from lattice_mlx import batch_generate, settings
from lattice_mlx.batch import BatchDecoder
from lattice_mlx.bench import stats as bs
from lattice_mlx.bench.oracles import ForcedBatchRounds, OracleBatchRounds
from lattice_mlx.bench.report import device_name, kernel_name, provenance
from lattice_mlx.bench.run import SHAPES, load_profiler, load_target
from lattice_mlx.decode import generate_step
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative.pipelined import warm_passes

WARMUP: dict = {}  # the machine warm-up's seconds and exit status, for the JSON's meta
NO_EOS = types.SimpleNamespace(eos_token_ids=[], decode=lambda ids: "")


def leg_settings(args, leg: str):
    """The leg's LATTICE_DEQUANT_ROWS (the environment's unless it is a -dequant leg), LATTICE_SPLIT_K (off for a
    -nosplit leg), LATTICE_BATCH_PREFILL (with --batch-prefill-ab: on for a -bprefill leg, off for the others; else
    the environment's) and LATTICE_FUSED_ROWS (16 for a -f16 leg)."""
    prefill = leg.endswith("-bprefill") if args.batch_prefill_ab else None
    return settings.override(dequant_rows=str(args.dequant_ab) if leg.endswith("-dequant") else None,
                             split_k=False if leg.endswith("-nosplit") else None, batch_prefill=prefill,
                             fused_rows="16" if leg.endswith("-f16") else None)


# per MTP leg, what each of its generations got: (tokens per round, rows whose tokens left plain's recorded
# continuation, with --oracle recorded; None with forced); after a row leaves it, its SYNTHETIC drafts are never right
# again (batch run 3: 3 of 5 repetitions)
ROUNDS: dict[str, list[tuple[float, int]]] = {}

# the adaptive leg's tuner memories (costs per batch-size bucket), kept from one generation to the next as a server's
# one engine keeps them
MEMORIES: dict = {}


def rounds_engine(target, B: int, refs: list[list[int]] | None, k: int, p: float, adaptive: bool = False):
    """SYNTHETIC rounds at acceptance p: ForcedBatchRounds without refs, OracleBatchRounds (plain's recorded greedy
    continuations `refs`) with them."""
    if refs is None:
        engine = ForcedBatchRounds(target.model, k=k, p_correct=p, max_batch=B, adaptive=adaptive)
    else:
        engine = OracleBatchRounds(target.model, k=k, references=dict(enumerate(refs)), p_correct=p, max_batch=B,
                                   adaptive=adaptive)
    if adaptive:
        engine.memories = MEMORIES
    return engine


def run_rounds(target, prompts: list[list[int]], n: int, refs: list[list[int]], k: int, p: float,
               adaptive: bool = False) -> list[list[int]]:
    """MTP rounds over the batch at SYNTHETIC acceptance p (rounds_engine); adaptive:
    the depth (or plain steps) tuned for the batch, up to k."""
    engine = rounds_engine(target, len(prompts), refs, k, p, adaptive)
    seqs = [engine.add(ids, max_tokens=n) for ids in prompts]
    while engine.busy:
        engine.step()
    run_rounds.stats = engine.stats
    return [s.tokens for s in seqs]


def warm_kinds(target, B: int, p: float, k_max: int = 4) -> int:
    """Every kind of pass the adaptive batch engine runs at B sequences, untimed: its depths forced through the
    single generation's warm-up schedule (pipelined.warm_passes: each depth first, plain steps and each depth after
    them, every change between two depths), greedy. What MLX builds for them on a GPU is kept on disk, so the timed
    process finds it as a user's second run on the machine would; the traces stay this process's. Batch runs 5, 6 and
    8 compiled for 3.8-12.7 s inside timed repetitions of the adaptive leg (ADR 0009). Returns the passes run."""
    passes = 0
    for seq in warm_passes(k_max):
        engine = rounds_engine(target, B, None, k_max, p, adaptive=True)
        depths = iter(seq)
        engine._choose_k = lambda depths=depths: next(depths, 0)  # (plain steps once the schedule is over)
        seqs = [engine.add([(7 * i + 3 + b) % target.model.args.vocab_size for i in range(16)],
                           max_tokens=(len(seq) + 4) * (k_max + 1)) for b in range(B)]
        for _ in range(len(seq) + 2):  # (the prefills' steps, then the schedule's passes)
            engine.step()
            passes += 1
        for s in seqs:
            engine.cancel(s)
    return passes


def run_leg(target, leg: str, prompts: list[list[int]], n: int, refs=None, args=None) -> float:
    """Seconds for every prompt's n tokens."""
    tic = time.perf_counter()
    if leg in ("ours", "ours-aa", "ours-untraced", "ours-dequant", "ours-mtp-base", "ours-nosplit", "ours-bprefill",
               "ours-f16"):
        model = (args.mtp_target if leg == "ours-mtp-base" else target).model
        with settings.override(trace_steps=False if leg == "ours-untraced" else None), leg_settings(args, leg):
            batch_generate(model, None, prompts, max_tokens=n, max_batch=len(prompts))
    elif leg in ("ours-mtp", "ours-mtp-dequant", "ours-mtp-auto", "ours-mtp-untraced", "ours-mtp-nosplit",
                 "ours-mtp-bprefill", "ours-mtp-f16"):
        with leg_settings(args, leg), settings.override(trace_rounds=False if leg == "ours-mtp-untraced" else None):
            got = run_rounds(args.mtp_target, prompts, n, refs, 4 if leg == "ours-mtp-auto" else args.mtp_k,
                             args.oracle_p, adaptive=leg == "ours-mtp-auto")
        left = None if refs is None else sum(g != r[:n] for g, r in zip(got, refs))
        st = run_rounds.stats
        ROUNDS.setdefault(leg, []).append((round(sum(st.accepted_at) / st.rounds + 1, 3) if st.rounds else 0.0, left))
        if left:
            print(f"{leg}: {left} of {len(got)} rows' greedy tokens differ from plain's", file=sys.stderr)
    elif leg == "mlx-lm":
        mlx_lm.batch_generate(target.stock, NO_EOS, prompts, max_tokens=n, completion_batch_size=len(prompts),
                              prefill_batch_size=min(len(prompts), 8))
    else:
        for i, _ in zip(range(n), generate_step(target.model, mx.array(prompts[0]), sampler=Sampler())):
            pass
    return time.perf_counter() - tic


def summary(prof) -> dict:
    """A profile's totals per step and its costliest kernels, rounded."""
    s = prof.summary(top=24)  # (with 8, batch run 7 could not tell whether its new copies ran before, below the eighth)
    out = {k: round(s[k], 2) for k in ("kernels_per_step", "kernel_us_per_step", "busy_us_per_step",
                                       "span_us_per_step")}
    out["top_kernels"] = [{"name": t["name"], "per_step": round(t["per_step"], 2),
                           "us_per_step": round(t["us_per_step"], 1)} for t in s["top_kernels"]]
    return out


def kernel_order(prof, width: int = 90) -> dict:
    """A few steps' (or rounds') kernels in launch order, runs of one name collapsed ([name, launches, us]), and where
    the copy kernels sit: for each copy kernel, the kernel launched before it and the next one that is no copy,
    counted (batch run 7's copy_v / copy_s per layer were the profile window's joins: ADR 0009, 'Batch run 8')."""
    ker = sorted((e for e in prof.events if e["cat"] == "kernel"), key=lambda e: e["ts"])
    names = [e["name"][:width] for e in ker]
    runs = []
    for n, e in zip(names, ker):
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
            runs[-1][2] += e["dur"]
        else:
            runs.append([n, 1, e["dur"]])
    sites: dict[str, int] = {}
    short = [kernel_name(e["name"]) for e in ker]  # (CUDA names: void mlx::core::cu::..(args))
    for i, n in enumerate(short):
        if n.startswith("copy"):
            before = short[i - 1] if i else "-"
            after = next((m for m in short[i + 1:] if not m.startswith("copy")), "-")
            key = f"{n[:40]} | before: {before[:60]} | next: {after[:60]}"
            sites[key] = sites.get(key, 0) + 1
    return {"kernels": len(names), "runs": [[n, c, round(d, 1)] for n, c, d in runs],
            "copy_sites": dict(sorted(sites.items(), key=lambda kv: -kv[1]))}


def joined(engine) -> None:
    """Steps `engine` until every added sequence is prefilled and running: a profile of steady steps or rounds. Batch
    runs 5-8 profiled from the second step, whose window held the prefills and joins of the sequences the first step
    had not prefilled (run 8: 8 of 16, with two float copies and two zero fills per joining sequence and GDN
    layer)."""
    while engine.waiting:
        engine.step()
    for _ in range(2):  # (a round right after a join is built op by op; the next one replays its trace)
        engine.step()


def host_split(engine, passes: int) -> dict:
    """Where the host's wall time goes over `passes` steady passes of `engine` (no profiler attached), in ms per
    pass: `build` (Python building the pass's graph or replaying its trace: the engine's _dispatch_pass or _dispatch,
    less what it hands to MLX), `dispatch` (mx.async_eval inside them: MLX walks the graph and launches its kernels,
    on the calling thread), `wait` (rounds only: reading the queued round's tokens, the device still running it) and
    `rest` (the wall time left: the engine's own Python, and for plain steps the wait as well). Both loops queue pass
    t + 1 before reading pass t, so where build + dispatch is near the wall time the host bounds the loop, and where
    the wait is large the device does (batch run 8's round: 6.56 ms of kernel time in about 15.6 ms of wall time)."""
    t = {"build": 0.0, "dispatch": 0.0, "wait": 0.0}
    inside = [False]
    async_eval = mx.async_eval

    def timed_async_eval(*arrays):
        tic = time.perf_counter()
        async_eval(*arrays)
        if inside[0]:
            t["dispatch"] += time.perf_counter() - tic

    name = "_dispatch_pass" if hasattr(engine, "_dispatch_pass") else "_dispatch"
    dispatch = getattr(engine, name)

    def timed_dispatch(*a):
        tic, inside[0] = time.perf_counter(), True
        try:
            return dispatch(*a)
        finally:
            inside[0] = False
            t["build"] += time.perf_counter() - tic

    read = getattr(engine, "_read", None)

    def timed_read(k, n, tokens):
        tic = time.perf_counter()
        mx.eval(n, tokens)
        t["wait"] += time.perf_counter() - tic
        return read(k, n, tokens)

    own = {n: vars(engine)[n] for n in (name, "_read") if n in vars(engine)}  # (the instance's own, if any)
    setattr(engine, name, timed_dispatch)
    if read is not None:
        engine._read = timed_read
    mx.async_eval = timed_async_eval
    try:
        tic = time.perf_counter()
        for _ in range(passes):
            engine.step()
        wall = time.perf_counter() - tic
    finally:
        mx.async_eval = async_eval
        for n in (name, "_read"):  # the class's methods again (no bound method left on the instance)
            vars(engine).pop(n, None)
        vars(engine).update(own)
    t["build"] -= t["dispatch"]
    ms = {k: round(v * 1e3 / passes, 3) for k, v in t.items()}
    ms["wall"] = round(wall * 1e3 / passes, 3)
    ms["rest"] = round(ms["wall"] - ms["build"] - ms["dispatch"] - ms["wait"], 3)
    return {**ms, "passes": passes}


def timeline(engine, prompts: list[list[int]], n: int) -> dict:
    """One whole generation of `engine` over `prompts` (n tokens each), untimed by the legs, pass by pass: where a
    whole generation's time goes besides steady passes (batch run 9: 128 steady plain steps were 0.49 s of a
    0.69-0.95 s generation at 16 streams, 43 steady rounds 0.31 s of 0.73-1.14 s). Each pass is one phase:
    `prefill` (prompts waiting before it: it prefilled chunks, and may have joined sequences), `after_join` (the
    first pass after sequences joined: a fresh batch's first round is built op by op, a later join's pads to the
    rounds' form and replays), `tail` (a sequence has left) and `steady`
    (every other). Returns per phase [passes, ms, tokens], and the whole generation's ms."""
    seqs = [engine.add(ids, max_tokens=n) for ids in prompts]
    phases = {p: [0, 0.0, 0] for p in ("prefill", "after_join", "steady", "tail")}
    joined_last = False
    tic0 = time.perf_counter()
    while engine.busy:
        waiting, left = bool(engine.waiting), any(s.done for s in seqs)
        started = sum(bool(s.tokens) for s in seqs)
        made0 = sum(len(s.tokens) for s in seqs)
        tic = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - tic) * 1e3
        phase = "prefill" if waiting else "after_join" if joined_last else "tail" if left else "steady"
        joined_last = sum(bool(s.tokens) for s in seqs) > started
        rec = phases[phase]
        rec[0], rec[1], rec[2] = rec[0] + 1, rec[1] + ms, rec[2] + sum(len(s.tokens) for s in seqs) - made0
    out = {p: [c, round(ms, 2), t] for p, (c, ms, t) in phases.items()}
    out["total_ms"] = round((time.perf_counter() - tic0) * 1e3, 2)
    return out


def host_top(engine, passes: int, top: int = 12) -> list:
    """The Python functions that take the host's time over `passes` more steady passes of `engine`, under cProfile
    (its own overhead in them; a window apart from host_split's): [function, calls per pass, ms per pass of its own
    time], costliest first. Batch run 9's 16-sequence round spent 2.02 ms a pass outside building, dispatching and
    waiting (`rest`), where the same round on the CPU spends 0.2 ms: which calls hold it on a GPU."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(passes):
        engine.step()
    prof.disable()
    rows = []
    for (file, line, name), (_, calls, tottime, _, _) in pstats.Stats(prof).stats.items():
        where = f"{file.rsplit('/', 1)[-1]}:{line}({name})" if line else name
        rows.append([where, round(calls / passes, 2), round(tottime * 1e3 / passes, 3)])
    return sorted(rows, key=lambda r: -r[2])[:top]


def profile_rounds(kernel_profile, target, prompts: list[list[int]], refs: list[list[int]], rounds: int, args,
                   dequant_rows: int | None = None, fused_rows: int | None = None) -> dict:
    """The same per round of `ours-mtp` (fixed depth): its steps are rounds; tokens per round beside."""
    with settings.override(dequant_rows=None if dequant_rows is None else str(dequant_rows),
                           fused_rows=None if fused_rows is None else str(fused_rows)):
        engine = rounds_engine(args.mtp_target, len(prompts), refs, args.mtp_k, args.oracle_p)
        seqs = [engine.add(p, max_tokens=(3 * rounds + 12) * (args.mtp_k + 1)) for p in prompts]
        joined(engine)
        before = sum(len(s.tokens) for s in seqs)
        with kernel_profile(steps=rounds) as prof:
            for _ in range(rounds):
                engine.step()
        made = sum(len(s.tokens) for s in seqs) - before
        with kernel_profile(steps=3) as one:
            for _ in range(3):
                engine.step()
        host = host_split(engine, rounds)
        top = host_top(engine, rounds)
    return {**summary(prof), "tokens_per_round": round(made / rounds, 2),  # (every row's)
            "one_round": kernel_order(one), "host_ms_per_round": host, "host_top": top}


def profile_steps(kernel_profile, target, prompts: list[list[int]], steps: int, *, traced: bool | None = None,
                  dequant_rows: int | None = None, fused_rows: int | None = None) -> dict:
    with settings.override(trace_steps=traced, dequant_rows=None if dequant_rows is None else str(dequant_rows),
                           fused_rows=None if fused_rows is None else str(fused_rows)):
        engine = BatchDecoder(target.model, max_batch=len(prompts))
        for p in prompts:
            engine.add(p, max_tokens=3 * steps + 24)
        joined(engine)
        with kernel_profile(steps=steps) as prof:
            for _ in range(steps):
                engine.step()
        with kernel_profile(steps=3) as one:
            for _ in range(3):
                engine.step()
        host = host_split(engine, steps)
        top = host_top(engine, steps)
    return {**summary(prof), "one_step": kernel_order(one), "host_ms_per_step": host, "host_top": top}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="0.8b")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", default="1,4,16,64")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--prompt-spread", type=int, default=0, help="prompt lengths spread evenly over +- this many "
                   "tokens around --prompt-tokens (0: all of one length)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp-k", type=int, default=3, help="the ours-mtp leg's depth (0: no MTP leg)")
    p.add_argument("--oracle-p", type=float, default=0.8, help="SYNTHETIC: the ours-mtp leg's draft acceptance")
    p.add_argument("--oracle", choices=("forced", "recorded"), default="forced",
                   help="SYNTHETIC acceptance: drafts kept at --oracle-p whatever the target says (forced), or plain's "
                   "recorded continuation proposed at p (recorded)")
    p.add_argument("--mtp-dtype", default="", help="the MTP legs' model's activations (default: --dtype; float32 on a "
                   "random shape with --oracle recorded)")
    p.add_argument("--untraced", type=int, default=1,
                   help="1: also legs with plain steps and MTP rounds built op by op (LATTICE_TRACE_STEPS=0, "
                   "LATTICE_TRACE_ROUNDS=0), against the traced")
    p.add_argument("--dequant-ab", type=int, default=0, metavar="N",
                   help="add the -dequant legs: LATTICE_DEQUANT_ROWS=N (0: none)")
    p.add_argument("--split-k-ab", type=int, default=0,
                   help="1: also `ours` and `ours-mtp` with LATTICE_SPLIT_K=0 (`-nosplit` legs), paired")
    p.add_argument("--batch-prefill-ab", type=int, default=0,
                   help="1: `ours` and `ours-mtp` with LATTICE_BATCH_PREFILL=0, and as `-bprefill` legs with it on "
                        "(the default), paired")
    p.add_argument("--fused-rows-ab", type=int, default=0, choices=(0, 16),
                   help="16: also `ours` and `ours-mtp` with LATTICE_FUSED_ROWS=16 (`-f16` legs: a batch's steps of up "
                        "to 16 rows in the fused 4-bit kernel), paired")
    p.add_argument("--skip", default="", help="legs left out, comma-separated (e.g. ours-untraced,ours-aa)")
    p.add_argument("--profile", metavar="DIR")
    p.add_argument("--machine-warmup", type=int, default=1,
                   help="1 (on a GPU): first, in a process of its own, every kind of pass of the adaptive MTP leg at "
                   "each B, untimed (MLX's builds for them are then on disk, as on a user's machine after a first run)")
    p.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)  # (the machine warm-up's child)
    p.add_argument("--out", default="batch_throughput.json")
    args = p.parse_args()
    if args.machine_warmup and not args.warm_only and args.mtp_k and "ours-mtp-auto" not in args.skip.split(",") \
            and mx.default_device().type != mx.DeviceType.cpu:
        tic = time.perf_counter()
        rc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--warm-only"]).returncode
        WARMUP.update(machine_warmup_s=round(time.perf_counter() - tic, 1), machine_warmup_rc=rc)
        print(f"machine warm-up: exit {rc} in {WARMUP['machine_warmup_s']:.0f} s", file=sys.stderr, flush=True)
    target = load_target(args.model, bits=args.bits, group_size=args.group_size, dtype=args.dtype or None,
                         seed=args.seed, stock=True)
    if target.stock is None:
        print(f"mlx-lm's model could not be built: {target.stock_note}", file=sys.stderr)
        return 1
    mtp_dtype = args.mtp_dtype or ("float32" if args.model in SHAPES and args.oracle == "recorded" else args.dtype)
    args.mtp_target = target if not args.mtp_k or mtp_dtype == args.dtype else \
        load_target(args.model, bits=args.bits, group_size=args.group_size, dtype=mtp_dtype, seed=args.seed,
                    stock=False)
    if args.warm_only:
        for B in map(int, args.streams.split(",")):
            tic = time.perf_counter()
            n = warm_kinds(args.mtp_target, B, args.oracle_p)
            print(f"warm-up B={B}: {n} passes in {time.perf_counter() - tic:.1f} s", file=sys.stderr, flush=True)
        return 0
    rng = np.random.default_rng(args.seed)
    vocab = target.model.args.vocab_size
    result = {"meta": {**provenance(), "device": device_name(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                       "argv": sys.argv, "model": target.label, "stock": target.stock_note,
                       "mtp_model": args.mtp_target.label, "oracle": args.oracle, **WARMUP}, "streams": {}}
    kernel_profile = load_profiler(args.profile)
    profile_inputs = {}  # B: (its legs, the first repetition's prompts and references)
    for B in map(int, args.streams.split(",")):
        legs = ["ours", "ours-aa", "mlx-lm"] + (["ours-untraced"] if args.untraced else []) + \
            ((["ours-mtp-base"] if args.mtp_target is not target else []) + ["ours-mtp", "ours-mtp-auto"]
             + (["ours-mtp-untraced"] if args.untraced else [])
             if args.mtp_k else []) + \
            (["solo"] if B == 1 else []) + \
            (["ours-dequant"] + (["ours-mtp-dequant"] if args.mtp_k else []) if args.dequant_ab else []) + \
            (["ours-nosplit"] + (["ours-mtp-nosplit"] if args.mtp_k else []) if args.split_k_ab else []) + \
            (["ours-bprefill"] + (["ours-mtp-bprefill"] if args.mtp_k else []) if args.batch_prefill_ab else []) + \
            (["ours-f16"] + (["ours-mtp-f16"] if args.mtp_k else []) if args.fused_rows_ab else [])
        legs = [leg for leg in legs if leg in ("ours", "ours-aa", "mlx-lm") or leg not in args.skip.split(",")]
        # prompt lengths: --prompt-tokens, or spread evenly over +- --prompt-spread around it (unequal lengths: the
        # batched prefill left-pads them into one forward)
        spread = [args.prompt_tokens + round(args.prompt_spread * (2 * i / max(B - 1, 1) - 1)) for i in range(B)]
        reps = [[rng.integers(0, vocab, n).tolist() for n in (rng.permutation(spread) if args.prompt_spread else spread)]
                for _ in range(args.reps)]  # (without a spread, the random draws of the runs before it)
        # plain greedy's continuations: what the SYNTHETIC drafts propose (untimed)
        refs = [[r.tokens for r in batch_generate(args.mtp_target.model, None, prompts, max_tokens=args.tokens + 8,
                                                  max_batch=B)]
                if args.oracle == "recorded" and any(leg.startswith("ours-mtp") for leg in legs)
                else None for prompts in reps]
        for leg in legs:  # untimed: first-use compiles
            run_leg(target, leg, reps[0], args.tokens, refs[0], args)
        secs = {leg: [] for leg in legs}
        for r, prompts in enumerate(reps):
            for leg in bs.abba_order(legs, r):
                secs[leg].append(run_leg(target, leg, prompts, args.tokens, refs[r], args))
            print(f"B={B} rep {r}: " + " ".join(f"{leg} {secs[leg][-1]:.3f}s" for leg in legs), file=sys.stderr,
                  flush=True)
            # every repetition's seconds on disk as they come: a run cut at its step limit keeps what it timed
            result["streams"][B] = {"partial": True, "seconds": secs}
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        tps = {leg: [B * args.tokens / s for s in v] for leg, v in secs.items()}
        out = {"tok_s": {leg: bs.summarize(v) for leg, v in tps.items()},
               # the timed repetitions' (tokens per round, rows that left plain's continuation), per MTP leg
               "mtp_rounds": {leg: ROUNDS.pop(leg)[-args.reps:] for leg in list(ROUNDS)},
               "ratios": {f"{leg}/mlx-lm": bs.summarize([a / b for a, b in zip(tps[leg], tps["mlx-lm"])])
                          for leg in legs if leg != "mlx-lm"},
               "seconds": secs}
        result["streams"][B] = out
        base = "ours-mtp-base" if "ours-mtp-base" in tps else "ours"  # MTP's plain steps: the same model's
        for a, b in (("ours", "ours-untraced"), ("ours-mtp", base), ("ours-mtp-auto", base),
                     ("ours-mtp", "ours-mtp-untraced"), ("ours-mtp-base", "ours"),
                     ("ours-dequant", "ours"), ("ours-mtp-dequant", "ours-mtp"), ("ours", "ours-nosplit"),
                     ("ours-mtp", "ours-mtp-nosplit"), ("ours-bprefill", "ours"), ("ours-mtp-bprefill", "ours-mtp"),
                     ("ours-f16", "ours"), ("ours-mtp-f16", "ours-mtp")):
            if a in tps and b in tps:
                out["ratios"][f"{a}/{b}"] = bs.summarize([x / y for x, y in zip(tps[a], tps[b])])
        print(f"B={B}: ours {out['tok_s']['ours']['median']:.0f} tok/s, mlx-lm {out['tok_s']['mlx-lm']['median']:.0f} "
              f"({out['ratios']['ours/mlx-lm']['median']:.2f}x; A/A {out['ratios']['ours-aa/mlx-lm']['median']:.2f}x)"
              + "".join(f"; {k} {v['median']:.2f}x" for k, v in out["ratios"].items() if "/mlx-lm" not in k)
              + "".join(f"; {leg} {np.median([t for t, _ in v]):.2f} tokens per round"
                        + ("" if refs[0] is None else f", rows off plain's {sum(m for _, m in v)}")
                        for leg, v in out["mtp_rounds"].items()), flush=True)
        # each engine's passes through one more generation (reps[0]'s prompts), by phase
        out["timeline"] = {"ours": timeline(BatchDecoder(target.model, max_batch=B), reps[0], args.tokens)}
        if "ours-mtp" in legs:
            out["timeline"]["ours-mtp"] = timeline(rounds_engine(args.mtp_target, B, refs[0], args.mtp_k,
                                                                 args.oracle_p), reps[0], args.tokens)
        print(f"B={B} timeline: " + "; ".join(f"{leg} " + " ".join(f"{p} {v[0]} passes {v[1]:.0f} ms"
                                                                   for p, v in t.items() if p != "total_ms")
                                              + f" of {t['total_ms']:.0f} ms" for leg, t in out["timeline"].items()),
              flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        profile_inputs[B] = (legs, reps[0], refs[0])
    # every stream count's timings first, then the profiles: batch run 2's profiler crashed the process (a
    # segmentation fault in CUPTI after four streams' timings) and took the 16-stream legs with it
    for B, (legs, prompts, ref) in profile_inputs.items() if kernel_profile is not None else ():
        out = result["streams"][B]
        out["profile_ours"] = profile_steps(kernel_profile, target, prompts, 32)
        if "ours-untraced" in legs:
            out["profile_ours_untraced"] = profile_steps(kernel_profile, target, prompts, 32, traced=False)
        if "ours-dequant" in legs:
            out["profile_ours_dequant"] = profile_steps(kernel_profile, target, prompts, 32,
                                                        dequant_rows=args.dequant_ab)
        if "ours-mtp-base" in legs:
            out["profile_ours_mtp_base"] = profile_steps(kernel_profile, args.mtp_target, prompts, 32)
        if "ours-mtp" in legs:
            out["profile_ours_mtp"] = profile_rounds(kernel_profile, target, prompts, ref, 12, args)
        if "ours-mtp-dequant" in legs:
            out["profile_ours_mtp_dequant"] = profile_rounds(kernel_profile, target, prompts, ref, 12, args,
                                                             dequant_rows=args.dequant_ab)
        if "ours-f16" in legs:
            out["profile_ours_f16"] = profile_steps(kernel_profile, target, prompts, 32, fused_rows=16)
        if "ours-mtp-f16" in legs:
            out["profile_ours_mtp_f16"] = profile_rounds(kernel_profile, target, prompts, ref, 12, args, fused_rows=16)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
