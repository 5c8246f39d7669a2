"""Tree GDN: every root-to-leaf path equals the chain recurrence run along it (all backends); on a GPU the kernel
equals `gated_delta_tree_ref` over tree shapes x heads x head dims x dtypes, with NaN-poisoned outputs."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from _tol import assert_close, out_key
from test_dialect import assert_nvcc_compiles, assert_render_is_syntax_shaped, cuda_translation_unit
from test_gated_delta import make_inputs

from lattice_mlx.metal import use_kernels
from lattice_mlx.metal.gated_delta import gated_delta_kernel, gated_delta_ref, gated_delta_tree_ref
from lattice_mlx.metal.gated_delta_tree import _BODY, gated_delta_tree, gated_delta_tree_kernel
from lattice_mlx.speculative import parse_tree

needs_gpu = pytest.mark.kernels  # a GPU backend, or the CPU render (tests/conftest.py)


def drafter_parents(spec: str) -> list[int]:
    """Parents in TreeDrafter's node order (node 0 = y; a node's children are numbered, then each is expanded)."""
    shape, parents = parse_tree(spec), [-1]

    def expand(node: int, depth: int) -> None:
        children = []
        for _ in range(shape[depth]):
            parents.append(node)
            children.append(len(parents) - 1)
        if depth + 1 < len(shape):
            for c in children:
                expand(c, depth + 1)

    expand(0, 0)
    return parents


def random_parents(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]


TREES = {
    "chain5": [-1, 0, 1, 2, 3],
    "drafter-2-2-1": drafter_parents("2-2-1"),
    "star6": [-1, 0, 0, 0, 0, 0],
    "forest": [-1, 0, -1, 2, 0, -1, 1],  # several nodes restart from the committed state
    "random13": random_parents(13, seed=4),
}


def test_drafter_layout():
    assert drafter_parents("2-2-1") == [-1, 0, 0, 1, 1, 3, 4, 2, 2, 7, 8]


def root_to_leaf_paths(parents: list[int]) -> list[list[int]]:
    leaves = set(range(len(parents))) - set(parents)
    paths = []
    for leaf in sorted(leaves):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


# --- the dispatcher against the chain recurrence: runs everywhere (the kernel on a GPU, the reference elsewhere) ---


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tree", list(TREES))
def test_every_path_equals_the_chain_recurrence(tree, dtype):
    parents = TREES[tree]
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(2, len(parents), 2, 4, 64, 32, dtype, seed=len(tree))
    y, states = gated_delta_tree(q, k, v, a, b, A_log, dt_bias, state, parents)
    assert y.dtype == dtype and states.dtype == mx.float32 and states.shape == (2, len(parents), 4, 32, 64)
    for path in root_to_leaf_paths(parents):
        idx = mx.array(path)
        y_p, s_p = gated_delta_ref(*(x[:, idx] for x in (q, k, v, a, b)), A_log, dt_bias, state, step_states=True)
        assert_close(y[:, idx], y_p, out_key(dtype), f"{tree} y along {path}")
        assert_close(states[:, idx], s_p, "fp32", f"{tree} states along {path}")


def test_none_state_is_zeros():
    q, k, v, a, b, A_log, dt_bias, _ = make_inputs(1, 7, 1, 2, 32, 8, mx.float32, with_state=False)
    parents = TREES["forest"]
    y0, s0 = gated_delta_tree(q, k, v, a, b, A_log, dt_bias, None, parents)
    y1, s1 = gated_delta_tree(q, k, v, a, b, A_log, dt_bias, mx.zeros((1, 2, 8, 32)), parents)
    assert_close(y0, y1, "same", "y")
    assert_close(s0, s1, "same", "states")


def test_dispatch_uses_reference_when_forced(monkeypatch):
    monkeypatch.setenv("LATTICE_KERNELS", "ref")
    assert not use_kernels()
    inputs = make_inputs(1, 11, 2, 2, 32, 8, mx.bfloat16)
    parents = TREES["drafter-2-2-1"]
    y, s = gated_delta_tree(*inputs, parents)
    y_ref, s_ref = gated_delta_tree_ref(*inputs, parents)
    assert mx.array_equal(y, y_ref) and mx.array_equal(s, s_ref)


def test_kernel_rejects_a_parent_that_is_not_earlier():
    inputs = make_inputs(1, 3, 1, 1, 32, 8, mx.float32)
    with pytest.raises(AssertionError, match="parents"):
        gated_delta_tree_kernel(*inputs, [-1, 2, 0])


# --- the body renders to both dialects (and compiles for sm_90 where nvcc exists) ---


@pytest.mark.parametrize("dialect", ["metal", "cuda"])
def test_tree_body_renders(dialect):
    assert_render_is_syntax_shaped(_BODY, dialect)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on the PATH")
def test_tree_cuda_render_compiles(tmp_path):
    bf = "__nv_bfloat16"
    ins = [(n, bf) for n in "qkvab"] + [("A_log", "float"), ("dt_bias", bf), ("state_in", "float")]
    unit = cuda_translation_unit(
        _BODY,
        [*ins, ("parents", "int32_t")],
        [("y", bf), ("state_out", "float")],
        [("YT", bf), ("Hk", 2), ("Hv", 4), ("Dk", 128), ("Dv", 64)],
    )
    assert_nvcc_compiles(unit, tmp_path, "gated_delta_tree")


# --- the GPU kernel against the reference ---

HEADS = {"Hk=Hv": (2, 2), "Hv=2Hk": (2, 4)}
DIMS = {"Dk64-Dv64": (64, 64), "Dk128-Dv128": (128, 128), "Dk64-Dv128": (64, 128), "Dk128-Dv64": (128, 64)}
DTYPES = {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}


@needs_gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("tree", list(TREES))
def test_kernel_matches_ref(tree, heads, dims, dtype):
    parents, (Hk, Hv), (Dk, Dv), dt = TREES[tree], HEADS[heads], DIMS[dims], DTYPES[dtype]
    inputs = make_inputs(2, len(parents), Hk, Hv, Dk, Dv, dt, seed=len(parents) + Dk + Hv)
    y, s = gated_delta_tree_kernel(*inputs, parents, init_value=float("nan"))
    y_ref, s_ref = gated_delta_tree_ref(*inputs, parents)
    assert y.dtype == dt and s.dtype == mx.float32 and s.shape == s_ref.shape
    assert_close(y, y_ref, out_key(dt), f"{tree} y")
    assert_close(s, s_ref, "fp32", f"{tree} states")


@needs_gpu
@pytest.mark.parametrize("spec", ["2-2-1", "4-2-2", "1-1-1-1-1-1-1"])
def test_kernel_qwen_shapes(spec):
    """Qwen3.5's GDN heads (16 key, 32 value, 128 x 128) in bf16 with the drafter's trees; parents passed as
    an int32 array, as a caller holding one would."""
    parents = drafter_parents(spec)
    inputs = make_inputs(1, len(parents), 16, 32, 128, 128, mx.bfloat16, seed=11)
    y, s = gated_delta_tree_kernel(*inputs, mx.array(parents, dtype=mx.int32), init_value=float("nan"))
    y_ref, s_ref = gated_delta_tree_ref(*inputs, parents)
    assert_close(y, y_ref, "bfloat16", f"{spec} y")
    assert_close(s, s_ref, "fp32", f"{spec} states")


@needs_gpu
def test_kernel_chain_equals_chain_kernel():
    """A chain runs the serial chain kernel's arithmetic with no reload, so it matches its per-step states."""
    inputs = make_inputs(2, 9, 2, 4, 128, 128, mx.float32, seed=2)
    y, s = gated_delta_tree_kernel(*inputs, list(range(-1, 8)), init_value=float("nan"))
    y_c, s_c = gated_delta_kernel(*inputs, step_states=True, form="serial")
    assert_close(y, y_c, "same", "y")
    assert_close(s, s_c, "same", "states")


@needs_gpu
def test_kernel_long_random_tree():
    """64 nodes with parents anywhere earlier: reloads from far back and from the committed state."""
    parents = random_parents(64, seed=8)
    inputs = make_inputs(2, 64, 2, 4, 128, 128, mx.float32, seed=8)
    y, s = gated_delta_tree_kernel(*inputs, parents, init_value=float("nan"))
    y_ref, s_ref = gated_delta_tree_ref(*inputs, parents)
    assert_close(y, y_ref, "fp32", "y")
    assert_close(s, s_ref, "fp32", "states")
