"""Two first-use costs, measured where they happen (a GPU; each case in a fresh process of its own):

- `prefill`: a prompt length's first prefill against its second, for several new lengths in one process, with prompt
  rows' attention written out in ops (LATTICE_CUDNN_SDPA=0, the default) and given to MLX's fused SDPA (=1, cuDNN on
  CUDA); the files MLX adds to its PTX cache meanwhile are counted (a build kept on disk) — a cost with no new file is
  one that every process pays again.
- `switch`: the pipelined loop's passes around a switch from plain steps to rounds and back (speculative/pipelined.py
  driven directly, greedy): per pass, the host's time to build it and the wait for its result, three cycles, so the
  first cycle's compiles stand apart from the steady cost of a switch.

    python scripts/bench/first_use.py --out DIR [--model demo] [--switch-model 0.8b] [--lengths 40,200,250,290,317,600]
"""

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--switch-model", default="0.8b")
    ap.add_argument("--lengths", default="40,200,250,290,317,600")
    ap.add_argument("--case", choices=["prefill", "switch"], help="(one case, in this process)")
    ap.add_argument("--cudnn", default="0")
    args = ap.parse_args()
    out = Path(args.out)
    if args.case == "prefill":
        res = prefill_case(args.model, [int(t) for t in args.lengths.split(",")])
        (out / f"prefill_cudnn{args.cudnn}.json").write_text(json.dumps(res, indent=1))
        return
    if args.case == "switch":
        (out / "switch.json").write_text(json.dumps(switch_case(args.switch_model), indent=1))
        return
    out.mkdir(parents=True, exist_ok=True)
    script = [sys.executable, __file__, "--out", str(out), "--model", args.model, "--switch-model", args.switch_model,
              "--lengths", args.lengths]
    for cudnn in ("0", "1"):  # ops first: builds MLX keeps on disk, paid there, leave cuDNN's own per-process costs
        print(f"== prefill, LATTICE_CUDNN_SDPA={cudnn}", flush=True)
        subprocess.run([*script, "--case", "prefill", "--cudnn", cudnn], check=False, timeout=400,
                       env={**os.environ, "LATTICE_CUDNN_SDPA": cudnn})
    print("== switch", flush=True)
    subprocess.run([*script, "--case", "switch"], check=False, timeout=300)


if __name__ == "__main__":
    main()
