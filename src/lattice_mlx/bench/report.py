"""Benchmark reports: provenance (git revision, device, peers), terminal and markdown tables, plots, and the
one-line headline; run.py runs the legs and hands its results here. Run as a module, it draws an archived result's
plot again (the archive keeps the JSON; the plots of superseded runs are not kept):

    python -m lattice_mlx.bench.report docs/results/archive/h200/run14/steps_traced_43f0c7c/decode.json.gz --out /tmp
"""

import argparse
import gzip
import json
import platform
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import settings
from ..runtime import PACKAGE, source_digest  # noqa: F401 (PACKAGE: read here by the bench tests)
from . import stats as bs

SYNTHETIC = "SYNTHETIC (oracle drafts)"


def provenance() -> dict:
    """What every result file records about the code behind it: the content digest of the package that ran, and the
    git revision (with whether the tree was dirty) when git can tell."""
    rev, dirty = git_revision()
    return {"src_sha256": source_digest(), "git_revision": rev, "git_dirty": dirty}


def git_revision() -> tuple[str, bool | None]:
    if settings.raw("git_rev"):
        return settings.raw("git_rev"), None
    here = Path(__file__).resolve().parent  # git finds the checkout above an editable install; a wheel has none
    try:
        rev = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        return rev or "unknown", bool(dirty)
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def device_name() -> str:
    try:
        info = mx.device_info()
        return str(info.get("device_name") or info.get("architecture") or info)
    except Exception:
        return platform.processor() or platform.machine()


def peer_status() -> dict:
    """Peer MTP runtimes are imported, never installed: when absent the result file says why."""
    peers = {}
    for label, module in (("mlx-vlm qwen3_5_mtp", "mlx_vlm"), ("MTPLX", "mtplx")):
        try:
            mod = __import__(module)
            peers[label] = f"installed ({getattr(mod, '__version__', '?')}); no leg for it in this harness yet"
        except Exception as e:
            peers[label] = f"not installed on this backend: {type(e).__name__}: {e}"
    return peers


def kernel_name(name: str) -> str:
    """A CUPTI kernel name without `void `, MLX's namespace and the argument list (the template arguments stay)."""
    if "mlx::core::cu::" not in name and not name.startswith("void "):
        return name
    return name.removeprefix("void ").replace("mlx::core::cu::", "").split("(")[0]


def fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def leg_rows(group: dict) -> list[list[str]]:
    rows = []
    for s in group["legs"]:
        t = s["tok_s"]
        split = s.get("time_split")
        rows.append([
            s["leg"], fmt(t["median"], ".1f"), f"{t['min']:.1f}/{t['max']:.1f}",
            f"{t['cv'] * 100:.0f}%" + (" !" if t["cv_flag"] else ""),
            fmt((s.get("vs_plain") or {}).get("median"), ".2f"), fmt((s.get("vs_stock") or {}).get("median"), ".2f"),
            fmt(s.get("alpha")), " ".join(f"{a:.2f}" for a in s.get("accepted_per_position", [])) or "-",
            fmt(s.get("mean_accepted_length")),
            "/".join(f"{split[k] * 100:.0f}" for k in ("draft", "verify", "rollback")) if split else "-",
            fmt(s.get("predicted_speedup")), fmt(s.get("break_even_alpha"), ".2f", "never" if "costs_in_plain_steps"
                                                  in s else "-"),
            f"{s['peak_memory_gb']:.2f}", f"{s['effective_gb_s']:.1f}", *profile_cells(s.get("gpu_profile")),
        ])
    return rows


LEG_HEADER = ["leg", "tok/s med", "min/max", "CV", "x plain", "x stock", "alpha", "acc per position",
              "mean acc len", "draft/verify/rollback %", "model x", "break-even alpha", "peak GB", "eff GB/s",
              "kernels/tok (/round)", "GPU busy us/tok", "span/busy"]


def profile_cells(p: dict | None) -> list[str]:
    """The profiler's columns: kernels per token (per round for MTP), GPU busy time per token (the union of kernel
    intervals: kernels of one CUDA graph run concurrently, so their summed durations overstate the GPU's work), span
    over busy."""
    if not p:
        return ["-", "-", "-"]
    kernels = f"{p['kernels_per_step']:.0f}" + (f" ({p['kernels_per_round']:.0f})" if "kernels_per_round" in p else "")
    ratio = p["span_us_per_step"] / p["busy_us_per_step"] if p["busy_us_per_step"] else 0.0
    return [kernels, f"{p['busy_us_per_step']:.0f}", f"{ratio:.2f}"]


