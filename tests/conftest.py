import os

# MLX runs fp32 matmuls as TF32 on CUDA (and on Apple M5-class GPUs) unless this is 0; set before MLX is imported.
# The equivalence tests compare fp32 paths and want fp32 arithmetic. No effect on the CPU backend.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# The traced and compiled paths are what a GPU runs by default, and the suite holds them to the paths built op by op
# on every backend: on here too, where the CPU default is off (settings.GPU_ONLY; the test of that default unsets
# them). Subprocesses the tests start inherit them.
os.environ.setdefault("LATTICE_COMPILE", "1")
os.environ.setdefault("LATTICE_TRACE_STEPS", "1")
os.environ.setdefault("LATTICE_TRACE_ROUNDS", "1")

import re
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

from lattice_mlx.bench.synthetic import random_checkpoint
from lattice_mlx.metal import cpu_render, use_kernels

CONFIGS = {
    "tied": dict(seed=0),
    "untied": dict(seed=1, tie_word_embeddings=False),
    # Hv = 4 Hk, attention first, and a pattern that is not the 3:1 default.
    "pattern": dict(seed=2, num_hidden_layers=5, linear_num_key_heads=1, linear_num_value_heads=4,
                    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                 "linear_attention"]),
}


# Loaded by each Python process a test starts: the child runs as on a machine without torch, as a Mac with mlx and
# mlx-lm alone would. This package never imports torch; transformers (which mlx-lm's tokenizer module imports) imports
# it wherever it is installed: about 2 s of every CLI process the suite starts on this repository's CPU.
_CHILD_SITE = 'import sys\n\nsys.modules.setdefault("torch", None)  # (import torch fails; find_spec says None)\n'


def pytest_configure(config):
    """Puts a folder holding _CHILD_SITE's sitecustomize.py first on PYTHONPATH for the processes the tests start.
    The suite's own processes keep torch (the HF reference tests): an xdist controller sets nothing, since its
    workers inherit its environment; a worker, or a run without workers, sets it for its tests' children."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        return
    site = tempfile.mkdtemp(prefix="lattice-child-site-")
    Path(site, "sitecustomize.py").write_text(_CHILD_SITE)
    config.add_cleanup(lambda: shutil.rmtree(site, ignore_errors=True))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(params=["compiled", "layers"])
def compile_mode(request, monkeypatch):
    """Runs a test on both decode/verify paths: the compiled default and LATTICE_COMPILE=0 (layer by layer)."""
    monkeypatch.setenv("LATTICE_COMPILE", "1" if request.param == "compiled" else "0")
    return request.param


@pytest.fixture
def on_cpu():
    """Runs a test on MLX's CPU device (float64, or behaviour specific to the CPU backend) wherever the suite runs;
    on a GPU machine the default device is the GPU."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: random_checkpoint(root / name, **kw) for name, kw in CONFIGS.items()}


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def checkpoint(request, checkpoints):
    return checkpoints[request.param]


@pytest.fixture(scope="session")
def no_mtp_checkpoint(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("ckpt") / "nomtp", seed=3, mtp=False)


