"""First vs repeated prefill at new prompt lengths: the one-off cost a new shape pays (seen on the H200 as plain
generate() at 250-300 tok/s against 1,020 in warmed measurements; hypothesis: per-shape plan building, e.g. cuDNN
for conv1d, or JIT work). Each length runs three times on a fresh cache; the first run pays whatever is per shape.

Usage: python scripts/first_call.py [--model demo] [--lengths 37,53,71,97] [--out FILE]
"""

import argparse
import json
import time

import mlx.core as mx

from lattice_mlx.bench import load_target


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo")
    p.add_argument("--lengths", default="37,53,71,97,131")
    p.add_argument("--out")
    args = p.parse_args()
    target = load_target(args.model, bits=4, group_size=64, dtype=None, seed=0, stock=False)
    model = target.model
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        ids = mx.array([[(i * 7919) % 1000 + 1 for i in range(n)]])
        times = []
        for _ in range(3):
            cache = model.make_cache()
            tic = time.perf_counter()
            mx.eval(model(ids, cache))
            times.append((time.perf_counter() - tic) * 1e3)
        rows.append({"prompt_tokens": n, "first_ms": times[0], "second_ms": times[1], "third_ms": times[2]})
        print(f"T={n:5d} first {times[0]:8.1f} ms  then {times[1]:7.1f} / {times[2]:7.1f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(mx.default_device()), "model": target.label, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
