"""kernel_time_vs_T.png: GPU kernel time and launches per forward over T tokens, 0.8B shape, bf16, H200 (CUPTI), at
the start of [fewer-kernels] (run 5, cdad115), in run 15 (cebc332) and in run 23 (ca2d62c).

Usage: python docs/results/archive/h200/run23/plot_kernel_time.py (needs matplotlib; reads the JSON files it names)."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

H200 = Path(__file__).resolve().parents[1]
RUNS = [
    ("run 5, before (cdad115): MLX qmv, separate norms/adds", H200 / "run5/profile_before_cdad115.json"),
    ("run 15 (cebc332): fused 4-bit matmuls, fewer launches", H200 / "run15/kernels_per_forward_cebc332.json"),
    ("run 23 (ca2d62c): HEAD", H200 / "run23/kernels_per_forward_ca2d62c.json"),
]


def series(path: Path) -> tuple[list[int], list[float], list[float]]:
    data = json.loads(path.read_text())
    ts, us, n = [], [], []
    for key, value in data.items():
        if key.startswith("lattice_T") and (key.endswith("_verify") and not key.startswith("lattice_T1_")
                                            or key == "lattice_T1_decode"):
            ts.append(int(key.split("_")[1][1:]))
            us.append(value["kernel_us_per_step"])
            n.append(value["kernels_per_step"])
    order = sorted(range(len(ts)), key=ts.__getitem__)
    return [ts[i] for i in order], [us[i] for i in order], [n[i] for i in order]


def main() -> None:
    fig, (ax_us, ax_n) = plt.subplots(1, 2, figsize=(10, 4))
    for label, path in RUNS:
        ts, us, n = series(path)
        ax_us.plot(ts, us, "o-", label=label)
        ax_n.plot(ts, n, "o-", label=label)
    ax_us.set(title="0.8B shape, Q4 g64, bf16, H200 (CUPTI)", xlabel="T (1: decode step; >1: verify forward)",
              ylabel="GPU kernel time per forward (us)")
    ax_n.set(title="kernel launches per forward", xlabel="T (1: decode step; >1: verify forward)",
             ylabel="kernels per forward")
    ax_us.set_ylim(bottom=0)
    ax_n.set_ylim(bottom=0)
    for ax in (ax_us, ax_n):
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(__file__).with_name("kernel_time_vs_T.png")
    fig.savefig(out, dpi=80)
    try:  # a 32-colour palette keeps the file small (the tracked tree stays under 15 MB)
        from PIL import Image

        Image.open(out).convert("RGB").quantize(colors=32).save(out, optimize=True)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
