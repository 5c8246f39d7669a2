"""Two first-use costs, measured where they happen (a GPU; each case in a fresh process of its own):

- `prefill`: a prompt length's first prefill against its second, for several new lengths in one process, with prompt
  rows' attention written out in ops (LATTICE_CUDNN_SDPA=0, the default) and given to MLX's fused SDPA (=1, cuDNN on
  CUDA); the files MLX adds to its PTX cache meanwhile are counted (a build kept on disk) — a cost with no new file is
  one that every process pays again.
- `switch`: the pipelined loop's passes around a switch from plain steps to rounds and back (speculative/pipelined.py
  driven directly, greedy): per pass, the host's time to build it and the wait for its result, three cycles, so the
  first cycle's compiles stand apart from the steady cost of a switch.
- `depths`: each depth's first traced round after plain steps (K = 1..4, then K = 1..4 again), split into the host's
  build (Python and `mx.compile`'s trace of the round), the wait (MLX's kernel builds and the GPU), the custom-kernel
  variants first launched (`_dialect.first_uses`) and the files MLX adds to its PTX cache; in two fresh processes one
  after the other, so what the disk caches remove shows in the second.

    python scripts/bench/first_use.py --out DIR [--model demo] [--switch-model 0.8b] [--lengths 40,200,250,290,317,600]
        [--cases prefill,switch,depths]
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def ptx_files() -> set[str]:
    folder = os.environ.get("MLX_PTX_CACHE_DIR") or str(Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx")
    return {p.name for p in Path(folder).glob("*")} if Path(folder).is_dir() else set()


def prefill_case(model_name: str, lengths: list[int]) -> dict:
    from lattice_mlx.bench.run import load_target
    from lattice_mlx.decode import prefill

    model = load_target(model_name, bits=4, group_size=64, dtype="bfloat16", seed=0, stock=False).model
    V, rows = model.args.vocab_size, []
    for T in [16, *lengths]:  # 16: the process's first forward of several rows, apart from the new lengths
        for attempt in ("first", "second"):
            ids = mx.array([(31 * i + 7 + (attempt == "second")) % V for i in range(T)])
            before = ptx_files()
            tic = time.perf_counter()
            logits, _ = prefill(model, ids, model.make_cache())
            mx.eval(logits)
            rows.append({"T": T, "use": attempt, "s": time.perf_counter() - tic,
                         "new_ptx_files": sorted(ptx_files() - before)[:20]})
            print(f"T={T} {attempt}: {rows[-1]['s']:.3f} s, {len(rows[-1]['new_ptx_files'])} new PTX files", flush=True)
    return {"rows": rows}


def switch_case(model_name: str, k: int = 3, cycles: int = 3) -> dict:
    from lattice_mlx.bench.run import load_target
    from lattice_mlx.decode import resume
    from lattice_mlx.sample import Sampler
    from lattice_mlx.speculative.pipelined import PipelinedRounds

    model = load_target(model_name, bits=4, group_size=64, dtype="bfloat16", seed=0, stock=False).model
    ids = mx.array([(7 * i + 3) % model.args.vocab_size for i in range(128)])
    sampler = Sampler()
    cache, _, logits, hidden, _ = resume(model, ids, None, return_hidden=True)
    first = sampler(logits).item()
    rounds = PipelinedRounds(model, sampler, k, ids.tolist(), first, hidden, cache)
    passes, verified = [], 0
    plan = []
    for c in range(cycles):
        plan += [(c, 0)] * 24 + [(c, k)] * 8 + [(c, k - 1)] * 6 + [(c, k)] * 6
    for r, (c, d) in enumerate(plan):
        rounds.bounds(r, verified)
        tic = time.perf_counter()
        out = rounds.round(r, d)
        mid = time.perf_counter()
        mx.eval(*out[:1]) if not d else mx.eval(out[0], out[1])
        n = out[1].item() if d else 0
        verified += n + 1
        passes.append({"cycle": c, "k": d, "build_ms": 1e3 * (mid - tic), "wait_ms": 1e3 * (time.perf_counter() - mid)})
    for p in passes[-44:]:
        print(f"cycle {p['cycle']} K={p['k']}: build {p['build_ms']:.2f} ms, wait {p['wait_ms']:.2f} ms")
    return {"k": k, "passes": passes}


@contextlib.contextmanager
def api_calls(into: dict):
    """CUPTI through torch's profiler around a block: the CUDA runtime and driver calls made in it (MLX's included)
    by total time, and its kernels. Kineto's start and stop are outside what the block times."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()  # (as gpu_kernels.py: CUPTI through a CUDA context torch has set up)
    torch.zeros(1, device="cuda")
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
        mx.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text()).get("traceEvents", [])
    by: dict[str, list] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            c = by.setdefault(e["name"], [0, 0.0])
            c[0], c[1] = c[0] + 1, c[1] + e["dur"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:12]
    into.update(api_ms=round(sum(d for _, d in by.values()) / 1e3, 3),
                api_top={n: [c, round(d / 1e3, 3)] for n, (c, d) in top},
                kernels=len(kernels), kernel_ms=round(sum(e["dur"] for e in kernels) / 1e3, 3))


