"""scripts/bench/pass_costs.py on the CPU (tiny shape): every schedule's passes are recorded at the depths it forces
(a changing schedule changes depth every BLOCK passes), with the host's share of each pass the loop decided on, and
--profile adds the kernel profiler's figures per
schedule (a stand-in gpu_kernels.py: CUPTI runs only on the GPU machine)."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import script_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "pass_costs.py"
sys.path.insert(0, str(ROOT / "tests" / "bench"))
from test_bench import FAKE_PROFILER  # noqa: E402


def test_schedules_are_recorded_and_profiled(tmp_path):
    (tmp_path / "gpu_kernels.py").write_text(FAKE_PROFILER)
    out = tmp_path / "pc.json"
    env = script_env()
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--tokens", "40", "--reps", "1",
                        "--profile", str(tmp_path), "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    gens = {g["schedule"]: g for g in result["generations"]}
    assert set(gens) == set(result["schedules"])
    for k in range(5):
        assert {p[0] for p in gens[f"k{k}"]["passes"]} == {k}
    block, depths = result["block"], [p[0] for p in gens["changes"]["passes"]]
    assert depths[:block] == [3] * block and depths[block] == 2
    # each pass the loop decided on its own: the host's time building its graph and launching it, within the pass
    for p in gens["k3"]["passes"] + [p for p in gens["changes"]["passes"] if p[0]]:
        assert 0 < p[3] and 0 <= p[4] and p[3] + p[4] <= p[1] * 1.01 + 0.01, p
    # a plain stretch's passes after its first: no graph of their own (plain decoding's loop), none recorded
    plain = gens["k0"]["passes"]
    assert plain[0][3] is not None and any(p[3] is None for p in plain)
    assert all(p[4] is None for p in plain if p[3] is None)
    assert set(result["gpu_profile"]) == set(result["schedules"])
    assert result["gpu_profile"]["k3"]["kernels_per_step"] == 160.0 and result["gpu_profile"]["k3"]["rounds"] >= 1
