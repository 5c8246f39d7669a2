"""Wall time of the first and second generate() in a fresh process (load excluded): the one-off JIT/trace cost a
user's first request pays. Run once per setting, in separate processes: LATTICE_COMPILE=0 / 1.

Usage: LATTICE_COMPILE=1 python scripts/first_generate.py [--mtp] [--out FILE]
"""

import argparse
import json
import os
import time

import mlx.core as mx

from lattice_mlx import generate, load


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mtp", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    model, tok = load()
    rows = []
    for prompt in ("def quicksort(items):\n", "class Stack:\n    def push(self, x):\n", "def quicksort(items):\n"):
        tic = time.perf_counter()
        r = generate(model, tok, prompt, max_tokens=32, mtp=args.mtp, chat_template=False)
        rows.append({"prompt_tokens": r.prompt_tokens, "seconds": time.perf_counter() - tic})
    res = {"device": str(mx.default_device()), "compile": os.environ.get("LATTICE_COMPILE", "default"),
           "mtp": args.mtp, "runs": rows}
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
