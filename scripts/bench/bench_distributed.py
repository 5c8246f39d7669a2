"""Decode speed of one random-weight model split over processes (tensor or pipeline parallel) against one process:
plain decoding and MTP at synthetic acceptance, legs interleaved inside each run, with each rank's memory and (with
--profile, rank 0) kernels and collective time per token from CUPTI.

    python scripts/bench/bench_distributed.py --shape 4b --mode single --out OUT            # one process, one GPU
    mlx.launch -n 2 --backend nccl python scripts/bench/bench_distributed.py --shape 4b --mode tensor --out OUT
    mlx.launch -n 2 --backend ring python scripts/bench/bench_distributed.py --shape tiny --mode pipeline --out OUT

Every rank builds the same random weights (one seed) and keeps only its part: the split is applied to the lazy model
before any weight is materialised, so no rank ever holds the whole model (its peak still includes the fp32
temporaries of initialising whole tensors, e.g. the embedding: measure memory through --save / --load instead).
--memory-limit-gb passes a limit to mx.set_memory_limit and records whether the peak stayed under it (MLX does not
treat it as a hard cap). Each rank writes OUT/rank{r}.json; rank 0's holds the timings (the ranks run in lockstep,
so one clock is the run's). Only rank 0 takes the benchmark lock; the others wait for it inside the collectives.
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from lattice_mlx.bench import run as bench
from lattice_mlx.bench.run import DTYPES, SHAPES, Leg, Target, leg_summary, mtp_legs, run_group
from lattice_mlx.bench.synthetic import hub_config, random_model
from lattice_mlx.convert import save_weights
from lattice_mlx.decode import generate_step
from lattice_mlx.load import load_model
from lattice_mlx.models.fuse import fuse_projections
from lattice_mlx.sample import Sampler


def build(shape: str, mode: str, group, *, bits: int, group_size: int, dtype: str, fuse: bool = True,
          mtp: str = "replicated"):
    place = {"single": None, "tensor": lambda m: m.shard(group, mtp=mtp), "pipeline": lambda m: m.pipeline(group)}[mode]
    mx.random.seed(0)  # the same weights on every rank: the same draws in the same order
    return random_model(**SHAPES[shape], bits=bits or None, group_size=group_size, dtype=DTYPES[dtype], place=place,
                        fuse=fuse)


def save(model, shape: str, path: Path, *, bits: int, group_size: int) -> None:
    """The (unfused) random model as a converted checkpoint: what `load(path, group=...)` reads rank by rank. Written
    into a temp folder renamed into place, so a run stopped mid-save leaves no checkpoint that looks whole."""
    config = hub_config(**SHAPES[shape])
    if bits:
        config["quantization"] = {"group_size": group_size, "bits": bits}
    if path.exists():
        shutil.rmtree(path)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_weights(tmp, dict(tree_flatten(model.parameters())))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(path)


def lockstep_profile(profiler, target: Target, leg: Leg, ids: list[int], *, n: int, reference, seed: int, rank: int):
    """Rank 0 profiles one generation; the other ranks run the same generation unprofiled (every forward is a
    collective, so all ranks must make the same calls)."""
    if rank == 0:
        return bench.profile_leg(profiler, target, leg, ids, 0.0, n=n, reference=reference, seed=seed)
    stream, _ = bench.token_stream(target, leg, ids, 0.0, n_max=n + 8, reference=reference, seed=seed)
    try:
        next(stream)
        for _ in zip(range(n), stream):
            pass
    finally:
        stream.close()
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True, choices=list(SHAPES))
    p.add_argument("--mode", required=True, choices=["single", "tensor", "pipeline"])
    p.add_argument("--out", required=True)
    # not --backend: mlx.launch takes a --backend of its own wherever it appears on its command line
    p.add_argument("--dist-backend", default="any", help="mx.distributed.init backend (any, ring, nccl, mpi, jaccl)")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--lengths", default="16,64")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--k", default="2")
    p.add_argument("--oracle-p", type=float, default=0.8)
    p.add_argument("--memory-limit-gb", type=float, default=None, help="mx.set_memory_limit for this process")
    p.add_argument("--profile", default=None, help="folder holding gpu_kernels.py (CUPTI, rank 0)")
    p.add_argument("--save", default=None, help="--mode single: also write the model as a checkpoint here")
    p.add_argument("--load", default=None, help="read the model from this checkpoint (load_model with this "
                   "process's group: a rank reads only its part) instead of building it")
    p.add_argument("--mtp", default="replicated", choices=["replicated", "sharded"],
                   help="--mode tensor: the MTP head replicated on every rank or its layer split like the trunk's")
    p.add_argument("--lock", default=bench.DEFAULT_LOCK, help="the benchmark lock file (rank 0 takes it)")
    p.add_argument("--build-only", action="store_true", help="stop after building/loading (memory only)")
    args = p.parse_args(argv)

    if args.profile and not (Path(args.profile) / "gpu_kernels.py").exists():  # on every rank, before any work
        print(f"--profile {args.profile}: no gpu_kernels.py there", file=sys.stderr)
        return 2
    if args.save and args.mode != "single":
        print("--save: with --mode single only", file=sys.stderr)
        return 2
    group = mx.distributed.init(backend=args.dist_backend)
    rank, size = group.rank(), group.size()
    if args.mode != "single" and size < 2:
        print(f"--mode {args.mode} needs several processes: launch with mlx.launch -n N", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"shape": args.shape, "mode": args.mode, "mtp": args.mtp, "rank": rank, "size": size,
           "backend": args.dist_backend,
           "device": str(mx.default_device()), "bits": args.bits, "dtype": args.dtype}
    if args.memory_limit_gb:
        mx.set_memory_limit(int(args.memory_limit_gb * 2**30))
        res["memory_limit_gb"] = args.memory_limit_gb
    mx.reset_peak_memory()
    tic = time.perf_counter()
    if args.load:
        model, _ = load_model(Path(args.load), dtype=args.dtype, group=None if args.mode == "single" else group,
                              pipeline=args.mode == "pipeline", mtp=args.mtp)
        res["loaded_from"] = args.load
    else:
        model = build(args.shape, args.mode, group, bits=args.bits, group_size=args.group_size, dtype=args.dtype,
                      fuse=not args.save, mtp=args.mtp)
        if args.save:
            save(model, args.shape, Path(args.save), bits=args.bits, group_size=args.group_size)
            fuse_projections(model)
    res["build_s"] = round(time.perf_counter() - tic, 1)
    res["held_gb"] = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 2**30
    res["build_peak_gb"] = mx.get_peak_memory() / 2**30
    if args.memory_limit_gb:
        res["build_peak_within_limit"] = res["build_peak_gb"] <= args.memory_limit_gb
    bench.log(f"rank {rank}/{size}: {args.shape} {args.mode} built in {res['build_s']} s, holds "
              f"{res['held_gb']:.2f} GiB, peak {res['build_peak_gb']:.2f} GiB")

    if args.build_only:
        (out / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
        return 0
    target = Target(f"random {args.shape} Q{args.bits} {args.dtype} {args.mode} x{size}", model, {}, None,
                    synthetic=True)
    prompts = bench.workload_prompts(target, "random", 5, tokens=args.prompt_tokens, seed=0)
    legs = [Leg("plain"), Leg("plain-aa")] + mtp_legs(["batched"], args.k.split(","), p=args.oracle_p)
    lengths = tuple(bench.parse_ints(args.lengths))
    # rank 0 alone takes the machine's benchmark lock (the one single-process benches take too); the other ranks
    # wait for it inside the collectives. A lock per rank could cross with another run's and deadlock both.
    lock = {"path": args.lock if rank == 0 else None, "timeout": 1800.0, "waited_s": 0.0}
    mx.reset_peak_memory()
    records = run_group(target, legs, prompts, temp=0.0, reps=args.reps, lengths=lengths, lock=lock, seed=0,
                        label=f"{args.shape} {args.mode} x{size}")
    res["decode_peak_gb"] = mx.get_peak_memory() / 2**30
    res["legs"] = [leg_summary(r, records, target) for r in records.values()]
    for leg in res["legs"]:
        leg.pop("runs", None)
    path = out / f"rank{rank}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    if args.profile:  # after the timings are safe on disk
        profiler = bench.load_profiler(args.profile) if rank == 0 else None
        by_leg, greedy = {}, None
        for leg in legs:
            if leg.name == "plain-aa":
                continue
            if leg.p is not None and greedy is None:  # the oracle legs' recorded continuation, once for all of them
                stream = generate_step(model, mx.array(prompts[0]), sampler=Sampler())
                greedy = [t for t, _ in zip(stream, range(lengths[1] + 24))]
            ref = greedy if leg.p is not None else None
            by_leg[leg.name] = lockstep_profile(profiler, target, leg, prompts[0], n=lengths[1], reference=ref,
                                                seed=0, rank=rank)
        if rank == 0:
            for leg in res["legs"]:
                if by_leg.get(leg["leg"]):
                    leg["gpu_profile"] = by_leg[leg["leg"]]
            path.write_text(json.dumps(res, indent=1, default=str))
    if rank == 0:
        for leg in res["legs"]:
            vs = leg.get("vs_plain", {}).get("median")
            print(f"{args.shape} {args.mode} x{size} {leg['leg']:<22} {leg['tok_s']['median']:8.1f} tok/s"
                  + (f"  x plain {vs:.2f}" if vs else "") + (f"  alpha {leg['alpha']:.2f}" if "alpha" in leg else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
