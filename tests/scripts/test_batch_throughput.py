"""scripts/bench/batch_throughput.py's record of one step's kernels in launch order: runs of one kernel collapsed,
and each copy kernel's neighbours counted (where batch run 7's copies sit)."""

import importlib.util
import types
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "batch_throughput.py"


def _module():
    spec = importlib.util.spec_from_file_location("batch_throughput", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_order_collapses_runs_and_counts_each_copys_neighbours():
    names = ["rms", "copy_v<float>", "void mlx::core::cu::copy_s<float>", "gdn_kernel", "qmm", "qmm",
             "void mlx::core::cu::copy_v<float>", "gdn_kernel", "memset"]  # (CUDA's names: `void mlx::core::cu::..`)
    # out of launch order in the list: the record sorts by start time
    events = [{"cat": "kernel", "name": n, "ts": 10.0 * i, "dur": 1.0 + i} for i, n in enumerate(names)][::-1]
    events.append({"cat": "memcpy", "name": "copy_v<float>", "ts": 5.0, "dur": 3.0})  # not a kernel: left out
    got = _module().kernel_order(types.SimpleNamespace(events=events))
    assert got["kernels"] == len(names)
    assert got["runs"][:5] == [["rms", 1, 1.0], ["copy_v<float>", 1, 2.0],
                               ["void mlx::core::cu::copy_s<float>", 1, 3.0], ["gdn_kernel", 1, 4.0],
                               ["qmm", 2, 11.0]]
    sites = got["copy_sites"]
    assert sites == {"copy_v<float> | before: rms | next: gdn_kernel": 1,
                     "copy_s<float> | before: copy_v<float> | next: gdn_kernel": 1,
                     "copy_v<float> | before: qmm | next: gdn_kernel": 1}
