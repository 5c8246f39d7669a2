"""What the default speculation gets, whole generations: plain decoding, an A/A plain leg, the default
(`SpecOptions()`, what speculation="auto" resolves to where it applies) and fixed K = 1..4, on one model, in one
fresh process per group of legs (a group: one draft source, temperature and length), >= 10 paired repetitions with
the legs interleaved (ABBA), every leg's first generation in this process inside the timed repetitions.

Usage: python scripts/bench/spec_default.py --model 0.8b|demo|DIR [--drafts oracle:0.8,head] [--temps 0,0.7]
         [--lengths 256,1024] [--legs plain,plain-aa,default,k1,k2,k3,k4] [--reps 10] [--out FILE.json]
A driver: it runs each group in a subprocess of its own (`--group`) and writes one JSON with them all. A leg
`default@NAME=VALUE;NAME=VALUE` is the default with the pipelined tuner's constants changed (`tuned`): an A/B of a
tuner change paired with the default in one process.

Draft sources: `oracle:P` (SYNTHETIC, greedy only: the head's drafts are computed, then replaced by plain greedy's
token with probability P per position: bench/oracles.DeviceOracle), `head` (the checkpoint's own MTP head; on a
random shape its drafts are ~never accepted). Timing: wall seconds from the call to the last of N tokens, prefill
included (a prompt of --prompt-tokens random ids on random shapes, the bench's code prompts on the demo, or
--long-prompt N tokens of this repository's source). Only plain decoding's step trace and the prefill shapes are
warmed before the first timed repetition (one plain generation): every other first-use cost of a process (the
rounds' traces, the head's shapes, the tuner starting without memory) lands in the first repetition, reported apart
as well. On a GPU the driver first runs a group per draft source kind, temperature and length once, untimed, in a
process of its own (--machine-warmup): what MLX builds once per machine and keeps on disk is then built, as on a
user's machine after its first run; the time that took is in the JSON's meta (machine_warmup_s).
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from lattice_mlx import SpecOptions, SpecStats, speculate
from lattice_mlx.bench import stats as bs
from lattice_mlx.bench.oracles import DeviceOracle
from lattice_mlx.bench.report import device_name, provenance
from lattice_mlx.bench.run import load_profiler, load_target, profile_stream, text_prompts, workload_prompts
from lattice_mlx.decode import generate_step
from lattice_mlx.metal import _dialect, cuda_cache, q4_matmul
from lattice_mlx.runtime import runtime_of
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import auto_applies, pipelined, tuning
from lattice_mlx.speculative.options import ADAPTIVE_MAX_K
from lattice_mlx.speculative.pipelined import warm_rounds
from lattice_mlx.speculative.tuning import fresh_memory

ROOT = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def leg_options(leg: str) -> SpecOptions | None:
    if leg in ("plain", "plain-aa"):
        return None
    if leg in ("default", "mtp") or leg.startswith("default@"):  # `mtp`: --mtp on a backend where auto stays plain
        return SpecOptions()
    return SpecOptions(draft_tokens=int(leg[1:]), adaptive=False)


def leg_stream(model, leg: str, ids: list[int], temp: float, drafts: str, reference: list[int] | None, seed: int,
               n: int):
    """(the leg's token stream of up to n tokens, its SpecStats or None)."""
    sampler = Sampler(temp=temp)
    mx.random.seed(seed)
    options = leg_options(leg)
    if options is None:
        return generate_step(model, mx.array(ids), sampler=sampler), None
    stats = SpecStats.of(options)
    drafter = None
    if drafts.startswith("oracle:"):
        drafter = DeviceOracle(reference, float(drafts.split(":")[1]), model.args.vocab_size,
                               options.draft_tokens, seed=seed)
    return speculate(model, mx.array(ids), sampler=sampler, options=options, stats=stats, drafter=drafter,
                     max_tokens=n), stats


@contextlib.contextmanager
def tuned(model, leg: str):
    """`default@NAME=VALUE;NAME=VALUE..`: the default with the pipelined tuner's constants NAME (a module constant of
    speculative/tuning.py, also where speculative/pipelined.py imported it, or a PipelinedTuner class attribute) set
    to VALUE while its generations run, and a tuner memory of its own (a key per leg in the model's tuner memories):
    an A/B of tuner changes inside one process, paired by repetition with the default and the fixed depths, on one
    host's spell. Other legs: nothing changes."""
    if "@" not in leg:
        yield
        return
    saved = []
    try:
        for item in leg.split("@", 1)[1].split(";"):
            name, value = item.split("=")
            owners = [o for o in (tuning, pipelined) if hasattr(o, name)] or \
                ([tuning.PipelinedTuner] if hasattr(tuning.PipelinedTuner, name) else [])
            if not owners:
                raise SystemExit(f"spec_default: leg {leg}: the tuner has no constant {name}")
            for owner in owners:
                old = getattr(owner, name)
                saved.append((owner, name, old))
                setattr(owner, name, type(old)(float(value)) if isinstance(old, int) else type(old)(value))
        memories = runtime_of(model).tuner
        saved.append((pipelined, "tuner_memory", pipelined.tuner_memory))
        pipelined.tuner_memory = lambda _model, greedy: memories.setdefault((leg, bool(greedy)), fresh_memory())
        yield
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)