def aa_line(group: dict) -> str:
    """The A/A control's spread: two identical plain legs, paired like every ratio in the table."""
    aa = next((s.get("vs_plain") for s in group["legs"] if s["leg"].startswith("plain-aa")), None)
    if not aa:
        return ""
    return (f"\n\nA/A control (plain-aa / plain, {aa['n']} paired runs): median {aa['median']:.3f}, "
            f"range {aa['min']:.3f}-{aa['max']:.3f}: a ratio inside that range is noise.")


def whole_line(group: dict) -> str:
    """With adaptive legs in the group (timed from the first token): every leg's ratio to plain on that measure,
    so fixed and adaptive legs compare like for like (the table's `x plain` of a fixed leg is the slope's)."""
    if not any(s.get("adaptive") for s in group["legs"]):
        return ""
    cells = [f"{s['leg']} {w['median']:.2f}x ({w['min']:.2f}-{w['max']:.2f})"
             for s in group["legs"] if (w := s.get("vs_plain_whole"))]
    return f"\n\nOver the whole generation (the adaptive legs' measure), x plain: {', '.join(cells)}." if cells else ""


def identity_line(group: dict) -> str:
    """Greedy MTP legs against plain decoding, token for token, on every prompt run."""
    cells = [f"{s['leg']} {s['identical_to_plain']}" + (" (against mlx-lm's own plain loop; this project's plain "
                                                         f"loop equals it on {s['plain_is_mlx_lm_plain']})"
                                                         if "identical_to" in s else "")
             for s in group["legs"] if "identical_to_plain" in s]
    return f"\n\nGreedy tokens identical to plain's: {', '.join(cells)}." if cells else ""


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [header, *rows])


def group_tables(name: str, result: dict, render) -> list[str]:
    out = []
    if name == "prefill":
        rows = [[r["leg"], str(r["prompt_tokens"]), fmt(r["tok_s"]["median"], ".0f"),
                 f"{r['tok_s']['min']:.0f}/{r['tok_s']['max']:.0f}", f"{r['tok_s']['cv'] * 100:.0f}%",
                 fmt((r.get("vs_plain") or {}).get("median"))] for r in result["rows"]]
        return [render(["leg", "prompt tokens", "tok/s med", "min/max", "CV", "x plain"], rows)]
    for g in result["groups"]:
        title = f"{name}: workload {g['workload']}, temp {g['temp']:g}"
        if name == "oracle" or g.get("oracle_p") is not None:
            title += f" -- {SYNTHETIC}"
        out.append(title + "\n\n" + render(LEG_HEADER, leg_rows(g)) + aa_line(g) + whole_line(g) + identity_line(g))
    return out


def write_markdown(out: Path, name: str, result: dict, meta: dict, plots: list[str], plot_note: str,
                   order: list[str]) -> None:
    """`name`.md for one experiment, then summary.md joining every experiment's file present, in `order`."""
    lines = [f"## {name}" + (f" ({SYNTHETIC})" if name == "oracle" else ""), "",
             f"`{meta['command']}`", "",
             (f"src {meta['src_sha256'][:19]} | git {meta['git_revision']}{' (dirty tree)' if meta['git_dirty'] else ''} | "
              f"{meta['date']} | "
              f"backend {meta['backend']} | device {meta['device']} | MLX {meta['mlx_version']} | "
              f"mlx-lm {meta['mlx_lm_version']} | model {meta['model']}"), ""]
    if result.get("note"):
        lines += [f"Note: {result['note']}.", ""]
    lines += [("Decode tok/s is the slope between two generation lengths (adaptive legs: from the first token to the "
               "second length, so their warm-up, decisions and plain stretches count; their `x plain` uses plain's "
               "rate over the same span); `x plain` / `x stock` are medians of "
               "ratios paired by repetition (with `--compile-ab`, a `+compile` leg's `x plain` is against "
               "`plain+compile`, and `plain+compile`'s against `plain`); `alpha` is the pooled per-position "
               "acceptance; `model x` is the speedup "
               "the cost model predicts from this leg's measured draft/verify/rollback costs at its alpha; `!` marks "
               "CV > 20%."), ""]
    for table in group_tables(name, result, markdown_table):
        lines += [table, ""]
    lines += [f"![{p}]({p})" for p in plots] + ([f"_{plot_note}_"] if plot_note else [])
    lines += ["", "Peers: " + "; ".join(f"{k}: {v}" for k, v in meta["peers"].items()), ""]
    (out / f"{name}.md").write_text("\n".join(lines))
    parts = [(out / f"{n}.md").read_text() for n in order if (out / f"{n}.md").exists()]
    (out / "summary.md").write_text("# lattice_mlx benchmark results\n\n" + "\n".join(parts))


