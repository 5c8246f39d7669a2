"""scripts/bench/soak_server.py at a short length: 32 clients mixing valid, abandoned and bad requests against a
real server; every valid request gets the quiet server's greedy text, every bad one its 4xx, RSS stays bounded and
SIGTERM ends the server with exit 0 (the 60-second run by hand is docs/results/archive/soak/)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "soak_server.py"


def test_a_short_soak_passes(tmp_path):
    out = tmp_path / "soak.json"
    # no warm-up: with the suite's traced rounds (conftest.py) it traces the batch's rounds at every size 1..16,
    # minutes of this CPU, and the soak is about what the server does with its requests
    r = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "5", "--clients", "32", "--out", str(out),
                        "--server-args=--no-warmup"], capture_output=True, text=True, timeout=400)
    summary = json.loads(out.read_text())
    assert r.returncode == 0 and summary["passed"], summary["failures"] or r.stderr[-2000:]
    counts = summary["counts"]
    assert counts.get("valid_whole", 0) + counts.get("valid_stream", 0) >= 5
    assert sum(v for k, v in counts.items() if not k.startswith(("valid", "abandoned"))) >= 5
    assert summary["sigterm"]["rc"] == 0
