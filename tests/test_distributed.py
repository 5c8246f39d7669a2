"""Tensor parallel on the CPU over MLX's ring backend: two local processes under `mlx.launch -n 2` (tests/dist_worker.py
runs in each), the sharded model against the whole one loaded in the same process."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lattice_mlx.bench.synthetic import random_checkpoint
from lattice_mlx.convert import convert

WORKER = Path(__file__).with_name("dist_worker.py")
pytestmark = pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="mlx.launch is not on the PATH")


def free_port() -> int:
    """A starting port for the ring backend (it listens on this one and the next) that nothing else holds now:
    two launches on the default port at once (parallel test runs) would join each other's rings."""
    import socket

    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


def launch(*cmd, timeout=120):
    return subprocess.run(["mlx.launch", "-n", "2", "--backend", "ring", "--starting-port", str(free_port()),
                           sys.executable, *map(str, cmd)], capture_output=True, text=True, timeout=timeout)


def read_ranks(out, res) -> list[dict]:
    missing = [r for r in range(2) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote nothing: {res.stdout[-1500:]} {res.stderr[-1500:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    # wide enough that the decoder layers, not the replicated embedding and MTP head, hold most of the weights
    dense = random_checkpoint(root / "dense", seed=0, hidden_size=256, intermediate_size=1024)
    return {"fp32": dense, "q4": convert(str(dense), str(root / "q4"), quantize_bits=4, group_size=32),
            "moe": random_checkpoint(root / "moe", seed=5, num_experts=4)}


@pytest.mark.parametrize("kind", ["fp32", "q4", "moe"])
def test_two_ranks_match_one_process(ckpts, kind, tmp_path):
    """A rank's load peaks below the whole model's size; logits and every layer match the whole model up to
    summation order; greedy plain and greedy MTP
    give the same tokens (K=3); sampled plain and sampled MTP give the one-process run's tokens on both ranks, although
    rank 1 is seeded differently: tokens and accept/reject verdicts come from rank 0, so no rank can drift."""
    res = launch(WORKER, ckpts[kind], tmp_path, *(["mtp-sharded-too"] if kind == "fp32" else []))
    ranks = read_ranks(tmp_path, res)
    for r in ranks:
        assert r["size"] == 2 and "load_error" not in r, (r, res.stderr[-2000:])
        assert r["worst_layer_rel_diff"] < 2e-6, r  # measured ~3e-7: fp32 partial sums added in another order
        assert r["mtp_params"] == r["whole_mtp_params"] and r["mtp_rel_diff"] == 0.0, r  # replicated by default
        # random checkpoints amplify (gain 2, 4 layers): ~1.5e-5 relative at the logits, measured
        assert r["max_logit_diff"] <= 1e-4 * r["max_logit"], r
        assert r["greedy_k0"] and r["greedy_k3"], r
        assert r["sampled_equal_one_process"] and r["plain_sampled_equal"], r
        assert r["adaptive_equal_plain"], r  # adaptive K with rank 1's clock jittered: no deadlock, plain's tokens
        if kind == "fp32":  # a rank's loading peak stays below what the whole model holds once loaded
            assert r["load_peak_bytes"] < r["whole_bytes"], r
            # mtp="sharded": the head's layer split too: fewer head parameters per rank, the head's output equal
            # up to summation order, greedy and sampled MTP (rank 1 seeded differently) as one process
            assert r["mtp_sharded_params"] < r["whole_mtp_params"] and r["mtp_sharded_rel_diff"] < 2e-6, r
            assert r["mtp_sharded_greedy_k3"] and r["mtp_sharded_sampled_equal"], r
    assert ranks[0]["sampled_tokens"] == ranks[1]["sampled_tokens"]


def test_pipeline_stages_hold_their_layers_and_match_one_process(ckpts, tmp_path):
    """--pipeline: each of the two stages reads and holds only its two layers of four; logits are bitwise the whole
    model's (the same arithmetic, moved between processes); tokens as in the tensor-parallel test. Both hand-off
    transports: send/recv (ring, JACCL: the CPU default) and the all_sum form MLX's CUDA backend gets (its NCCL has
    no send/recv), loaded again in the same processes."""
    res = launch(WORKER, ckpts["q4"], tmp_path, "pipeline")
    ranks = read_ranks(tmp_path, res)
    for r in ranks:
        assert "load_error" not in r, (r, res.stderr[-2000:])
        assert r["held_layers"] == 2 and r["held_params"] < r["whole_params"], r
        assert r["transport"] == "sendrecv" and r["collective_transport"] == "collective", r
        assert r["collective_max_logit_diff"] == 0.0 and r["collective_greedy_k3"], r
        assert r["load_peak_bytes"] < r["whole_bytes"], r  # the other stage's layers are never read
        assert r["max_logit_diff"] == 0.0, r
        assert r["greedy_k0"] and r["greedy_k3"], r
        assert r["sampled_equal_one_process"] and r["plain_sampled_equal"], r


def test_pipeline_with_more_ranks_than_layers_is_one_line(tmp_path):
    one = random_checkpoint(tmp_path / "one", seed=2, num_hidden_layers=1)
    res = launch("-m", "lattice_mlx.generate", "--model", one, "--prompt", "hi", "--max-tokens", "4", "--pipeline")
    errors = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "every rank needs at least one layer" in errors[0], res
    assert "Traceback" not in res.stdout + res.stderr


def test_split_models_refuse_what_would_let_ranks_diverge(ckpts):
    """Trees, the sequential verifier and self-speculation take decisions on each rank: refused, in the API too
    (a stand-in group: the checks happen before any collective)."""
    from lattice_mlx import SpecOptions, generate, load

    model, tok = load(ckpts["fp32"])
    model.sharding_group = object()
    for spec, words in ((SpecOptions(tree="2-1"), "--tree"), (SpecOptions(verify="sequential"), "--verify"),
                        (SpecOptions(draft="self"), "--draft self")):
        with pytest.raises(ValueError, match=words):
            generate(model, tok, [1, 2, 3], max_tokens=4, speculation=spec)


def test_group_size_not_dividing_the_heads_is_one_line(tmp_path):
    bad = random_checkpoint(tmp_path / "bad", seed=2, linear_num_key_heads=1, linear_num_value_heads=4)
    res = launch("-m", "lattice_mlx.generate", "--model", bad, "--prompt", "hi", "--max-tokens", "4")
    errors = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "linear_num_key_heads = 1 is not divisible by the group size 2" in errors[0], res
    assert "Traceback" not in res.stdout + res.stderr


def test_cli_prints_once_and_matches_one_process(ckpts):
    args = ["-m", "lattice_mlx.generate", "--model", ckpts["fp32"], "--prompt", "hi", "--max-tokens", "12", "--mtp",
            "--draft-tokens", "2", "--no-adaptive", "--json"]
    res = launch(*args)
    one = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, res.stdout
    assert lines[0]["tokens"] == json.loads(one.stdout.splitlines()[-1])["tokens"]


def test_distributed_bench_runs_tensor_parallel_in_lockstep(tmp_path):
    """scripts/bench/bench_distributed.py over two ring ranks (what gpu_run.sh distributed runs over NCCL): both ranks
    time the same legs, hold less than the whole model, and the MTP leg gives plain's greedy tokens."""
    bench = Path(__file__).parents[1] / "scripts" / "bench" / "bench_distributed.py"
    res = launch(bench, "--shape", "tiny", "--mode", "tensor", "--dist-backend", "ring", "--group-size", "32",
                 "--reps", "1", "--lengths", "2,4", "--prompt-tokens", "8", "--out", tmp_path, timeout=180)
    ranks = read_ranks(tmp_path, res)
    whole = subprocess.run([sys.executable, str(bench), "--shape", "tiny", "--mode", "single", "--group-size", "32",
                            "--build-only", "--out", str(tmp_path / "one")],
                           capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0, whole.stderr[-2000:]
    one = json.loads((tmp_path / "one" / "rank0.json").read_text())
    for r in ranks:
        assert r["size"] == 2 and r["backend"] == "ring", r
        assert r["held_gb"] < one["held_gb"], (r, one)
        legs = {leg["leg"]: leg for leg in r["legs"]}
        assert set(legs) == {"plain", "plain-aa", "batched-K2-oracle0.8"}, legs
        assert legs["batched-K2-oracle0.8"]["identical_to_plain"] == "1/1 prompts", legs
