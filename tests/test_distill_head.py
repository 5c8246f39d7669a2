"""scripts/distill_demo_head.py's training loss against the draft loop it trains for: at depth 1 every slot's loss is
the one the draft loop's own MTP step (drafters.mtp_step) gives for that position, for both targets."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest

from lattice_mlx import load
from lattice_mlx.drafters import mtp_step

spec = importlib.util.spec_from_file_location("distill_demo_head",
                                              Path(__file__).parents[1] / "scripts/distill_demo_head.py")
dh = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dh)


@pytest.fixture(scope="module")
def demo():
    model, tok = load(dtype="float32")
    ids = tok.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")[:11]
    return model, mx.array(ids)[None]


def _log_softmax(x):
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("target", ["labels", "distill"])
def test_depth_one_loss_is_the_draft_loops_first_step(demo, target):
    model, window = demo  # [1, T + 2]
    logits, hidden = dh.trunk(model, window)
    T = window.shape[1] - 2
    got = dh.head_loss(model, window, logits, hidden, target, (1.0,)).item()
    h = model.mtp.from_target(hidden[0])
    per_slot = []
    for j in range(T):  # slot j as the draft loop computes it: the head over slots 0..j, the last slot's logits
        out, _ = mtp_step(model, window[0, 1 : j + 2], h[: j + 1], model.mtp.make_cache())
        logp = _log_softmax(out)
        if target == "labels":
            per_slot.append(-logp[window[0, j + 2]].item())
        else:
            teacher = _log_softmax(logits[0, j + 1])
            per_slot.append((mx.exp(teacher) * (teacher - logp)).sum().item())
    want = sum(per_slot) / T
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_deeper_depths_add_their_own_terms(demo):
    """Depth 2 reads the head's own output: its term is finite, positive, and changes the loss."""
    model, window = demo
    logits, hidden = dh.trunk(model, window)
    one = dh.head_loss(model, window, logits, hidden, "distill", (1.0, 0.0)).item()
    both = dh.head_loss(model, window, logits, hidden, "distill", (1.0, 1.0)).item()
    assert 0 < one < both < float("inf")
