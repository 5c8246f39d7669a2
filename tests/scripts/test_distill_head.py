"""scripts/demo/distill_demo_head.py's training loss against the draft loop it trains for: at depth 1 every slot's loss is
the one the draft loop's own MTP step (drafters.mtp_step) gives for that position, for both targets."""

import mlx.core as mx
import pytest
from conftest import load_script

from lattice_mlx import load
from lattice_mlx.speculative.drafters import mtp_step

dh = load_script("demo/distill_demo_head.py")


@pytest.fixture(scope="module")
def demo():
    model, tok = load(dtype="float32")
    ids = tok.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")[:11]
    return model, mx.array(ids)[None]


def _log_softmax(x):
    x = x.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _draft_loop_loss(model, window, logits, hidden, depth: int, target: str) -> float:
    """The mean over slots of depth `depth`'s loss as the draft loop computes it: for each committed position j,
    the head over slots 0..j (its cache), then steps 2..depth on the head's own hidden with the true tokens as the
    accepted drafts (drafters.mtp_step, what MTPDrafter.propose runs)."""
    T = hidden.shape[1] - depth  # slots at this depth
    h = model.mtp.from_target(hidden[0])
    per_slot = []
    for j in range(T):
        cache = model.mtp.make_cache()
        out, hd = mtp_step(model, window[0, 1 : j + 2], h[: j + 1], cache)
        for d in range(2, depth + 1):
            out, hd = mtp_step(model, window[0, j + d : j + d + 1], hd, cache)
        logp = _log_softmax(out)
        if target == "labels":
            per_slot.append(-logp[window[0, j + depth + 1]].item())
        else:
            teacher = _log_softmax(logits[0, j + depth])
            per_slot.append((mx.exp(teacher) * (teacher - logp)).sum().item())
    return sum(per_slot) / T


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("target", ["labels", "distill"])
def test_each_depths_loss_is_the_draft_loops_step(demo, target, depth):
    """Depth d's term (weights one-hot at d) equals the loss of the draft loop's d-th step at every position: the
    pairing of tokens and hiddens, the targets, the RoPE positions and the keys the head's cache holds then."""
    model, window = demo  # [1, 11]: 10 - d slots at depth d
    logits, hidden = dh.trunk(model, window)
    weights = tuple(1.0 if d == depth else 0.0 for d in range(1, 4))
    got = dh.head_loss(model, window, logits, hidden, target, weights).item()
    want = _draft_loop_loss(model, window, logits, hidden, depth, target)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