@contextlib.contextmanager
def passes_seen():
    """Every pass the pipelined tuner observes while it is open (PipelinedTuner.observe: a round's or a plain step's
    seconds, each plain stretch's first and last ones), as (K, seconds) in the list it yields: what the default's
    tuner read per depth, to set beside the fixed legs' cost per round (run Z's default read K=2 at 2.9-3.25 ms where
    the fixed K=2 leg ran 2.29 ms per round; docs/adr/0008, 'Run Z')."""
    seen: list[tuple[int, float]] = []
    observe = tuning.PipelinedTuner.observe

    def recording(self, k: int, seconds: float) -> None:
        seen.append((k, seconds))
        observe(self, k, seconds)

    tuning.PipelinedTuner.observe = recording
    try:
        yield seen
    finally:
        tuning.PipelinedTuner.observe = observe


def pass_summary(seen: list[tuple[int, float]]) -> dict:
    """Per depth: [passes observed, their median ms, the median ms of those after the first 2 at it in a row]."""
    out, run, prev = {}, 0, None
    by: dict[int, list[float]] = {}
    steady: dict[int, list[float]] = {}
    for k, s in seen:
        run = run + 1 if k == prev else 0
        prev = k
        by.setdefault(k, []).append(s)
        if run >= 2:
            steady.setdefault(k, []).append(s)
    for k, xs in sorted(by.items()):
        st = steady.get(k)
        out[str(k)] = [len(xs), round(1e3 * float(np.median(xs)), 3), round(1e3 * float(np.median(st)), 3)
                       if st else None]
    return out


STALL_S = 0.005  # a wait between two tokens longer than this is a stall (a plain step or a round is ~1-2 ms on a
# GPU; run I's default logged 7-22 ms waits in its plain stretches, where plain's leg logged nothing to compare)


def run_leg(model, leg: str, ids: list[int], n: int, temp: float, drafts: str, reference: list[int] | None,
            seed: int) -> tuple[float, float, dict | None, list[int]]:
    """One whole generation of n tokens: (wall seconds, seconds after the first token, stats, tokens). Its waits
    between tokens past STALL_S after the first: run_leg.stalls (seconds each)."""
    with tuned(model, leg), passes_seen() as seen:
        tic = time.perf_counter()
        stream, stats = leg_stream(model, leg, ids, temp, drafts, reference, seed, n)
        tokens, first, last, stalls = [], None, None, []
        for t in stream:
            now = time.perf_counter()
            tokens.append(t)
            if first is None:
                first = now
            elif now - last > STALL_S:
                stalls.append(now - last)
            last = now
            if len(tokens) == n:
                break
        end = time.perf_counter()
    run_leg.stalls, run_leg.passes = stalls, pass_summary(seen)
    return end - tic, end - first, (stats.to_dict() if stats is not None else None), tokens


