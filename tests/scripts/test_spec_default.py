"""scripts/bench/spec_default.py: a `default@NAME=VALUE;..` leg runs the default with the pipelined tuner's constants
changed and a tuner memory of its own, restores them after each generation, refuses a name the tuner does not
have, and decodes plain greedy's tokens beside the other legs (CPU, tiny shape)."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import load_script, script_env

from lattice_mlx.speculative import pipelined, tuning

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench" / "spec_default.py"


def _script():
    return load_script("bench/spec_default.py")


def test_a_variant_leg_changes_the_tuner_for_its_generations_only():
    sd = _script()
    model = types.SimpleNamespace()
    before = (tuning.PipelinedTuner.SKIP, tuning.DWELL, tuning.OFF_HOPE, pipelined.OFF_HOPE, pipelined.tuner_memory)
    shared = tuning.tuner_memory(model, True)
    with sd.tuned(model, "default@SKIP=3;DWELL=5;OFF_HOPE=1.5"):
        assert (tuning.PipelinedTuner.SKIP, tuning.DWELL, tuning.OFF_HOPE, pipelined.OFF_HOPE) == (3, 5, 1.5, 1.5)
        own = pipelined.tuner_memory(model, True)
        assert own is not shared and own is pipelined.tuner_memory(model, True)
        assert pipelined.tuner_memory(model, False) is not own
    assert (tuning.PipelinedTuner.SKIP, tuning.DWELL, tuning.OFF_HOPE, pipelined.OFF_HOPE,
            pipelined.tuner_memory) == before
    with sd.tuned(model, "default"):  # (the default itself: nothing changes)
        assert pipelined.tuner_memory is before[-1]
    with pytest.raises(SystemExit, match="no constant NOPE"), sd.tuned(model, "default@DWELL=4;NOPE=1"):
        pass
    assert tuning.DWELL == before[1]


def test_variant_legs_decode_plain_greedy_beside_the_others(tmp_path):
    """... with --warm-rounds: every kind of pass run before the first timed repetition, its time recorded apart."""
    out = tmp_path / "sd.json"
    env = script_env()
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--drafts", "oracle:0.5", "--lengths", "12",
                        "--legs", "plain,default,default@SKIP=3;DWELL=4", "--reps", "2", "--prompt-tokens", "8",
                        "--warm-rounds", "1", "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    group = json.loads(out.read_text())["groups"][0]
    assert list(group["legs"]) == ["plain", "default", "default@SKIP=3;DWELL=4"] and group["greedy_identical"]
    assert group["warm_rounds_s"] > 0 and "every kind of pass warmed in" in r.stderr
    # what the default's tuner read per depth, each repetition (plain decoding has no tuner)
    assert group["legs"]["plain"]["tuner_passes"] == [None, None]
    for passes in group["legs"]["default"]["tuner_passes"]:
        assert passes and all(n >= 1 and ms > 0 for n, ms, _ in passes.values()), passes


def test_the_pass_summary_counts_each_depths_passes_and_its_steady_ones():
    sd = _script()
    seen = [(3, 0.010), (3, 0.004), (3, 0.002), (3, 0.0022), (0, 0.0015), (2, 0.003), (0, 0.0016), (0, 0.0014),
            (0, 0.0015)]
    got = sd.pass_summary(seen)
    assert got["3"] == [4, 3.1, 2.1]  # (the steady ones: the third pass in a row at K=3 and after)
    assert got["2"] == [1, 3.0, None]
    assert got["0"] == [4, 1.5, 1.5]  # (steady: the second stretch's third pass alone)
    sd_passes = []
    with sd.passes_seen() as seen_now:
        tuner = tuning.PipelinedTuner(4, {})
        for s in (0.002, 0.0021, 0.0019, 0.002):
            tuner.observe(0, s)
        sd_passes = list(seen_now)
    assert sd_passes == [(0, 0.002), (0, 0.0021), (0, 0.0019), (0, 0.002)]
    assert tuner.cost.get(0)  # (the tuner still read them: its first SKIP passes untimed, then a cost)
    assert tuning.PipelinedTuner.observe.__name__ == "observe"  # (restored)
