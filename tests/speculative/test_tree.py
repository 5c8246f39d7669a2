"""Tree verification: exact greedy, the tree GDN recurrence equals each path run alone, KV compaction equals
recomputation, and tree sampling keeps the plain distribution."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import two_token_pvalue

from lattice_mlx import cache as caches
from lattice_mlx import generate, load
from lattice_mlx.bench.oracles import OracleTreeDrafter
from lattice_mlx.decode import generate_step, prefill
from lattice_mlx.metal.gated_delta import gated_delta_ref, gated_delta_tree_ref
from lattice_mlx.models.tree import Tree
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import SpecOptions, SpecStats, parse_tree
from lattice_mlx.speculative.tree import run_tree

PROMPT = [5, 9, 33, 21, 7, 100]
PARENTS = (-1, 0, 0, 1, 1, 2, 3)  # root y; two children; 1 has two, 2 has one; 3 has one


def tree_tokens(model, prompt, n, shape, sampler=None):
    stats = SpecStats.of(SpecOptions(tree="-".join(map(str, shape))))
    gen = run_tree(model, mx.array(prompt), sampler=sampler or Sampler(), shape=shape, stats=stats)
    return [next(gen) for _ in range(n)], stats.to_dict()


@pytest.mark.parametrize("shape", ["1", "2", "2-2-1", "3-1", "1-1-1-1", "2-1-2"])
def test_greedy_tree_equals_plain_greedy(checkpoints, shape):
    for name, path in checkpoints.items():
        model, _ = load(path)
        steps = generate_step(model, mx.array(PROMPT), sampler=Sampler())
        plain = [next(steps) for _ in range(40)]
        out, stats = tree_tokens(model, PROMPT, 40, parse_tree(shape))
        assert out == plain, (name, shape)
        assert stats["tree"] == shape


def test_demo_tree_accepts_more_per_round_than_its_chain():
    model, tok = load()
    prompt = tok.encode("class Queue:\n    def __init__(self):\n")
    steps = generate_step(model, mx.array(prompt), sampler=Sampler())
    plain = [next(steps) for _ in range(60)]
    chain, chain_stats = tree_tokens(model, prompt, 60, (1, 1, 1))
    tree, tree_stats = tree_tokens(model, prompt, 60, (2, 2, 1))
    assert chain == plain and tree == plain
    assert tree_stats["mean_accepted_length"] > chain_stats["mean_accepted_length"]
    assert sum(tree_stats["branch_hist"][0][1:]) > 0  # a second-ranked branch was taken at least once


def test_tree_gdn_recurrence_equals_each_path_alone():
    rng = np.random.default_rng(0)
    B, N, Hk, Hv, Dk, Dv = 1, len(PARENTS), 2, 4, 16, 8
    q, k = (mx.array(rng.normal(size=(B, N, Hk, Dk)), dtype=mx.float32) for _ in range(2))
    v = mx.array(rng.normal(size=(B, N, Hv, Dv)), dtype=mx.float32)
    a, b = (mx.array(rng.normal(size=(B, N, Hv)), dtype=mx.float32) for _ in range(2))
    A_log, dt_bias = mx.array(rng.normal(size=Hv), dtype=mx.float32), mx.ones(Hv)
    state = mx.array(rng.normal(size=(B, Hv, Dv, Dk)), dtype=mx.float32)
    y, states = gated_delta_tree_ref(q, k, v, a, b, A_log, dt_bias, state, list(PARENTS))
    tree = Tree(PARENTS)
    for leaf in (3, 4, 5, 6):
        idx = mx.array(tree.path(leaf))
        y_path, s_path = gated_delta_ref(q[:, idx], k[:, idx], v[:, idx], a[:, idx], b[:, idx], A_log, dt_bias,
                                         state, step_states=True)
        assert mx.allclose(y[:, idx], y_path, atol=1e-5).item()
        assert mx.allclose(states[:, idx], s_path, atol=1e-5).item()


def test_tree_forward_and_compaction_equal_recomputing_the_path(checkpoints):
    model, _ = load(checkpoints["pattern"])  # attention first, Hv > Hk
    tree, tokens = Tree(PARENTS), [40, 41, 42, 43, 44, 45, 46]
    for leaf in (0, 2, 4, 6):
        cache = model.make_cache()
        prefill(model, mx.array(PROMPT), cache)
        caches.begin(cache)
        logits = model(mx.array([tokens]), cache, tree=tree)
        path = tree.path(leaf)
        caches.keep(cache, path)
        caches.commit(cache)
        ref = model.make_cache()
        ref_logits, _ = prefill(model, mx.array(PROMPT + [tokens[i] for i in path]), ref, step=len(PROMPT))
        assert mx.allclose(logits[0, path[-1]], ref_logits, atol=1e-4).item()
        probe = mx.array([[7, 8]])
        assert mx.allclose(model(probe, cache), model(probe, ref), atol=1e-4).item()


def test_tree_helpers():
    tree = Tree(PARENTS)
    assert tree.path(6) == [0, 1, 3, 6]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    mask = np.array(tree.attention_mask(2))
    assert mask[:, :2].all() and mask[5, 2:].tolist() == [True, False, True, False, False, True, False]
    assert np.array(tree.conv_windows(4))[6].tolist() == [3, 4, 6, 9]  # path 0, 1, 3, 6 after 3 conv-state rows
    for bad in ("", "0", "2-x", "1-1-1-1-1-1-1-1-1"):
        with pytest.raises(ValueError):
            parse_tree(bad)


@pytest.mark.parametrize("temp, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_tree_sampling_keeps_the_distribution(temp, top_p, tiny_vocab_model):
    sampler, prompt = Sampler(temp=temp, top_p=top_p), [1, 2, 3]
    pvalue = two_token_pvalue(tiny_vocab_model, prompt, sampler,
                              lambda: tree_tokens(tiny_vocab_model, prompt, 2, (3, 2), sampler)[0])
    assert pvalue > 0.01


def test_generate_api_and_cli_accept_a_tree(checkpoints):
    model, tok = load(checkpoints["tied"])
    plain = generate(model, tok, PROMPT, max_tokens=20).tokens
    result = generate(model, tok, PROMPT, max_tokens=20, speculation=SpecOptions(tree="2-1"))
    assert result.tokens == plain and result.speculation["tree"] == "2-1"


@pytest.mark.parametrize("shape,p", [("1-1-1", 1.0), ("2-2", 1.0), ("3", 0.0), ("2-1", 0.6), ("1-1-1-1", 0.5)])
def test_oracle_tree_is_exact_and_accepts_as_asked(checkpoints, shape, p):
    model, _ = load(checkpoints["tied"])
    plain = generate_step(model, mx.array(PROMPT), sampler=Sampler())
    reference = [next(plain) for _ in range(160)]
    dims = parse_tree(shape)
    stats = SpecStats.of(SpecOptions(tree=shape))
    drafter = OracleTreeDrafter(model, dims, reference, p, seed=1)
    gen = run_tree(model, mx.array(PROMPT), sampler=Sampler(), shape=dims, stats=stats, drafter=drafter)
    assert [next(gen) for _ in range(120)] == reference[:120]
    s = stats.to_dict()
    depth = len(dims)
    if p == 1.0:
        assert s["mean_accepted_length"] == depth  # every round takes the full true path
        assert all(h[0] == s["rounds"] for h in s["branch_hist"])  # always through rank 0
    elif p == 0.0:
        assert s["mean_accepted_length"] == 0
    else:
        # depth-1 hit rate: 1 - prod_r (1 - p decay^r) over the width, within sampling error
        width, hit = dims[0], 1.0
        for r in range(width):
            hit *= 1 - p * 0.6**r
        first = 1 - s["accepted_hist"][0] / s["rounds"]
        assert abs(first - (1 - hit)) < 3 * np.sqrt((1 - hit) * hit / s["rounds"]) + 0.02


@pytest.mark.parametrize("offset", [100, 30_000])
def test_tree_rope_at_long_positions_is_as_accurate_as_the_chain_rope(offset):
    """Tree verify computes RoPE from per-node positions (rope_at), the chain path with mx.fast.rope; at 30k tokens
    they differ by ~2e-3 (fp32 angles of ~3e4 rad). Neither is the better one: against float64 both are off by about
    that much, the tree form a little less. So a tree's logits at long positions differ from the chain's by fp32
    rounding only, and greedy tree output can flip a near-tie there, as any other fp32 reordering can."""
    from lattice_mlx.models.layers import rope_at

    D, dims, base = 256, 64, 1e7
    x = mx.random.normal((1, 2, 4, D), key=mx.random.key(offset))
    tree = rope_at(x, offset + mx.arange(4), dims, base)
    chain = mx.fast.rope(x, dims, traditional=False, base=base, scale=1.0, offset=offset)
    xs = np.array(x, dtype=np.float64)
    ang = (offset + np.arange(4))[:, None] * base ** (-np.arange(0, dims, 2) / dims)[None]
    ref = xs.copy()
    x1, x2 = xs[..., : dims // 2], xs[..., dims // 2 : dims]
    ref[..., : dims // 2], ref[..., dims // 2 : dims] = x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)
    bound = 1e-5 if offset < 1000 else 3e-3
    tree_err, chain_err = np.abs(np.array(tree) - ref).max(), np.abs(np.array(chain) - ref).max()
    assert tree_err <= bound and chain_err <= bound and tree_err <= chain_err + 1e-5, (tree_err, chain_err)