def load_script(relpath: str):
    """A script of this repository (scripts/<relpath>) imported as a module, for tests of its functions."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_env() -> dict:
    """The environment of a script a test runs as a child: this checkout's src/ first on PYTHONPATH, the rest of it
    (pytest_configure's folder among it) kept."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    """The first n tokens of plain greedy decoding (decode.generate_step) after `prompt`."""
    import mlx.core as mx

    from lattice_mlx.decode import generate_step
    from lattice_mlx.sample import Sampler

    out = []
    for t in generate_step(model, mx.array(prompt), sampler=Sampler()):
        out.append(int(t))
        if len(out) == n:
            return out


def two_token_pvalue(model, prompt: list[int], sampler, speculative, *, trials: int = 300) -> float:
    """Chi-square p-value that the first two tokens of `speculative() -> tokens` follow plain sampling (its exact
    joint, `exact_plain_joint`); trial i seeds MLX's generator with 500,000 + i."""
    import mlx.core as mx

    samples = []
    for i in range(trials):
        mx.random.seed(500_000 + i)
        samples.append(tuple(speculative()[:2]))
    return fit_pvalues(exact_plain_joint(model, prompt, 2, sampler), samples, ((0, 1),))[(0, 1)]


def exact_plain_joint(model, prompt: list[int], n: int, sampler):
    """The exact distribution of plain sampling's first n tokens after `prompt`, [V] * n (float64): one forward over
    every continuation of n - 1 tokens (V ** (n - 1) rows; a vocabulary of 8 and n = 5 is 4,096 rows), each
    position's `sampler.probs` chained. A statistical test against it needs no sampled plain runs, and has about
    twice the power of a two-sample test at the same number of speculative runs."""
    import itertools

    import numpy as np

    V = model.args.vocab_size
    rows = np.array(list(itertools.product(range(V), repeat=n - 1)), dtype=np.int32).reshape(-1, n - 1)
    ids = np.concatenate([np.broadcast_to(np.array(prompt, np.int32), (len(rows), len(prompt))), rows], axis=1)
    logits = model(mx.array(ids), model.make_cache())[:, len(prompt) - 1 :]
    p = np.array(sampler.probs(logits.astype(mx.float32)), dtype=np.float64)  # [rows, n, V]
    prefix = np.prod(p[np.arange(len(rows))[:, None], np.arange(n - 1)[None], rows], axis=1)
    joint = prefix[:, None] * p[:, n - 1]
    return (joint / joint.sum()).reshape((V,) * n)


def fit_pvalues(joint, samples, groups, min_expected: float = 5.0) -> dict:
    """Chi-square goodness-of-fit p-values of sampled tuples (`samples`, each indexing `joint`'s axes) against the
    exact `joint`, one per group of positions (its marginal); cells expected fewer than `min_expected` times are
    pooled into one."""
    import numpy as np
    from scipy.stats import chisquare

    s, out = np.array(samples), {}
    for idx in groups:
        marginal = joint.sum(axis=tuple(i for i in range(joint.ndim) if i not in idx))
        observed = np.zeros(marginal.size)
        np.add.at(observed, np.ravel_multi_index(tuple(s[:, i] for i in idx), marginal.shape), 1)
        expected = marginal.reshape(-1) * len(s)
        if observed[expected == 0].any():  # an outcome plain sampling never gives (top-k, top-p) was drawn
            out[idx] = 0.0
            continue
        small = expected < min_expected
        o, e = observed[~small], expected[~small]
        if expected[small].sum() > 0:
            o, e = np.append(o, observed[small].sum()), np.append(e, expected[small].sum())
        out[idx] = chisquare(o, e)[1]
    return out


@pytest.fixture(scope="session")
def tiny_vocab_model(tmp_path_factory):
    """Vocabulary 8, so that two-token outcomes can be counted exhaustively."""
    from lattice_mlx.load import load

    path = random_checkpoint(tmp_path_factory.mktemp("tiny") / "v8", seed=6, vocab_size=8, hidden_size=32,
                             intermediate_size=64, num_hidden_layers=4)
    return load(path)[0]


def logit_bound(ref, gpu_rel: float = 1e-5) -> float:
    """The bound of an fp32 logits comparison against another implementation (mlx-lm) of the same checkpoint: 1e-5
    on the CPU, where both run MLX's ops (the difference is 0 there). On a GPU this project's kernels sum in another
    order than mlx-lm's ops, so `gpu_rel` x max |logit| (H200 run 14: 1.2e-5 to 6.7e-5 at max |logit| ~16 dense,
    up to 6.0e-4 MoE); a wrong layer is off by O(1)."""
    if mx.default_device() == mx.cpu:
        return 1e-5
    return max(1e-5, gpu_rel * mx.abs(ref).max().item())


def mlx_lm_logit_error(path, ids: list[int], gpu_rel: float = 1e-5) -> tuple[float, float]:
    """(max |logits| difference between this package's model and mlx-lm's own load of the same checkpoint, the
    bound `logit_bound` allows)."""
    import mlx_lm

    from lattice_mlx.load import load

    ref_model, _ = mlx_lm.load(str(path))
    model, _ = load(path)
    x = mx.array([ids])
    ref = ref_model(x)
    return mx.abs(model(x) - ref).max().item(), logit_bound(ref, gpu_rel)


def hf_reference_logits(path, ids: list[int]):
    """Logits of HF transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (by the checkpoint's config) on the
    checkpoint's weights, mtp.* left out: (float64, float32)."""
    import json

    import mlx.core as mx
    import numpy as np

    torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0")
    import transformers

    cfg = json.loads((path / "config.json").read_text())["text_config"]
    family = "Qwen3_5Moe" if cfg.get("num_experts") else "Qwen3_5"
    hf = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}TextConfig")(**cfg)).eval()
    if cfg.get("num_experts"):
        hf.set_experts_implementation("eager")  # the grouped-mm path has no float64
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path / "model.safetensors")).items()}
    state = {k.replace("model.language_model.", "model."): torch.from_numpy(v)
             for k, v in weights.items() if not k.startswith("mtp.")}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        fp32 = hf(torch.tensor([ids])).logits.numpy()
        return hf.double()(torch.tensor([ids])).logits.numpy(), fp32


