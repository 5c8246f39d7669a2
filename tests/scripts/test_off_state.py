"""scripts/bench/off_state.py on the CPU (tiny shape): every leg, the off state's variants and the bare plain steps
included, decodes plain greedy's tokens (the script exits 1 where one does not), and the JSON holds each leg's
figures."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import script_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "off_state.py"


def test_every_leg_decodes_plain_greedy(tmp_path):
    out = tmp_path / "off.json"
    env = script_env()
    r = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--dtype", "float32", "--tokens", "12",
                        "--prompt-tokens", "8", "--reps", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    legs = ["plain", "plain-aa", "off", "off-untuned", "off-unheld", "off-nohidden", "off-bare"]
    assert list(result["legs"]) == legs
    assert all(len(result["legs"][leg]["wall_s"]) == 1 for leg in legs)
