"""Tree vs chain drafting at equal node budgets on the demo model (greedy, held-out code prompts).

Usage: python scripts/bench/bench_tree.py --out docs/results/archive/tree_cpu [--prompts 10] [--tokens 48]
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

from lattice_mlx import SpecOptions, generate, load
from lattice_mlx.bench.report import provenance
from lattice_mlx.bench.run import HELDOUT_PROMPTS

# Pairs at equal node budgets: 3 nodes, 4 nodes, 6 nodes.
SHAPES = ["1-1-1", "3", "1-1-1-1", "2-1", "4", "1-1-1-1-1-1", "2-2", "3-1"]


def leg(model, tok, prompt: str, tree: str | None, tokens: int):
    tic = time.perf_counter()
    spec = SpecOptions(tree=tree) if tree else None
    r = generate(model, tok, prompt, max_tokens=tokens, speculation=spec, chat_template=False)
    return r, r.generation_tokens / (time.perf_counter() - tic)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--model", default="demo", help="demo, or a random shape (0.8b, 4b, cpu-small, tiny) for --oracle-p")
    p.add_argument("--oracle-p", type=float, help="random shapes: per-position acceptance of the oracle drafts")
    p.add_argument("--lengths", default="16,96", help="oracle mode: tok/s is the slope between these lengths")
    args = p.parse_args()
    if args.model != "demo":
        return oracle_main(args)
    spec = json.loads(HELDOUT_PROMPTS.read_text())["prompts"]
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
            leg(model, tok, prompt, shape, 8)  # untimed, like plain: no leg pays a first-use cost in its timing
            r, tps = leg(model, tok, prompt, shape, args.tokens)
            rows[shape]["tps"].append(tps)
            rows[shape]["len"].append(r.speculation["mean_accepted_length"])
            rows[shape]["exact"] &= r.tokens == plain.tokens
        print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    base = statistics.median(rows["plain"]["tps"])
    results = {name: {"median_tps": statistics.median(r["tps"]), "vs_plain": statistics.median(r["tps"]) / base,
                      **({"mean_accepted_per_round": statistics.mean(r["len"]), "exact": r["exact"]}
                         if r["len"] else {})} for name, r in rows.items()}
    write_results(Path(args.out), results, model="embedded demo", prompts=len(prompts), vs_plain="vs plain")


def write_results(out: Path, results: dict, *, model: str, prompts: int, vs_plain: str, label: str = "") -> None:
    """results.json (with provenance) and summary.md, the table printed too."""
    meta = {"command": " ".join(sys.argv), "device": str(mx.default_device()), "mlx": mx.__version__,
            "platform": platform.platform(), "model": model, "prompts": prompts, **provenance(),
            **({"label": label} if label else {})}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    head = f"{label}; " if label else ""
    lines = [f"{head}`{meta['command']}` at {meta['git']}, {meta['device']}, {model}", "",
             f"| shape | nodes | accepted per round | median tok/s | {vs_plain} | exact |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        nodes = "-" if name == "plain" else str(_nodes(name))
        lines.append(f"| {name} | {nodes} | {r.get('mean_accepted_per_round', 0):.2f} | {r['median_tps']:.1f} | "
                     f"{r['vs_plain']:.2f} | {r.get('exact', '')} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def oracle_main(args) -> None:
    """Random model, oracle tree drafts (SYNTHETIC): per prompt, plain (warmed) then every shape, tok/s by slope."""
    from lattice_mlx.bench import run as bench
    from lattice_mlx.bench.oracles import OracleTreeDrafter
    from lattice_mlx.decode import generate_step
    from lattice_mlx.sample import Sampler
    from lattice_mlx.speculative import SpecStats, parse_tree
    from lattice_mlx.speculative.tree import run_tree

    if args.oracle_p is None:
        raise SystemExit("error: a random model needs --oracle-p (random heads accept ~0%)")
    n1, n2 = (int(x) for x in args.lengths.split(","))
    target = bench.load_target(args.model, bits=4, group_size=64, dtype=None, seed=0, stock=False)
    prompts = bench.workload_prompts(target, "random", args.prompts, tokens=64, seed=0)
    model = target.model
    rows = {name: {"tps": [], "len": [], "exact": True} for name in ["plain", *SHAPES]}

    def plain_stream(ids):
        return generate_step(model, mx.array(ids), sampler=Sampler())

    def tree_stream(ids, shape, reference, stats):
        dims = parse_tree(shape)
        drafter = OracleTreeDrafter(model, dims, reference, args.oracle_p, seed=len(reference))
        return run_tree(model, mx.array(ids), sampler=Sampler(), shape=dims, stats=stats, drafter=drafter)

    for i, ids in enumerate(prompts):
        reference = [t for t, _ in zip(plain_stream(ids), range(n2 + 16))]
        bench.timed_run(plain_stream(ids), (8, 9))  # warm-up at this prompt
        rows["plain"]["tps"].append(bench.timed_run(plain_stream(ids), (n1, n2))["tok_s"])
        for shape in SHAPES:
            bench.timed_run(tree_stream(ids, shape, reference, SpecStats(tree=shape)), (8, 9))
            stats = SpecStats(tree=shape)
            stream = tree_stream(ids, shape, reference, stats)
            tokens = [t for t, _ in zip(stream, range(n2))]
            rows[shape]["exact"] &= tokens == reference[:n2]
            stats = SpecStats(tree=shape)
            run = bench.timed_run(tree_stream(ids, shape, reference, stats), (n1, n2))
            rows[shape]["tps"].append(run["tok_s"])
            rows[shape]["len"].append(stats.to_dict()["mean_accepted_length"])
        print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    ratios = {name: statistics.median(t / b for t, b in zip(r["tps"], rows["plain"]["tps"])) for name, r in rows.items()}
    results = {name: {"median_tps": statistics.median(r["tps"]), "vs_plain": ratios[name],
                      **({"mean_accepted_per_round": statistics.mean(r["len"]), "exact": r["exact"]}
                         if r["len"] else {})} for name, r in rows.items()}
    write_results(Path(args.out), results, model=target.label, prompts=len(prompts),
                  vs_plain="vs plain (paired median)",
                  label=f"SYNTHETIC: oracle tree drafts at p={args.oracle_p} (rank r holds the truth w.p. p*0.6^r)")


def _nodes(shape: str) -> int:
    total, width = 0, 1
    for w in map(int, shape.split("-")):
        width *= w
        total += width
    return total


if __name__ == "__main__":
    main()