def make_plots(out: Path, name: str, result: dict) -> tuple[list[str], str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed"
    files = []
    if name == "oracle":
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for curve, points in result["curves"].items():
            xs = [p["alpha"] for p in points]
            med = [p["speedup"]["median"] for p in points]
            err = [[m - p["speedup"]["min"] for m, p in zip(med, points)],
                   [p["speedup"]["max"] - m for m, p in zip(med, points)]]
            line = ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=f"{curve} measured")
            costs = next((p["costs_in_plain_steps"] for p in reversed(points) if p["costs_in_plain_steps"]), None)
            if costs:
                grid = np.linspace(0, 1, 51)
                k = int(curve.rsplit("K", 1)[1].removesuffix("+compile"))
                ax.plot(grid, [bs.model_speedup(a, k, costs) for a in grid], "--", color=line[0].get_color(),
                        alpha=0.6)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xlabel="measured per-position acceptance (forced by oracle drafts)", ylabel="speedup over plain",
               title=f"{SYNTHETIC}: MTP speedup vs acceptance (dashed: cost model)")
        ax.legend(fontsize=7)
        files.append(_save(fig, out, "oracle_speedup.png"))
    elif name == "prefill":
        fig, ax = plt.subplots(figsize=(6, 4))
        for leg in sorted({r["leg"] for r in result["rows"]}):
            rows = [r for r in result["rows"] if r["leg"] == leg]
            ax.plot([r["prompt_tokens"] for r in rows], [r["tok_s"]["median"] for r in rows], marker="o", label=leg)
        ax.set(xscale="log", xlabel="prompt tokens", ylabel="prefill tok/s", title="prefill rate")
        ax.legend()
        files.append(_save(fig, out, "prefill.png"))
    else:
        groups = result["groups"]
        fig, axes = plt.subplots(len(groups), 1, figsize=(9, 3.2 * len(groups)), squeeze=False)
        for ax, g in zip(axes[:, 0], groups):
            names = [s["leg"] for s in g["legs"]]
            med = [s["tok_s"]["median"] for s in g["legs"]]
            err = [[m - s["tok_s"]["min"] for m, s in zip(med, g["legs"])],
                   [s["tok_s"]["max"] - m for m, s in zip(med, g["legs"])]]
            ax.bar(range(len(names)), med, yerr=err, capsize=3, color=["C0" if "oracle" not in n else "C1"
                                                                        for n in names])
            ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=7)
            synth = f" -- {SYNTHETIC} p={g['oracle_p']:g} (orange)" if g.get("oracle_p") is not None else ""
            ax.set(ylabel="tok/s", title=f"{name}: {g['workload']}, temp {g['temp']:g}{synth}")
        fig.tight_layout()
        files.append(_save(fig, out, f"{name}_tok_s.png"))
    return files, ""


def _save(fig, out: Path, filename: str) -> str:
    fig.savefig(out / filename, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return filename


def headline(name: str, result: dict) -> dict:
    if name == "prefill":
        return {f"{r['leg']}@{r['prompt_tokens']}": round(r["tok_s"]["median"], 1) for r in result["rows"]}
    out = {}
    for g in result["groups"]:
        for s in g["legs"]:
            key = f"{g['workload']}/t{g['temp']:g}/{s['leg']}"
            out[key] = {"tok_s": round(s["tok_s"]["median"], 2),
                        "x_plain": round(s["vs_plain"]["median"], 3) if s.get("vs_plain") else None}
            if "alpha" in s:
                out[key]["alpha"] = round(s["alpha"], 3)
    return out


def replot(path: Path, out: Path | None = None) -> list[Path]:
    """The plot of the result `path` (NAME.json as the bench wrote it, or gzipped), written into `out` (default:
    beside it), as the run that measured it drew it."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not ({"groups", "curves", "rows"} & data.keys()):
        raise ValueError("no groups, curves or rows")
    meta = data.pop("meta", {})
    name = meta.get("experiment") or path.name.split(".")[0]
    out = out or path.parent
    out.mkdir(parents=True, exist_ok=True)
    files, note = make_plots(out, name, data)
    if note:
        raise RuntimeError(note)
    return [out / f for f in files]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lattice_mlx.bench.report",
                                 description="Draws archived benchmark results' plots again.")
    ap.add_argument("results", nargs="+", type=Path, help="NAME.json or NAME.json.gz, as `lattice_mlx.bench` wrote it")
    ap.add_argument("--out", type=Path, help="the folder for the plots (default: beside each result)")
    args = ap.parse_args(argv)
    for path in args.results:
        try:
            for f in replot(path, args.out):
                print(f)
        except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                RuntimeError) as e:
            print(f"report: {path}: cannot draw it ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
