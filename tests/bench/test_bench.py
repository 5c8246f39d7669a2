import json
import multiprocessing
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from lattice_mlx.bench import run as bench
from lattice_mlx.bench import stats as bs
from lattice_mlx.bench.synthetic import random_checkpoint
from lattice_mlx.models import compiled

ROOT = Path(__file__).resolve().parents[2]


def test_slope_removes_fixed_cost():
    # 0.4 s of prefill/warm-up plus 50 tok/s: the slope sees only the 50.
    t = lambda n: 0.4 + n / 50.0
    assert bs.slope_rate(32, t(32), 160, t(160)) == pytest.approx(50.0)
    with pytest.raises(AssertionError):
        bs.slope_rate(160, 1.0, 32, 0.5)


def test_summarize_cv_and_flag():
    s = bs.summarize([10.0, 10.0, 10.0, 10.0, 10.0])
    assert (s["min"], s["median"], s["max"], s["cv"], s["cv_flag"]) == (10.0, 10.0, 10.0, 0.0, False)
    s = bs.summarize([8.0, 12.0])  # mean 10, population std 2
    assert s["cv"] == pytest.approx(0.2) and not s["cv_flag"]
    s = bs.summarize([5.0, 10.0, 15.0, 30.0, 9.0])
    assert s["cv_flag"] and s["median"] == 10.0 and s["min"] == 5.0 and s["max"] == 30.0


def test_abba_order_balances_positions():
    legs = ["stock", "plain", "seq", "batched"]
    orders = [bs.abba_order(legs, r) for r in range(6)]
    assert orders[0] == legs and orders[1] == legs[::-1] and orders[2] == legs
    for leg in legs:  # every pair of repetitions puts each leg at the same mean position
        assert sum(o.index(leg) for o in orders[:2]) == len(legs) - 1
    flat = [x for o in orders[:2] for x in o]
    assert flat == ["stock", "plain", "seq", "batched", "batched", "seq", "plain", "stock"]


def test_abba_cancels_linear_drift():
    # A machine slowing down linearly: ABBA gives both identical legs the same mean time.
    legs, clock, times = ["A", "B"], 0, {"A": [], "B": []}
    for rep in range(4):
        for leg in bs.abba_order(legs, rep):
            times[leg].append(1.0 + 0.1 * clock)
            clock += 1
    assert sum(times["A"]) == pytest.approx(sum(times["B"]))


def test_speedup_model_and_break_even():
    assert bs.expected_tokens(0.0, 3) == 1.0 and bs.expected_tokens(1.0, 3) == 4.0
    assert bs.expected_tokens(0.5, 2) == pytest.approx(1.75)
    costs = {"v": 1.2, "c": 0.1, "r": 0.0}
    a = bs.break_even(2, costs)
    assert bs.model_speedup(a, 2, costs) == pytest.approx(1.0, abs=1e-3)
    assert bs.break_even(2, {"v": 5.0, "c": 1.0}) is None  # even perfect drafts lose
    assert bs.break_even(1, {"v": 0.5, "c": 0.1}) == 0.0
    # Sequential verify costs one step per emitted token: it cannot win unless a step got cheaper.
    assert bs.break_even(2, {"v1": 1.0, "c": 0.1, "r": 0.0}) is None


def test_acceptance_estimates_recover_alpha():
    # 1000 rounds at K=3, alpha = 0.5 exactly in expectation: reached 1000, 500, 250; accepted 500, 250, 125.
    est = bs.acceptance_estimates([500, 250, 125], 1000, 3)
    assert est["alpha"] == pytest.approx(0.5) and est["conditional_per_position"] == [0.5, 0.5, 0.5]


def hold_lock(path: str, ready, release):
    with bench.bench_lock(path):
        ready.set()
        release.wait(120)


def test_lock_excludes_a_second_holder(tmp_path):
    path = str(tmp_path / "bench.lock")
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=hold_lock, args=(path, ready, release))
    holder.start()
    try:
        assert ready.wait(120)  # a spawned process imports MLX: slow on a loaded GPU machine
        tic = time.monotonic()
        with pytest.raises(bench.LockTimeout), bench.bench_lock(path, timeout=0.3):
            pass
        assert time.monotonic() - tic >= 0.3
    finally:
        release.set()
        holder.join(20)
    with bench.bench_lock(path, timeout=5) as waited:  # free again once the holder exits
        assert waited < 5


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = random_checkpoint(tmp_path_factory.mktemp("bench") / "tiny", seed=5)
    return bench.load_target(str(path), bits=0, group_size=64, dtype="float32", seed=0, stock=True)