def pytest_terminal_summary(terminalreporter):
    """The Metal source check's count (tests/metal/test_metal_sources.py records it per config)."""
    counts, kernels = {}, set()
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        props = dict(getattr(report, "user_properties", ()))
        if "metal_variants" in props:
            counts[report.nodeid] = props["metal_variants"]
            kernels.update(props.get("metal_kernels", ()))
    if counts:
        terminalreporter.write_line(
            f"Metal sources: {sum(counts.values())} kernel variants over {len(counts)} model configs ({len(kernels)} "
            "kernels) compiled against tests/metal/metal_shim.h")


# --- kernel tests (tests/metal): where they run ---
# Where kernel tests run. A test marked `kernels` runs on a GPU backend (Metal or CUDA), or on any machine with
# LATTICE_KERNELS=cpu (the CPU render: lattice_mlx/metal/cpu_render.py). Without either, the tests listed in
# CPU_RENDER still run, through the CPU render: small shapes of every kernel, each dtype, T = 1 and odd T, more value
# heads than key heads, per-step states, picks, trees, splits. The rest skip there.
GPU = use_kernels()  # as the run's environment has it (LATTICE_KERNELS=cpu: every kernel test on the render)
# (file, test id pattern): the kernel tests the CPU render runs where there is no GPU, ~1 s each
CPU_RENDER = [
    ("test_gated_delta.py", "test_kernel_matches_ref[oddT7-B2-Hv2Hk-fp32-*]"),
    ("test_gated_delta.py", "test_kernel_matches_ref[oddT7-B2-Hv2Hk-steps-fp16-serial]"),
    ("test_gated_delta.py", "test_kernel_matches_ref[T3-Hv3Hk-Dk64-Dv128-steps-fp32-serial]"),
    ("test_gated_delta.py", "test_kernel_none_state_and_dispatch"),
    ("test_gated_delta.py", "test_conv_kernel_matches_ref[verify-T9-Hv2Hk-fp32]"),
    ("test_gated_delta.py", "test_conv_kernel_matches_ref[T15-Dk64-fp16]"),
    ("test_gated_delta.py", "test_conv_kernel_rows_per_warp_change_no_result[*]"),
    ("test_gated_delta.py", "test_conv_kernel_reads_the_picked_window_and_state_in_place[2-fp32]"),
    ("test_gated_delta.py", "test_conv_kernel_reads_each_sequences_pick_in_place[steps1-bf16]"),
    ("test_gated_delta.py", "test_conv_kernel_reads_packed_projection_in_place[bf16-4-record]"),
    ("test_gated_delta_tree.py", "test_kernel_matches_ref[drafter-2-2-1-Hv=2Hk-Dk64-Dv128-bf16]"),
    ("test_gated_delta_tree.py", "test_kernel_matches_ref[random13-Hv=2Hk-Dk64-Dv128-fp32]"),
    ("test_q4_matmul.py", "test_kernel_matches_ref[M2-g32-fp32]"),
    ("test_q4_matmul.py", "test_kernel_matches_ref[M5-g32-bf16]"),
    ("test_q4_matmul.py", "test_kernel_matches_ref[M1-g128-bf16]"),
    ("test_q4_matmul.py", "test_fused_kernel_matches_ref[residual-gated_rms-M8-K1024-fp32]"),
    ("test_q4_matmul.py", "test_fused_kernel_matches_ref[plain-gate-M4-K512-fp16]"),
    ("test_q4_matmul.py", "test_fused_kernel_matches_ref[residual-rms-M1-K1024-bf16]"),
    ("test_q4_matmul.py", "test_fused_kernel_matches_ref[plain-swiglu-M8-K256-fp32]"),
    ("test_q4_matmul.py", "test_glu_kernel_matches_ref[rms-M3-bf16]"),
    ("test_q4_matmul.py", "test_kernel_any_rows_per_block[R=2]"),
    ("test_q4_matmul.py", "test_row_capacity_changes_no_result[gated_rms-plain]"),
    ("test_q4_matmul.py", "test_row_capacity_changes_no_result[gate-plain]"),
    ("test_q4_matmul.py", "test_row_capacity_changes_no_result[rms-glu]"),
    ("test_q4_matmul.py", "test_sixteen_rows_match_the_ref_and_each_row_its_one_row_call[*]"),
    ("test_dense_matmul.py", "test_kernel_matches_spec[M2-fp16]"),
    ("test_dense_matmul.py", "test_fused_kernel_matches_ref[residual-gated_rms-M1-bf16]"),
    ("test_dense_matmul.py", "test_glu_kernel_matches_ref[rms-M4-fp16]"),
    ("test_dense_matmul.py", "test_sixteen_rows_match_the_spec_and_each_row_its_one_row_call[*]"),
    ("test_attention.py", "test_kernel_matches_ref[T1-L7-D64-8q2kv-bf16-full]"),
    ("test_attention.py", "test_kernel_matches_ref[T5-L100-D128-4q4kv-fp16-causal]"),
    ("test_attention.py", "test_kernel_any_split_count[T5-3]"),
    ("test_attention.py", "test_kernel_any_split_count[T5-64]"),
    ("test_attention.py", "test_kernel_is_batch_invariant[short-bf16]"),
    ("test_q4_embedding.py", "test_kernel_is_bitwise_mlx_lookup[shape3-32-*]"),
    ("test_q4_embedding.py", "test_kernel_takes_unsigned_ids"),
    ("test_rms_pair.py", "test_kernel_matches_ref[shape0-*]"),
    ("test_rms_pair.py", "test_pre_kernel_matches_ref[shape1-dtype1]"),
    ("test_qk_norm_rope.py", "test_kernel_matches_ref[D64-r64-T1-fp32]"),
    ("test_qk_norm_rope.py", "test_kernel_matches_ref[D128-r32-T9-bf16]"),
    ("test_qk_norm_rope.py", "test_kernel_matches_ref[D256-r64-T4-fp16]"),
    ("test_qk_norm_rope.py", "test_kernel_array_offset_and_batch_invariance"),
    ("test_argmax.py", "test_kernel_matches_mlx_argmax[True-shape3-*]"),
    ("test_argmax.py", "test_kernel_matches_mlx_argmax[False-shape1-dtype0]"),
    ("test_argmax.py", "test_kernel_rows_of_minus_infinity_and_a_single_maximum_at_the_end"),
    ("test_fallback.py", "*"),
    ("test_batched.py", "test_the_gdn_kernel_reads_each_rows_pick_and_every_sequence_stays_exact"),
]