def depths_case(model_name: str, depths: tuple[int, ...] = (1, 2, 3, 4), profile: bool = False) -> dict:
    from lattice_mlx.bench.run import load_target
    from lattice_mlx.decode import resume
    from lattice_mlx.metal import _dialect
    from lattice_mlx.sample import Sampler
    from lattice_mlx.speculative.pipelined import PipelinedRounds

    tic = time.perf_counter()
    model = load_target(model_name, bits=4, group_size=64, dtype="bfloat16", seed=0, stock=False).model
    load_s = time.perf_counter() - tic
    ids = mx.array([(7 * i + 3) % model.args.vocab_size for i in range(128)])
    sampler = Sampler()
    cache, _, logits, hidden, _ = resume(model, ids, None, return_hidden=True)
    first = sampler(logits).item()
    rounds = PipelinedRounds(model, sampler, max(depths), ids.tolist(), first, hidden, cache)
    passes, verified, r = [], 0, 0
    for sweep in range(2):
        for k in depths:
            for d in [0] * 8 + [k] * 4:  # plain steps, then rounds at K: a probe's shape
                rounds.bounds(r, verified)
                b0, files0 = _dialect.first_uses(), ptx_files()
                # profiled: a depth's first two rounds after plain steps, and the plain step before them
                calls: dict = {}
                watched = profile and (d or r % 12 == 7) and r % 12 <= 9
                with api_calls(calls) if watched else contextlib.nullcontext():
                    tic = time.perf_counter()
                    out = rounds.round(r, d)
                    mid = time.perf_counter()
                    mx.eval(out[0], out[1]) if d else mx.eval(out[0])
                    n = out[1].item() if d else 0
                    wait = time.perf_counter() - mid
                b1 = _dialect.first_uses()
                verified, r = verified + n + 1, r + 1
                passes.append({"sweep": sweep, "k": d, "build_ms": 1e3 * (mid - tic), "wait_ms": 1e3 * wait,
                               "kernel_builds": b1["variants"] - b0["variants"],
                               "kernel_build_s": b1["seconds"] - b0["seconds"],
                               "new_ptx_files": len(ptx_files() - files0), **calls})
    firsts = [p for i, p in enumerate(passes) if p["k"] and (i == 0 or passes[i - 1]["k"] != p["k"])]
    for p in firsts:
        print(f"sweep {p['sweep']} K={p['k']} first round: build {p['build_ms']:.1f} ms, wait {p['wait_ms']:.1f} ms, "
              f"{p['kernel_builds']} kernel variants ({p['kernel_build_s']:.2f} s), {p['new_ptx_files']} new PTX files")
    for p in (p for p in passes if "api_top" in p):
        print(f"sweep {p['sweep']} K={p['k']} profiled: wait {p['wait_ms']:.1f} ms, CUDA calls {p['api_ms']:.1f} ms, "
              f"{p['kernels']} kernels {p['kernel_ms']:.2f} ms; top: "
              + ", ".join(f"{n} x{c} {ms:.1f}" for n, (c, ms) in list(p["api_top"].items())[:6]))
    return {"load_s": load_s, "passes": passes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--switch-model", default="0.8b")
    ap.add_argument("--lengths", default="40,200,250,290,317,600")
    ap.add_argument("--cases", default="prefill,switch", help="the cases to run, each in fresh processes "
                    "(prefill, switch, depths)")
    ap.add_argument("--case", choices=["prefill", "switch", "depths"], help="(one case, in this process)")
    ap.add_argument("--process", default="0", help="(depths: which of its processes this is)")
    ap.add_argument("--cudnn", default="0")
    ap.add_argument("--depth-processes", default="0,1", help="depths: its processes, each NAME or NAME:ENV=VALUE "
                    "(an MLX setting for that process alone; NAME api: CUPTI's CUDA calls around first rounds)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.case == "prefill":
        res = prefill_case(args.model, [int(t) for t in args.lengths.split(",")])
        (out / f"prefill_cudnn{args.cudnn}.json").write_text(json.dumps(res, indent=1))
        return
    if args.case == "switch":
        (out / "switch.json").write_text(json.dumps(switch_case(args.switch_model), indent=1))
        return
    if args.case == "depths":
        res = depths_case(args.switch_model, profile=args.process.startswith("api"))
        (out / f"depths_{args.process}.json").write_text(json.dumps(res, indent=1))
        return
    cases = args.cases.split(",")
    out.mkdir(parents=True, exist_ok=True)
    script = [sys.executable, __file__, "--out", str(out), "--model", args.model, "--switch-model", args.switch_model,
              "--lengths", args.lengths]
    for cudnn in ("0", "1") if "prefill" in cases else ():  # ops first: builds MLX keeps on disk, paid there,
        # leave cuDNN's own per-process costs
        print(f"== prefill, LATTICE_CUDNN_SDPA={cudnn}", flush=True)
        subprocess.run([*script, "--case", "prefill", "--cudnn", cudnn], check=False, timeout=400,
                       env={**os.environ, "LATTICE_CUDNN_SDPA": cudnn})
    if "switch" in cases:
        print("== switch", flush=True)
        subprocess.run([*script, "--case", "switch"], check=False, timeout=300)
    for spec in args.depth_processes.split(",") if "depths" in cases else ():
        process, _, setting = spec.partition(":")
        env = dict(os.environ, **dict([setting.split("=", 1)])) if setting else os.environ
        print(f"== depths, process {process}{' ' + setting if setting else ''}", flush=True)
        subprocess.run([*script, "--case", "depths", "--process", process], check=False, timeout=300, env=env)


if __name__ == "__main__":
    main()
