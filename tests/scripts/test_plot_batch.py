"""scripts/bench/plot_batch.py: the table of batch_throughput.py's JSON (its figures, the paired ratios and the
scaling over one stream), a plot where matplotlib is installed, and one line for a file that is not such JSON."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "plot_batch.py"


def _summary(median: float) -> dict:
    return {"n": 10, "min": median * 0.9, "median": median, "max": median * 1.1}


def test_table_ratios_and_scaling(tmp_path):
    result = {"meta": {"model": "random 0.8b"}, "streams": {
        "1": {"tok_s": {"ours": _summary(200), "mlx-lm": _summary(50)},
              "ratios": {"ours/mlx-lm": _summary(4.0), "ours-aa/mlx-lm": _summary(3.9)}},
        "16": {"tok_s": {"ours": _summary(2400), "mlx-lm": _summary(1000), "ours-mtp": _summary(3120)},
               "ratios": {"ours/mlx-lm": _summary(2.4), "ours-aa/mlx-lm": _summary(2.3),
                          "ours-mtp/ours": _summary(1.3)}},
        # a stream count cut at the step's limit: its repetitions' seconds, no figures (left out of the table)
        "64": {"partial": True, "seconds": {"ours": [1.0, 1.2], "mlx-lm": [2.0]}}}}
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(result))
    r = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 1") or line.startswith("| 16")]
    assert rows[0].split(" | ")[1:3] == ["200", "50"] and "4.00x (3.60-4.40)" in rows[0]
    assert "2,400" in rows[1] and "3,120" in rows[1] and "1.30x" in rows[1]
    assert "16: 12.0x" in r.stdout  # 2,400 / 200
    assert not any(line.startswith("| 64") for line in r.stdout.splitlines())
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "batch.png").stat().st_size > 0
    else:
        assert "plot skipped" in r.stderr


def test_not_its_json_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not batch_throughput.py's JSON" in r.stderr