def _matches(item, f: str, pattern: str) -> bool:
    """The item is test `pattern` of file `f` (`*` matches anything; brackets are literal)."""
    return item.path.name == f and re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), item.name) is not None


def _selected(item) -> bool:
    return any(_matches(item, f, pattern) for f, pattern in CPU_RENDER)


def pytest_collection_modifyitems(config, items):
    """Marks the CPU_RENDER tests; a pattern of a collected file that matches nothing is an error (a renamed test
    would otherwise drop out of the CPU run unnoticed)."""
    files = {item.path.name for item in items}
    for f, pattern in CPU_RENDER:
        if f in files and not any(_matches(item, f, pattern) for item in items):
            raise pytest.UsageError(f"tests/conftest.py CPU_RENDER: {f}::{pattern} matches no test")
    for item in items:
        if _selected(item):
            item.add_marker("cpu_render")


@pytest.fixture(autouse=True)
def kernel_backend(request, monkeypatch):
    if request.node.get_closest_marker("kernels") is None or GPU:
        return
    if request.node.get_closest_marker("cpu_render") is None:
        pytest.skip("a kernel test: needs an MLX GPU backend, or LATTICE_KERNELS=cpu (the CPU render)")
    if not cpu_render.available():
        pytest.skip("the CPU render needs a C++ compiler")
    monkeypatch.setenv("LATTICE_KERNELS", "cpu")
