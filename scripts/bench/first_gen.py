"""A user's first generation, each in a fresh process: plain decoding, an A/A plain leg, and the default speculation
(`speculation="auto"` with LATTICE_MTP=1, what turning MTP on by default would give), through the public API only
(`lattice_mlx.load`, `lattice_mlx.stream_generate`). `default@NAME=VALUE;NAME=VALUE` is the default with constants
of speculative/tuning.py changed in its process (an A/B of the tuner; e.g. `default@FIRST_ROUNDS_S=0`). Every
process pays its own first uses (its traces, its kernels' loads, the speculative kernels' one-line build check):
nothing is warmed for it. A repetition is one process per leg, the legs' order alternating (ABBA); each process
loads the model and runs one generation of the repetition's prompt, then a second generation of the next prompt
(what a process that stays, a chat or a server, gets from then on; --gens N: N generations in all). Each generation
also records its first token's wait and its three longest waits between tokens (ms, and the token they came
before), to place a stall. --profile DIR adds, before a temperature's repetitions, one untimed process per leg whose
generations each run whole under CUPTI (DIR/gpu_kernels.py): the GPU's kernel time, busy time and span against the
generation's wall time, which tells a first generation's host-side costs (traces, kernel loads) from GPU work.

Usage: python scripts/bench/first_gen.py [--model demo|DIR] [--temps 0,0.7] [--max-tokens 256] [--reps 10]
         [--gens 2] [--legs plain,plain-aa,default[,default@NAME=VALUE]] [--profile DIR] [--out first_gen.json]
Reported per leg: the generation's wall seconds (prefill included), the second generation's, all generations'
together, the last's, the load's and the whole process's (Python's start to exit, as the driver times it; the child also
records when its own code started, its imports ended and its generations ended, on the driver's clock); ratios are plain's
over the leg's, per repetition, then the median.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LEGS = ("plain", "plain-aa", "default")


def child(args) -> None:
    t0 = float(os.environ.get("FIRST_GEN_T0", time.time()))
    started_s = time.time() - t0  # this function's start (after the interpreter's and the script's own imports)
    import mlx.core as mx

    import lattice_mlx
    from lattice_mlx.bench.run import text_prompts
    from lattice_mlx.speculative import pipelined, tuning

    for item in args.leg.split("@", 1)[1].split(";") if "@" in args.leg else []:
        name, value = item.split("=")
        if not hasattr(tuning, name):
            raise SystemExit(f"first_gen: leg {args.leg}: speculative/tuning.py has no constant {name}")
        for owner in (o for o in (tuning, pipelined) if hasattr(o, name)):  # (pipelined.py imports some by name)
            setattr(owner, name, type(getattr(owner, name))(float(value)))

    imported_s = time.time() - t0
    tic = time.perf_counter()
    model, tokenizer = lattice_mlx.load(args.model if args.model != "demo" else None, dtype=args.dtype or None)
    load_s = time.perf_counter() - tic
    prompts = text_prompts("code")
    out = {"leg": args.leg, "rep": args.rep, "load_s": load_s, "started_s": started_s, "imported_s": imported_s,
           "generations": []}
    profiler = None
    if args.profile:
        from lattice_mlx.bench.run import load_profiler

        profiler = load_profiler(args.profile)
    for i in range(args.gens):
        prompt = prompts[(args.rep + i) % len(prompts)]
        speculation = None if args.leg.startswith("plain") else "auto"
        with profiler(steps=1) if profiler else contextlib.nullcontext() as prof:
            tic = time.perf_counter()
            times, ids, last = [], [], None
            for last in lattice_mlx.stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                                    temp=args.temp, seed=1000 + args.rep, speculation=speculation):
                times.append(time.perf_counter())
                ids.append(last.token)
            wall = time.perf_counter() - tic
        spec = last.speculation or {}
        # where the generation waited longest: before its first token (the prefill), and between tokens
        gaps = sorted(((b - a, j + 1) for j, (a, b) in enumerate(zip(times, times[1:]))), reverse=True)[:3]
        out["generations"].append({"wall_s": wall, "tokens": len(ids), "token_ids": ids,
                                   "prompt_tokens": last.prompt_tokens, "first_token_s": times[0] - tic,
                                   "longest_gaps": [[round(1e3 * g, 2), j] for g, j in gaps],
                                   "speculated": last.speculation is not None,
                                   "acceptance": spec.get("acceptance_rate"), "decisions": spec.get("decisions"),
                                   "tuner_log": spec.get("tuner_log") or []})
        if prof is not None:  # the whole generation as one step: totals, in ms, beside its wall time
            g = prof.summary(top=6)
            n = max(1, len(ids))
            out["generations"][-1]["gpu_profile"] = {
                "kernels": g["kernels_per_step"], "kernel_ms": g["kernel_us_per_step"] / 1e3,
                "busy_ms": g["busy_us_per_step"] / 1e3, "span_ms": g["span_us_per_step"] / 1e3,
                "per_token": {"kernels": g["kernels_per_step"] / n, "kernel_us": g["kernel_us_per_step"] / n,
                              "busy_us": g["busy_us_per_step"] / n, "span_us": g["span_us_per_step"] / n},
                "wall_ms": 1e3 * wall, "top_kernels": [[k["name"][:70], k["per_step"], round(k["us_per_step"] / 1e3, 2)]
                                                       for k in g["top_kernels"]]}
    out["peak_gb"] = mx.get_peak_memory() / 1e9
    out["done_s"] = time.time() - t0  # the rest of process_s is the interpreter's exit
    print("RESULT " + json.dumps(out), flush=True)


def run_process(args, leg: str, rep: int, temp: float, profile: str | None = None) -> dict:
    env = dict(os.environ, LATTICE_MTP="0" if leg.startswith("plain") else "1", FIRST_GEN_T0=repr(time.time()))
    cmd = [sys.executable, __file__, "--child", "--leg", leg, "--rep", str(rep), "--temp", str(temp),
           "--model", args.model, "--max-tokens", str(args.max_tokens), "--dtype", args.dtype, "--gens", str(args.gens)]
    cmd += ["--profile", profile] if profile else []
    tic = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    process_s = time.perf_counter() - tic
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise SystemExit(f"{leg} rep {rep} failed (exit {p.returncode}): {p.stderr.strip()[-400:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    res["process_s"] = process_s
    res["stderr"] = [ln for ln in p.stderr.splitlines() if ln.strip()][-3:]
    return res


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def summarize(runs: list[dict], legs: list[str]) -> dict:
    by = {(r["leg"], r["rep"]): r for r in runs}
    reps = sorted({r["rep"] for r in runs})
    out = {}
    for leg in legs:
        if leg == "plain":
            continue
        pairs = [(by[("plain", i)], by[(leg, i)]) for i in reps if ("plain", i) in by and (leg, i) in by]
        ratio = {
            "first_gen": [a["generations"][0]["wall_s"] / b["generations"][0]["wall_s"] for a, b in pairs],
            "second_gen": [a["generations"][1]["wall_s"] / b["generations"][1]["wall_s"] for a, b in pairs],
            "last_gen": [a["generations"][-1]["wall_s"] / b["generations"][-1]["wall_s"] for a, b in pairs],
            "all_gens": [sum(g["wall_s"] for g in a["generations"]) / sum(g["wall_s"] for g in b["generations"])
                         for a, b in pairs],
            "process": [a["process_s"] / b["process_s"] for a, b in pairs],
        }
        out[leg] = {k: {"median": median(v), "min": min(v), "max": max(v), "n": len(v)} for k, v in ratio.items() if v}
        out[leg]["identical_tokens"] = sum(a["generations"][0]["token_ids"] == b["generations"][0]["token_ids"]
                                           for a, b in pairs)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--dtype", default="bfloat16", help="'': the checkpoint's own")
    p.add_argument("--temps", default="0")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--gens", type=int, default=2, help="generations per process (>= 2), each of the next prompt")
    p.add_argument("--legs", default=",".join(LEGS), help="plain first; default@NAME=VALUE;..: tuner constants changed")
    p.add_argument("--profile", metavar="DIR", help="also one process per leg under CUPTI (DIR/gpu_kernels.py)")
    p.add_argument("--out", default="first_gen.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--leg", help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--temp", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from lattice_mlx.bench.report import device_name, provenance

    legs = args.legs.split(",")
    if args.gens < 2:
        raise SystemExit(f"first_gen: --gens {args.gens}: at least 2 (the first generation and a later one)")
    if legs[0] != "plain" or not all(leg in LEGS or leg.startswith("default@") for leg in legs):
        raise SystemExit(f"first_gen: --legs {args.legs}: plain first, then any of {', '.join(LEGS[1:])} and "
                         "default@NAME=VALUE;..")
    meta = {"device": device_name(), **provenance(), "command": " ".join(sys.argv), "model": args.model,
            "max_tokens": args.max_tokens, "reps": args.reps, "legs": legs}
    groups = []
    for temp in (float(t) for t in args.temps.split(",")):
        tic = time.perf_counter()
        run_process(args, "default", -1, temp)  # untimed: the machine's once-only builds (a user's second run on)
        print(f"temp {temp}: the untimed first process took {time.perf_counter() - tic:.1f} s", flush=True)
        runs = []
        if args.profile:  # before the timed repetitions (so a limit keeps them), each in its own process
            profiled = []
            for leg in legs:
                profiled.append(run_process(args, leg, 0, temp, profile=args.profile))
                print(f"temp {temp}: {leg} under CUPTI: " + "  ".join(
                    f"gen {i}: wall {g['gpu_profile']['wall_ms']:.0f} ms, kernels {g['gpu_profile']['kernel_ms']:.0f} "
                    f"busy {g['gpu_profile']['busy_ms']:.0f} span {g['gpu_profile']['span_ms']:.0f} ms"
                    for i, g in enumerate(profiled[-1]["generations"])), flush=True)
        groups.append({"temp": temp, "runs": runs, "profiled": profiled if args.profile else None})
        Path(args.out).write_text(json.dumps({"meta": meta, "groups": groups}))  # (kept if a limit stops it)
        for rep in range(args.reps):
            order = list(legs) if rep % 2 == 0 else list(reversed(legs))
            for leg in order:
                runs.append(run_process(args, leg, rep, temp))
            print(f"rep {rep}: " + "  ".join(f"{r['leg']} {r['generations'][0]['wall_s']:.3f}/"
                                             f"{r['generations'][1]['wall_s']:.3f} s" for r in runs[-len(legs):]),
                  flush=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "groups": groups}))  # (kept if a limit stops it)
        s = groups[-1]["summary"] = summarize(runs, legs)
        line = "  ".join(f"{leg} first {v['first_gen']['median']:.2f} ({v['first_gen']['min']:.2f}-"
                         f"{v['first_gen']['max']:.2f}) second {v['second_gen']['median']:.2f} "
                         f"last {v['last_gen']['median']:.2f} "
                         f"all {v['all_gens']['median']:.2f} process "
                         f"{v['process']['median']:.2f}" for leg, v in s.items())
        same = " ".join(f"{leg} {v['identical_tokens']}/{args.reps}" for leg, v in s.items())
        print(f"temp {temp}: {line}; greedy identical to plain: {same}" if temp == 0 else f"temp {temp}: {line}",
              flush=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "groups": groups}, indent=1))


if __name__ == "__main__":
    main()
