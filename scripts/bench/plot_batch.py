"""Aggregate decode throughput against concurrent streams from batch_throughput.py's JSON: a table (markdown, on
stdout) and, where matplotlib is installed, a plot of each leg's median tok/s (bars: min..max over the repetitions)
beside the paired ratios that the issue's targets name, with the A/A leg's spread.

    python scripts/bench/plot_batch.py RESULT.json [--out PLOT.png]
"""
import argparse
import json
import sys
from pathlib import Path

RATIOS = ("ours/mlx-lm", "ours-aa/mlx-lm", "ours-mtp/ours", "ours-mtp-auto/ours", "ours-mtp/ours-mtp-base",
          "ours-mtp-auto/ours-mtp-base", "ours-dequant/ours")  # if present (runs before 2: ours-mtp/ours)


def streams(result: dict) -> list[tuple[int, dict]]:
    """Each stream count's figures; a count cut before its summary (`partial`: its seconds only) is left out."""
    return sorted((int(n), s) for n, s in result["streams"].items() if not s.get("partial"))


def table(result: dict) -> str:
    rows = streams(result)
    legs = sorted({leg for _, s in rows for leg in s["tok_s"]}, key=lambda x: (x != "ours", x))
    ratios = [r for r in RATIOS if any(r in s.get("ratios", {}) for _, s in rows)]
    head = ["streams"] + [f"{leg} tok/s" for leg in legs] + ratios
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, s in rows:
        cells = [str(n)] + [f"{s['tok_s'][leg]['median']:,.0f}" if leg in s["tok_s"] else "-" for leg in legs]
        for r in ratios:
            x = s.get("ratios", {}).get(r)
            cells.append(f"{x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f})" if x else "-")
        lines.append("| " + " | ".join(cells) + " |")
    one = dict(rows).get(1, {}).get("tok_s", {}).get("ours")
    if one:
        lines.append("")
        lines.append("ours at N streams over ours at one stream (medians): " + ", ".join(
            f"{n}: {s['tok_s']['ours']['median'] / one['median']:.1f}x" for n, s in rows if "ours" in s["tok_s"]))
    return "\n".join(lines)


def plot(result: dict, out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    rows = streams(result)
    xs = [n for n, _ in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for leg in sorted({leg for _, s in rows for leg in s["tok_s"]}):
        pts = [(n, s["tok_s"][leg]) for n, s in rows if leg in s["tok_s"]]
        med = [p["median"] for _, p in pts]
        err = [[m - p["min"] for m, (_, p) in zip(med, pts)], [p["max"] - m for m, (_, p) in zip(med, pts)]]
        left.errorbar([n for n, _ in pts], med, yerr=err, marker="o", capsize=3, label=leg)
    left.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="aggregate decode tok/s",
             title=result.get("meta", {}).get("model", ""))
    left.set_xticks(xs, [str(n) for n in xs])
    left.legend(fontsize=7)
    for r in RATIOS:
        pts = [(n, s["ratios"][r]) for n, s in rows if r in s.get("ratios", {})]
        if pts:
            med = [p["median"] for _, p in pts]
            err = [[m - p["min"] for m, (_, p) in zip(med, pts)], [p["max"] - m for m, (_, p) in zip(med, pts)]]
            right.errorbar([n for n, _ in pts], med, yerr=err, marker="o", capsize=3, label=r)
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(xscale="log", xlabel="concurrent streams", ylabel="paired ratio (median, min..max)",
              title="ratios (ours-aa/mlx-lm: the A/A control beside ours/mlx-lm)")
    right.set_xticks(xs, [str(n) for n in xs])
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return f"plot: {out}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="batch_throughput.py's JSON")
    p.add_argument("--out", help="the plot's path (default: beside the JSON, .png)")
    args = p.parse_args(argv)
    try:
        result = json.loads(Path(args.result).read_text())
        result["streams"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"plot_batch: {args.result} is not batch_throughput.py's JSON ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    print(table(result))
    print(plot(result, Path(args.out) if args.out else Path(args.result).with_suffix(".png")), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
