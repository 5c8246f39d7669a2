"""The SYNTHETIC oracles pay the MTP head's cost: their drafts replace the head's, but the head's drafts stay in the
graph that is evaluated, so a synthetic speedup is not inflated by a head that never runs."""

import tempfile
from types import SimpleNamespace

import mlx.core as mx

from lattice_mlx.bench.oracles import DeviceOracle


def depends_on(out: mx.array, marker: str) -> bool:
    """Whether evaluating `out` computes an op named `marker` (MLX's own graph export)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        return marker in open(f.name).read()


def head_drafts(k: int) -> mx.array:
    """Stands for the head's drafts: an op no other part of the oracle's graph uses."""
    return mx.arctanh(mx.arange(k, dtype=mx.float32) / 10).astype(mx.int32)


def test_the_device_oracle_keeps_the_heads_drafts_in_the_graph():
    oracle = DeviceOracle(list(range(40)), 0.5, 100, 3, seed=1)
    rounds = SimpleNamespace(gen=mx.array(5, dtype=mx.int32))
    drafts, q = oracle(head_drafts(3), None, rounds, 0)
    assert q is None and drafts.shape == (3,) and depends_on(drafts, "ArcTanh")
    assert all(d in (t, (t + 1) % 100) for d, t in zip(drafts.tolist(), range(6, 9)))  # truth or surely wrong
    # the check finds a pick without the `+ 0 * drafts` term (the head's cost silently dropped)
    oracle._pick = mx.compile(lambda right, truth, drafts: mx.where(right, truth, (truth + 1) % 100))
    assert not depends_on(oracle(head_drafts(3), None, rounds, 0)[0], "ArcTanh")