def test_stock_leg_shares_weights(tiny_target):
    assert tiny_target.stock is not None, tiny_target.stock_note
    assert tiny_target.stock_max_logit_diff < 1e-3


@pytest.mark.parametrize("p", [0.3, 0.8])
def test_oracle_acceptance_matches_request(tiny_target, p, tmp_path):
    """Every verifier's synthetic drafts (the batched loop's, the pipelined loop's on the device, mlx-lm's loop's
    through OracleDraftModel) are accepted at the requested rate, and every leg gives plain's greedy tokens."""
    verifiers = ("batched", "pipelined", "mlx-lm")
    legs = [bench.Leg("plain")] + [bench.Leg("mtp", v, 2, p=p) for v in verifiers]
    prompts = bench.workload_prompts(tiny_target, "code", 3, tokens=16, seed=0)
    # a lock of this test's own: /dev/null was shared by every process on the machine
    lock = {"path": str(tmp_path / "lock"), "timeout": 5.0, "waited_s": 0.0}
    records = bench.run_group(tiny_target, legs, prompts, temp=0.0, reps=3, lengths=(8, 120), lock=lock, seed=1,
                              label="test")
    for v in verifiers:
        s = bench.leg_summary(records[f"{v}-K2-oracle" + format(p, "g")], records, tiny_target)
        trials = s["trials"]
        sigma = (p * (1 - p) / trials) ** 0.5
        assert abs(s["alpha"] - p) < 4 * sigma + 0.02, (v, s["alpha"], trials)
        assert s["drafts"].startswith(bench.SYNTHETIC) and s["identical_to_plain"] == "3/3 prompts", v
        if v == "mlx-lm":  # held to mlx-lm's own plain loop, which on this fp32 model is this project's too
            assert s["identical_to"].startswith("mlx-lm's own plain loop") and s["plain_is_mlx_lm_plain"] == "3/3 prompts"


