"""The pipelined tuner against fixed K=3, x plain over the whole generation (median and range of 10 paired
repetitions), H200, 0.8B shape, bf16: run 21 (f80b680), b257909 (memory and rates, before the spike filter) and
efb9fbf. Run from the repository root: python docs/results/archive/h200/run22/plot_tuner.py"""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
RUNS = [  # (label, {acceptance: decode.json})
    ("run 21 (f80b680)", {0.3: HERE.parent / "run20/adaptive_0.8b_p03_f80b680/decode.json",
                          0.8: HERE.parent / "run20/final_0.8b_f80b680/decode.json"}),
    ("b257909", {0.8: HERE / "tuner_p0.8_b257909/decode.json"}),
    ("efb9fbf", {0.3: HERE / "tuner_p0.3_efb9fbf/decode.json", 0.8: HERE / "tuner_p0.8_efb9fbf/decode.json"}),
]


def whole(leg: dict, plain: dict) -> dict | None:
    """x plain over the whole generation, paired by repetition (run 21's JSON predates the bench's vs_plain_whole)."""
    if "vs_plain_whole" in leg or not leg.get("runs") or leg is plain:
        return leg.get("vs_plain_whole")
    r = sorted(a["tok_s_whole"] / b["tok_s_whole"] for a, b in zip(leg["runs"], plain["runs"]))
    return {"median": statistics.median(r), "min": r[0], "max": r[-1]}


def ratios(path: Path) -> dict:
    out = {}
    for g in json.loads(path.read_text())["groups"]:
        plain = next(leg for leg in g["legs"] if leg["leg"] == "plain")
        for leg in g["legs"]:
            w = whole(leg, plain)
            if w and (leg["leg"].startswith("pipelined-K3") or "adaptive" in leg["leg"] or leg["leg"] == "plain-aa"):
                name = "adaptive" if "adaptive" in leg["leg"] else "K=3" if "K3" in leg["leg"] else "A/A"
                out[name] = (w["median"], w["min"], w["max"])
    return out


fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
for ax, p in zip(axes, (0.3, 0.8)):
    x = 0
    ticks = []
    for label, files in RUNS:
        if p not in files:
            continue
        r = ratios(files[p])
        for i, (name, color) in enumerate((("K=3", "tab:blue"), ("adaptive", "tab:orange"), ("A/A", "tab:gray"))):
            if name in r:
                med, lo, hi = r[name]
                ax.bar(x + i * 0.27, med, 0.25, color=color, label=name if x == 0 else None)
                ax.errorbar(x + i * 0.27, med, yerr=[[med - lo], [hi - med]], color="k", capsize=3, lw=1)
                ax.text(x + i * 0.27, 0.05, f"{med:.2f}", ha="center", fontsize=8, color="white")
        ticks.append((x + 0.27, label))
        x += 1
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xticks([t for t, _ in ticks], [lab for _, lab in ticks])
    ax.set_title(f"synthetic acceptance {p}")
    ax.set_ylabel("x plain, whole generation")
    ax.legend(loc="upper left", fontsize=8)
fig.suptitle("H200, 0.8B Q4 g64 bf16: pipelined tuner vs fixed K=3 (median, range of 10 paired reps)")
fig.tight_layout()
fig.savefig(HERE / "tuner.png", dpi=80)
try:  # a 32-colour palette keeps the file small (the tracked tree stays under 15 MB)
    from PIL import Image

    Image.open(HERE / "tuner.png").convert("RGB").quantize(colors=32).save(HERE / "tuner.png", optimize=True)
except ImportError:
    pass
print("wrote", HERE / "tuner.png")