def profile_leg(kernel_profile, model, leg: str, ids: list[int], n: int, temp: float, drafts: str,
                reference: list[int] | None, seed: int) -> dict:
    """GPU kernels per generated token over n tokens after the first (one untimed generation of its own, CUPTI:
    bench.run.profile_stream), and the acceptance where the leg speculates."""
    with tuned(model, leg):
        stream, stats = leg_stream(model, leg, ids, temp, drafts, reference, seed, n + 1)
        out = profile_stream(kernel_profile, stream, stats, n)
    if stats is not None:
        out["acceptance"] = stats.to_dict()["acceptance_rate"]
    return out


def prompts_for(target, args) -> list[list[int]]:
    if args.long_prompt:
        text = "\n".join(p.read_text() for p in sorted((ROOT / "src" / "lattice_mlx").rglob("*.py")))
        ids = list(target.tokenizer.encode(text))
        step = max(1, (len(ids) - args.long_prompt) // max(1, args.reps))
        return [ids[i * step : i * step + args.long_prompt] for i in range(args.reps)]
    if target.tokenizer is None:
        return workload_prompts(target, "random", args.reps, tokens=args.prompt_tokens, seed=args.seed)
    texts = text_prompts("code")
    return [list(target.tokenizer.encode(texts[i % len(texts)])) for i in range(args.reps)]


def run_group(args) -> dict:
    drafts, temp, n = args.group.split("|")
    temp, n = float(temp), int(n)
    q4_matmul.CAPACITY = args.capacity
    target = load_target(args.model, bits=args.bits, group_size=args.group_size, dtype=args.dtype or None,
                         seed=args.seed, stock=False)
    model, legs = target.model, args.legs.split(",")
    prompts = prompts_for(target, args)
    t0 = time.perf_counter()
    refs = [None] * len(prompts)
    if drafts.startswith("oracle:"):  # plain greedy's continuation of every prompt (also warms plain decoding)
        refs = [run_leg(model, "plain", ids, n + 8, 0.0, drafts, None, 0)[3] for ids in prompts]
    else:
        run_leg(model, "plain", prompts[0], n, temp, drafts, None, 0)
    warm_s = time.perf_counter() - t0

    def warm_oracle_rounds():  # every kind of pass with the oracle's drafts in it (greedy only, as the oracle is)
        warm_rounds(model, ADAPTIVE_MAX_K, (Sampler(),),
                    DeviceOracle(refs[0], float(drafts.split(":")[1]), model.args.vocab_size, ADAPTIVE_MAX_K))

    rounds_s = None
    if args.warm_rounds and not args.warm_only:  # the process's own first uses of the rounds too, before any timing
        tic = time.perf_counter()
        if drafts.startswith("oracle:"):
            warm_oracle_rounds()
        else:
            warm_rounds(model, ADAPTIVE_MAX_K)
        rounds_s = time.perf_counter() - tic
        log(f"{args.group}: every kind of pass warmed in {rounds_s:.2f} s (--warm-rounds)")
    if args.warm_only:  # the machine's warm-up (the driver's): every prompt's prefill, every leg once, nothing timed
        for ids in prompts:
            run_leg(model, "plain", ids, 2, temp, drafts, None, 0)
        for leg in legs:
            run_leg(model, leg, prompts[0], n, temp, drafts, refs[0], 999)
        if drafts.startswith("oracle:"):  # every kind of pass again with the oracle's own work in it (the loads'
            # once-per-machine builds ran them with the head's drafts): in run Q a generation's first round at K=1 with
            # oracle drafts built kernels for 1.9 s inside a timed repetition (docs/adr/0008, 'Runs P, Q and R')
            warm_oracle_rounds()
        return {"group": args.group, "warm_only": True}
    records = {leg: {"wall_s": [], "decode_s": [], "acceptance": [], "decisions": [], "rounds": [],
                     "kernel_builds": [], "kernel_build_s": [], "stalls_ms": [], "tuner_passes": []} for leg in legs}
    builds0 = _dialect.first_uses()
    log(f"{args.group}: kernel variants built while warming: {builds0['variants']} in {builds0['seconds']:.1f} s")
    identical = True
    log(f"{args.group}: loaded and warmed in {time.perf_counter() - t0:.1f} s")
    for rep in range(args.reps):
        tic = time.perf_counter()
        outputs = {}
        for leg in bs.abba_order(legs, rep):
            b0 = _dialect.first_uses()
            wall, decode, st, tokens = run_leg(model, leg, prompts[rep], n, temp, drafts, refs[rep], 1000 + rep)
            b1 = _dialect.first_uses()
            r = records[leg]
            r["kernel_builds"].append(b1["variants"] - b0["variants"])
            r["kernel_build_s"].append(round(b1["seconds"] - b0["seconds"], 3))
            r["wall_s"].append(wall)
            r["decode_s"].append(decode)
            r["stalls_ms"].append([round(1e3 * x, 1) for x in run_leg.stalls])
            r["tuner_passes"].append(run_leg.passes or None)  # (legs without a tuner: None)
            r["acceptance"].append(st["acceptance_rate"] if st else None)
            r["rounds"].append(st["rounds"] if st else None)
            r["decisions"].append((st["decisions"] + st["tuner_log"])[:12] if st else None)
            outputs[leg] = tokens
            if rep == 0:  # (the first generations: a call cut inside them still logs where its time went)
                log(f"{args.group}: first generation of {leg}: {wall:.1f} s")
        if temp == 0:
            identical &= all(t == outputs[legs[0]] for t in outputs.values())
        log(f"{args.group}: rep {rep} in {time.perf_counter() - tic:.1f} s: " + " ".join(
            f"{leg} {records[leg]['wall_s'][-1]:.3f}" + (f" (built {records[leg]['kernel_builds'][-1]} variants in "
                                                         f"{records[leg]['kernel_build_s'][-1]:.1f} s)"
                                                         if records[leg]['kernel_builds'][-1] else "") for leg in legs))
    profiles = {}
    if args.profile:
        kernel_profile = load_profiler(args.profile)
        for leg in legs:
            if leg != "plain-aa":
                profiles[leg] = profile_leg(kernel_profile, model, leg, prompts[0], n, temp, drafts, refs[0], 7)
                log(f"{args.group}: profile {leg}: {profiles[leg]}")
    out = {"group": args.group, "drafts": drafts, "temp": temp, "max_tokens": n, "reps": args.reps,
           "capacity": args.capacity, "gpu_profile": profiles or None, "kernel_builds_warming": builds0,
           "kernel_cache": {"on": cuda_cache.enabled(), **cuda_cache.built()},
           "prompt_tokens": [len(p) for p in prompts], "warm_s": warm_s, "warm_rounds_s": rounds_s,
           "greedy_identical": identical if temp == 0 else None, "legs": records, "auto_applies": auto_applies(model),
           "model": target.label}
    out["ratios"] = {}  # tok/s of the leg / plain's = plain's seconds / the leg's, paired by repetition
    for leg in legs:
        for what in ("wall_s", "decode_s"):
            ratios = [p / x for p, x in zip(records["plain"][what], records[leg][what])]
            out["ratios"][f"{leg}/{what}"] = {**bs.summarize(ratios), "first": ratios[0],
                                              "after_first": bs.summarize(ratios[1:])}
        times = records[leg]["wall_s"][1:]
        med = float(np.median(times)) if times else 0.0
        out["ratios"][f"{leg}/slow_reps"] = [i + 1 for i, t in enumerate(times) if med and t > 2 * med]
        after = [x for rep in records[leg]["stalls_ms"][1:] for x in rep]  # (after the first repetition)
        out["ratios"][f"{leg}/stalls_after_first"] = {"count": len(after), "ms": round(sum(after), 1),
                                                       "max_ms": max(after, default=0.0)}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="0.8b")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", help="'' : the checkpoint's own (what load() gives)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafts", default="oracle:0.8")
    p.add_argument("--temps", default="0")
    p.add_argument("--lengths", default="256")
    p.add_argument("--legs", default="plain,plain-aa,default,k1,k2,k3,k4")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--long-prompt", type=int, default=0, help="prompts of this many tokens of the repository's source")
    p.add_argument("--profile", metavar="DIR", help="also profile each leg's GPU kernels per token (CUPTI: DIR/gpu_kernels.py)")
    p.add_argument("--capacity", default=q4_matmul.CAPACITY, choices=q4_matmul.CAPACITIES,
                   help="the rows a 4-bit / dense matmul variant holds (lattice_mlx.metal.q4_matmul.CAPACITY)")
    p.add_argument("--machine-warmup", type=int, default=1,
                   help="1 (on a GPU): before the groups, an untimed process per kind of group prefills every prompt "
                   "and runs each leg once, so kernels MLX builds once per machine (kept on disk) are built before "
                   "the timed processes")
    p.add_argument("--warm-rounds", type=int, default=0,
                   help="1: also run every kind of pass of the rounds (pipelined.warm_rounds) before the first timed "
                        "repetition, timed apart (warm_rounds_s): which of the default's losses are the process's "
                        "first uses")
    p.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)  # (the machine warm-up's child)
    p.add_argument("--group", help=argparse.SUPPRESS)  # one group, in this process (the driver's child)
    p.add_argument("--out", default="spec_default.json")
    args = p.parse_args()
    if args.group:
        print(json.dumps(run_group(args)))
        return 0
    groups = [f"{d}|{t}|{n}" for d in args.drafts.split(",") for t in args.temps.split(",")
              for n in args.lengths.split(",") if not (d.startswith("oracle") and float(t) > 0)]
    result = {"meta": {**provenance(), "device": device_name(), "mlx": mx.__version__, "argv": sys.argv,
                       "lattice_env": {k: v for k, v in os.environ.items() if k.startswith("LATTICE_")}},
              "groups": []}
    if args.machine_warmup and mx.default_device().type != mx.DeviceType.cpu:
        # A user's second run finds MLX's builds for a shape on disk (its PTX cache); a fresh machine builds them in
        # whatever first runs the shape: the 4-bit matmul of a prompt's row tile took 74-78 s on an H100, inside a
        # timed repetition (docs/results/code_measurements.md, 'First use of a prompt length'). Each group's own
        # process still starts cold: its first uses stay in its first repetition.
        t, warmed = time.perf_counter(), set()
        for g in groups:  # one per kind of draft source, temperature and length (an oracle's p builds nothing new)
            kind = (g.split(":")[0].split("|")[0], *g.split("|")[1:])
            if kind in warmed:
                continue
            warmed.add(kind)
            cmd = [sys.executable, __file__, *sys.argv[1:], "--warm-only", "--group", g]
            tic = time.perf_counter()
            rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
            log(f"machine warm-up, {g}: exit {rc} in {time.perf_counter() - tic:.0f} s")  # (a cut call's log says where
            # its time went: run U's did not)
        result["meta"]["machine_warmup_s"] = time.perf_counter() - t
    for g in groups:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--group", g]
        t = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # (its progress on our stderr)
        if proc.returncode:
            log(f"group {g} failed (exit {proc.returncode})")
            result["groups"].append({"group": g, "error": proc.returncode})
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res["process_s"] = time.perf_counter() - t
        result["groups"].append(res)
        rat = res["ratios"]
        print(f"{g}: " + "  ".join(f"{leg} {rat[f'{leg}/wall_s']['median']:.2f} "
                                   f"(first {rat[f'{leg}/wall_s']['first']:.2f})" for leg in args.legs.split(",")[1:])
              + f"  [{res['process_s']:.0f} s]; waits over {STALL_S * 1e3:.0f} ms after the first repetition: "
              + ", ".join(f"{leg} {rat[f'{leg}/stalls_after_first']['count']}" for leg in args.legs.split(",")),
              flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