def test_cli_smoke(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lattice_mlx.bench", "all", "--model", "tiny", "--reps", "2", "--lengths", "4,12",
           "--k", "1,adaptive", "--temps", "0", "--oracle-ps", "0,1", "--prefill-lengths", "16", "--out", str(out),
           "--lock", str(tmp_path / "lock")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(line["results"]) == {"decode", "oracle", "prefill"}
    assert "rep 1/2" in proc.stderr  # progress
    for name in ("decode", "oracle", "prefill"):
        result = json.loads((out / f"{name}.json").read_text())
        meta = result["meta"]
        for key in ("command", "src_sha256", "git_revision", "backend", "mlx_version", "device", "date", "peers"):
            assert meta[key] not in (None, ""), key
        assert "--model tiny" in meta["command"]
    oracle = json.loads((out / "oracle.json").read_text())
    assert oracle["label"] == bench.SYNTHETIC and "batched-K1" in oracle["curves"]
    summary = (out / "summary.md").read_text()
    assert "SYNTHETIC" in summary and "lattice_mlx.bench all" in summary


def test_cli_rejects_bad_lengths(tmp_path):
    assert bench.main(["decode", "--model", "tiny", "--lengths", "40,8", "--out", str(tmp_path)]) == 1


def test_acceptance_experiment_on_checkpoint(tiny_target, tmp_path):
    args = bench.setup_arg_parser().parse_args(
        ["acceptance", "--reps", "1", "--prompts", "2", "--lengths", "4,16", "--k", "1,2", "--temps", "0,0.7"])
    bench.check_args(args)
    lock = {"path": str(tmp_path / "lock"), "timeout": 5.0, "waited_s": 0.0}
    result = bench.experiment_acceptance(tiny_target, args, lock)
    legs = {g["temp"]: [s["leg"] for s in g["legs"]] for g in result["groups"]}
    assert legs[0.0] == ["plain", "batched-K1", "batched-K2"]
    for g in result["groups"]:
        for s in g["legs"][1:]:
            assert s["drafts"] == "real MTP head" and len(s["accepted_per_position"]) == s["k"]
    mx.clear_cache()


def test_compiled_twins_are_measured_against_compiled_plain(tiny_target):
    """With --compile-ab a +compile leg's x plain is against plain+compile; plain+compile's own against plain."""
    rates = {"plain": [100.0, 100.0, 100.0], "plain+compile": [150.0, 150.0, 150.0],
             "batched-K2": [90.0, 90.0, 90.0], "batched-K2+compile": [165.0, 165.0, 165.0]}
    legs = bench.with_compile_ab([bench.Leg("plain"), bench.Leg("mtp", "batched", 2)], True)
    records = {}
    for leg in legs:
        records[leg.name] = bench.LegRecord(leg)
        for r in rates[leg.name]:
            records[leg.name].runs.append({"tok_s": r, "ttft_s": 0.01})
    ratio = {name: bench.leg_summary(rec, records, tiny_target).get("vs_plain", {}).get("median")
             for name, rec in records.items()}
    assert ratio == {"plain": None, "plain+compile": pytest.approx(1.5), "batched-K2": pytest.approx(0.9),
                     "batched-K2+compile": pytest.approx(1.1)}


def test_compile_ab_twins_and_forced_path(monkeypatch):
    legs = [bench.Leg("stock"), bench.Leg("plain"), bench.Leg("mtp", "batched", 2)]
    ab = bench.with_compile_ab(legs, True)
    assert [leg.name for leg in ab] == ["stock", "plain", "plain+compile", "batched-K2", "batched-K2+compile"]
    assert [leg.compiled for leg in ab] == [None, False, True, False, True]
    seen = []

    def stream():
        for i in range(3):
            seen.append(compiled.enabled())
            yield i

    for env in ("0", "1"):
        monkeypatch.setenv("LATTICE_COMPILE", env)
        for forced, expected in ((True, True), (False, False), (None, env == "1")):
            seen.clear()
            bench.timed_run(stream(), (1, 3), compiled_path=forced)
            assert seen == [expected] * 3, (env, forced)
            assert compiled.enabled() == (env == "1")  # the user's setting again after the run


def test_trace_ab_twins_build_plain_steps_and_rounds_op_by_op(tiny_target):
    legs = [bench.Leg("stock"), bench.Leg("plain"), bench.Leg("plain-aa"), bench.Leg("mtp", "pipelined", 2),
            bench.Leg("mtp", "batched", 2)]
    ab = bench.with_trace_ab(legs, True)
    assert [leg.name for leg in ab] == ["stock", "plain", "plain+untraced", "plain-aa", "pipelined-K2",
                                        "pipelined-K2+untraced", "batched-K2"]
    model, ids = tiny_target.model, [3, 1, 4, 1, 5, 9, 2, 6]
    out = {}
    for leg in ab[1:3]:
        model.runtime.traces.pop("steps", None)
        stream, _ = bench.token_stream(tiny_target, leg, ids, 0.0, n_max=12, reference=None, seed=0)
        out[leg.name] = [t for t, _ in zip(stream, range(12))]
        assert bool(model.runtime.traces.get("steps")) == (leg.traced is None), leg.name
    assert out["plain"] == out["plain+untraced"]


FAKE_PROFILER = """
import contextlib


class Profile:
    def __init__(self, steps):
        self.steps = steps
        self.events = [{"cat": "kernel", "name": "qmv", "dur": 1.0}] * (2 * steps) + [{"cat": "memcpy", "dur": 1.0}]

    def summary(self, top=15):
        return {"kernels_per_step": 160.0, "kernel_us_per_step": 900.0, "busy_us_per_step": 950.0,
                "span_us_per_step": 1900.0, "top_kernels": []}


@contextlib.contextmanager
def kernel_profile(steps=1):
    yield Profile(steps)
"""


def test_decode_profile_columns(tmp_path):
    """--profile DIR: each leg gets kernels per token (per round for MTP), GPU us per token and span/busy."""
    (tmp_path / "gpu_kernels.py").write_text(FAKE_PROFILER)
    out = tmp_path / "out"
    assert bench.main(["decode", "--model", "tiny", "--reps", "1", "--lengths", "4,12", "--temps", "0", "--legs",
                       "plain,batched", "--k", "2", "--profile", str(tmp_path), "--out", str(out), "--no-stock",
                       "--lock", str(tmp_path / "lock")]) == 0
    legs = {s["leg"]: s for s in json.loads((out / "decode.json").read_text())["groups"][0]["legs"]}
    assert legs["plain"]["gpu_profile"]["kernels_per_step"] == 160.0
    mtp = legs["batched-K2-oracle0.8"]["gpu_profile"]
    assert mtp["rounds"] >= 1 and mtp["kernels_per_round"] == pytest.approx(160.0 * 12 / mtp["rounds"])
    assert legs["plain"]["gpu_profile"]["launches_by_kernel"] == {"qmv": 2.0}  # per token
    assert legs["plain"]["gpu_profile"]["us_by_kernel"] == {"qmv": 2.0}
    assert mtp["launches_by_kernel"] == {"qmv": pytest.approx(2 * 12 / mtp["rounds"], abs=0.01)}  # per round
    assert "kernels/tok" in (out / "decode.md").read_text()
    assert bench.main(["decode", "--model", "tiny", "--profile", str(tmp_path / "none"), "--out", str(out)]) == 1


def test_draft_vocab_ab_twins_run_with_the_subset_and_restore_it(tmp_path, monkeypatch):
    """--draft-vocab-ab N: each MTP leg gets a +dvN twin whose head drafts from ids 0..N-1 while it runs (drafts
    stay inside, output stays plain's); the head's own setting is back after every run."""
    from lattice_mlx.models.mtp import DraftVocab

    legs = bench.with_draft_vocab_ab([bench.Leg("plain"), bench.Leg("mtp", "batched", 2)], 16)
    assert [leg.name for leg in legs] == ["plain", "batched-K2", "batched-K2+dv16"]
    drafted, real = [], DraftVocab.to_full

    def spy(self, draft, q, vocab):
        token, q = real(self, draft, q, vocab)
        drafted.append(token.item())
        return token, q

    monkeypatch.setattr(DraftVocab, "to_full", spy)
    out = tmp_path / "dv"
    assert bench.main(["decode", "--model", "tiny", "--reps", "1", "--lengths", "4,12", "--temps", "0", "--legs",
                       "plain,batched", "--k", "2", "--no-stock", "--draft-vocab-ab", "16", "--out", str(out)]) == 0
    names = [leg["leg"] for leg in json.loads((out / "decode.json").read_text())["groups"][0]["legs"]]
    assert "batched-K2-oracle0.8+dv16" in names
    assert drafted and all(t < 16 for t in drafted)
    assert bench.main(["decode", "--model", "tiny", "--draft-vocab-ab", "0", "--out", str(out)]) == 1
    assert bench.main(["decode", "--model", "tiny", "--draft-vocab-ab", "100000", "--out", str(out)]) == 1


def test_head_q4_ab_twins_draft_with_the_4bit_head_and_restore_it(tmp_path, monkeypatch):
    """--head-q4-ab: each MTP leg gets a +headq4 twin whose drafts come from a 4-bit copy of the head while it runs
    (both verifiers; output stays plain's); the model's own head is back after every run."""
    from lattice_mlx.models.mtp import MTPHead

    legs = bench.with_head_q4_ab([bench.Leg("plain"), bench.Leg("mtp", "pipelined", 2)], True)
    assert [leg.name for leg in legs] == ["plain", "pipelined-K2", "pipelined-K2+headq4"]
    heads, real = [], MTPHead.__call__

    def spy(self, *a, **k):
        heads.append(type(self.fc).__name__)
        return real(self, *a, **k)

    monkeypatch.setattr(MTPHead, "__call__", spy)
    out = tmp_path / "hq"
    assert bench.main(["decode", "--model", "tiny", "--dtype", "float32", "--reps", "1", "--lengths", "4,12",
                       "--temps", "0", "--legs", "plain,batched,pipelined", "--k", "2", "--no-stock", "--head-q4-ab",
                       "--out", str(out)]) == 0
    legs = {leg["leg"]: leg for leg in json.loads((out / "decode.json").read_text())["groups"][0]["legs"]}
    for name in ("batched-K2-oracle0.8+headq4", "pipelined-K2-oracle0.8+headq4"):
        same, prompts = legs[name]["identical_to_plain"].split()[0].split("/")
        assert same == prompts != "0", (name, legs[name]["identical_to_plain"])
    assert {"Q4Linear", "Linear"} <= set(heads)  # both heads drafted

    class M:
        mtp = "own"

    model = M()
    stream = bench._head_during(model, "q4", iter(range(3)))
    assert next(stream) == 0 and model.mtp == "q4"
    stream.close()
    assert model.mtp == "own"


def test_timings_survive_a_run_stopped_while_profiling(tmp_path):
    """A run cut off during its profiling phase (the H200's 35B-A3B run hit its time limit there) still leaves its
    timings on disk: decode.partial.json, written before profiling; a complete run leaves only decode.json."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "gpu_kernels.py").write_text("def kernel_profile(steps=1):\n    raise KeyboardInterrupt\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lattice_mlx.bench", "decode", "--model", "tiny", "--reps", "1", "--lengths", "2,4",
           "--temps", "0", "--legs", "plain,batched", "--k", "1", "--oracle-p", "1", "--no-stock", "--out", str(out),
           "--lock", str(tmp_path / "lock")]
    proc = subprocess.run([*cmd, "--profile", str(tools)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 130, proc.stderr[-2000:]
    partial = json.loads((out / "decode.partial.json").read_text())
    legs = {leg["leg"]: leg for leg in partial["groups"][0]["legs"]}
    assert set(legs) == {"plain", "batched-K1-oracle1"}
    assert legs["batched-K1-oracle1"]["identical_to_plain"] == "1/1 prompts"
    assert not (out / "decode.json").exists()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "decode.json").exists() and not (out / "decode.partial.json").exists()


def test_adaptive_leg_warms_up_every_depth_it_may_reach(tmp_path, monkeypatch):
    """A verify shape's first use compiles it (seconds under CUDA), and an adaptive leg may reach any depth up to its
    K inside a timed run: its warm-up runs each fixed depth 1..K once before itself (run 12's adaptive legs had
    repetitions at 0.005-0.011x plain)."""
    seen, real = [], bench.token_stream

    def spy(target, leg, *a, **k):
        seen.append(leg.name)
        return real(target, leg, *a, **k)

    monkeypatch.setattr(bench, "token_stream", spy)
    assert bench.main(["decode", "--model", "tiny", "--dtype", "float32", "--reps", "1", "--lengths", "4,12",
                       "--temps", "0", "--legs", "plain,pipelined", "--k", "adaptive", "--no-stock",
                       "--out", str(tmp_path / "w")]) == 0
    warm = seen[: seen.index("pipelined-adaptive-oracle0.8") + 1]
    assert warm == ["plain", *[f"pipelined-K{k}-oracle0.8" for k in range(1, 5)], "pipelined-adaptive-oracle0.8"]


def test_fixed_and_adaptive_legs_compare_on_one_measure(tmp_path):
    """An adaptive leg's `x plain` is over the whole generation (its warm-up and decisions count), a fixed leg's over
    the slope; every leg also gets the whole-generation ratio, paired by repetition, and the report prints it beside
    the table when the group has an adaptive leg (run 21's docs set 1.88x slope against 1.43x whole)."""
    assert bench.main(["decode", "--model", "tiny", "--dtype", "float32", "--reps", "2", "--lengths", "4,12",
                       "--temps", "0", "--legs", "plain,plain-aa,pipelined", "--k", "2,adaptive", "--no-stock",
                       "--out", str(tmp_path / "w")]) == 0
    group = json.loads((tmp_path / "w" / "decode.json").read_text())["groups"][0]
    legs = {s["leg"]: s for s in group["legs"]}
    plain = [r["tok_s_whole"] for r in legs["plain"]["runs"]]
    for name in ("plain-aa", "pipelined-K2-oracle0.8", "pipelined-adaptive-oracle0.8"):
        whole = [r["tok_s_whole"] / p for r, p in zip(legs[name]["runs"], plain)]
        assert legs[name]["vs_plain_whole"]["median"] == pytest.approx(statistics.median(whole))
    assert "vs_plain_whole" not in legs["plain"]
    # the adaptive leg's table ratio is its whole-generation one; the fixed leg's is the slope's
    assert legs["pipelined-adaptive-oracle0.8"]["vs_plain"] == legs["pipelined-adaptive-oracle0.8"]["vs_plain_whole"]
    md = (tmp_path / "w" / "decode.md").read_text()
    k2 = legs["pipelined-K2-oracle0.8"]["vs_plain_whole"]["median"]
    assert "Over the whole generation (the adaptive legs' measure), x plain: plain-aa" in md
    assert f"pipelined-K2-oracle0.8 {k2:.2f}x" in md


def test_source_digest_names_the_code_on_disk(tmp_path):
    """The digest a result records changes with any byte or file name of the package, and not with caches."""
    import shutil

    from lattice_mlx.bench.report import PACKAGE, provenance, source_digest

    copy = tmp_path / "lattice_mlx"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digest = source_digest(copy)
    assert digest == source_digest(PACKAGE) == provenance()["src_sha256"] and digest.startswith("sha256:")
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "__pycache__" / "x.cpython.pyc").write_bytes(b"cache")
    assert source_digest(copy) == digest
    sample = copy / "sample.py"
    sample.write_text(sample.read_text() + " ")
    assert source_digest(copy) != digest
    sample.write_text(sample.read_text()[:-1])
    assert source_digest(copy) == digest
    sample.rename(copy / "sample2.py")
    assert source_digest(copy) != digest


def test_a_batchs_traced_step_and_round_launch_no_index_ops(tmp_path):
    """scripts/bench/graph_nodes.py --batch counts the graph a continuous batch's traced plain step and MTP round
    hold, with the kernels stood in (the GPU path's graph): their index arrays are constants of the trace
    (metal.iota), not mx.arange ops every replay launches (batch run 4: 54.8 per round); their greedy picks (the
    step's token, the round's drafts and the verify's targets) are the package's argmax kernel, not MLX's arg_reduce
    (28-40 us per 16 rows in batch run 8's round, three drafts and the verify); and a round over two sequences holds
    the head's and the verify's kernels."""
    out = tmp_path / "nodes.json"
    cmd = [sys.executable, "scripts/bench/graph_nodes.py", "--shape", "tiny", "--batch", "1,2", "--k", "2",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = json.loads(out.read_text())["batch"]
    assert set(counts) == {"1", "2"}
    for row in counts.values():
        for graph in row.values():
            assert graph["by_primitive"].get("Arange", 0) == 0, graph["by_primitive"]
            assert graph["by_primitive"].get("ArgReduce", 0) == 0, graph["by_primitive"]
        assert row["round_k2"]["by_primitive"]["CustomKernel"] > row["step"]["by_primitive"]["CustomKernel"] > 0


def test_an_archived_result_is_drawn_again_and_anything_else_is_one_line(tmp_path, capsys):
    """The archive drops superseded runs' plots for the tree's size and keeps their JSON: `python -m
    lattice_mlx.bench.report` draws the plot again, the same bars as the run drew (here against one it kept), and a
    file that is no benchmark result is one line and exit 2."""
    import gzip
    import importlib.util

    from lattice_mlx.bench import report

    kept = Path(__file__).parents[2] / "docs/results/archive/h200/run19/final_10681fd"
    (tmp_path / "bad.json").write_text('{"groups": 3}')
    (tmp_path / "text.json.gz").write_bytes(gzip.compress(b"not json"))
    for bad in ("bad.json", "text.json.gz", "missing.json"):
        assert report.main([str(tmp_path / bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"report: {tmp_path / bad}: cannot draw it")
    if not importlib.util.find_spec("matplotlib"):
        pytest.skip("matplotlib (the bench extra) is not installed")
    import numpy as np
    from PIL import Image

    assert report.main([str(kept / "decode.json.gz"), "--out", str(tmp_path / "plots")]) == 0
    drawn = np.asarray(Image.open(tmp_path / "plots/decode_tok_s.png").convert("RGB"), dtype=int)
    archived = np.asarray(Image.open(kept / "decode_tok_s.png").convert("RGB"), dtype=int)
    assert drawn.shape == archived.shape
    assert (np.abs(drawn - archived).max(axis=2) > 40).mean() < 1e-3  # (anti-aliasing apart)
