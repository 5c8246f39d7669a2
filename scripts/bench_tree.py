"""Tree vs chain drafting at equal node budgets on the demo model (greedy, held-out code prompts).

Usage: python scripts/bench_tree.py --out docs/bench/tree_cpu [--prompts 10] [--tokens 48]
Per prompt the legs run back to back (plain, then every shape); each leg's tokens are checked against plain.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from lattice_mlx import generate, load
from lattice_mlx.bench import git_revision

# Pairs at equal node budgets: 3 nodes, 4 nodes, 6 nodes.
SHAPES = ["1-1-1", "3", "1-1-1-1", "2-1", "4", "1-1-1-1-1-1", "2-2", "3-1"]


def leg(model, tok, prompt: str, tree: str | None, tokens: int):
    tic = time.perf_counter()
    r = generate(model, tok, prompt, max_tokens=tokens, tree=tree, chat_template=False)
    return r, r.generation_tokens / (time.perf_counter() - tic)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    spec = json.loads(Path(__file__).with_name("demo_heldout_prompts.json").read_text())["prompts"]
    prompts = [s["prompt"] for s in spec][: args.prompts]
    model, tok = load()
    leg(model, tok, "import os", "2-1", 8)  # warm-up
    rows = {name: {"tps": [], "len": [], "exact": True} for name in ["plain", *SHAPES]}
    for i, prompt in enumerate(prompts):
        # untimed: the first run at a new prompt length pays one-off GPU costs (H200: plain looked 3-4x slower)
        leg(model, tok, prompt, None, args.tokens)
        plain, tps = leg(model, tok, prompt, None, args.tokens)
        rows["plain"]["tps"].append(tps)
        for shape in SHAPES:
            r, tps = leg(model, tok, prompt, shape, args.tokens)
            rows[shape]["tps"].append(tps)
            rows[shape]["len"].append(r.mtp["mean_accepted_length"])
            rows[shape]["exact"] &= r.tokens == plain.tokens
        print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    base = statistics.median(rows["plain"]["tps"])
    results = {name: {"median_tps": statistics.median(r["tps"]), "vs_plain": statistics.median(r["tps"]) / base,
                      **({"mean_accepted_per_round": statistics.mean(r["len"]), "exact": r["exact"]}
                         if r["len"] else {})} for name, r in rows.items()}
    meta = {"command": " ".join(sys.argv), "device": str(mx.default_device()), "mlx": mx.__version__,
            "platform": platform.platform(), "model": "embedded demo", "prompts": len(prompts),
            "git": git_revision()[0]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = [f"`{meta['command']}` at {meta['git']}, {meta['device']}", "",
             "| shape | nodes | accepted per round | median tok/s | vs plain | exact |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        nodes = "-" if name == "plain" else str(_nodes(name))
        lines.append(f"| {name} | {nodes} | {r.get('mean_accepted_per_round', 0):.2f} | {r['median_tps']:.1f} | "
                     f"{r['vs_plain']:.2f} | {r.get('exact', '')} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _nodes(shape: str) -> int:
    total, width = 0, 1
    for w in map(int, shape.split("-")):
        width *= w
        total += width
    return total


if __name__ == "__main__":
    main()
