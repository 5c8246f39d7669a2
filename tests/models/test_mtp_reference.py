"""The MTP head against an independent implementation: mlx-vlm's Qwen3.5 MTP drafter (`qwen3_5_mtp`).

Both sides load the same random hub-layout checkpoint directory, each with its own loader: this package through
`lattice_mlx.load`, mlx-vlm through `mlx_vlm.utils.load_model` (the target; it has no vision weights, which mlx-vlm
disables with a warning) and `load_drafter` (which builds the head from the checkpoint's `mtp.*` tensors, +1 shift on
its norms included). The head's logits at every slot of a short sequence must agree within 1e-5 of their scale in
float32, both batched and step by step through `mtp_step` and the head's KV cache. The same target hidden (this
package's, after the final norm) feeds both heads, so the check isolates the head; a separate test checks that
mlx-vlm's target hands its head the same hidden (after the final norm) as this package does.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install mlx-vlm): no MTP reference to compare")
pytest.importorskip("mlx_vlm.speculative.drafters.qwen3_5_mtp",
                    reason="this mlx-vlm has no Qwen3.5 MTP drafter (qwen3_5_mtp)")

from mlx_vlm.speculative.drafters import load_drafter  # noqa: E402
from mlx_vlm.utils import load_model as vlm_load_model  # noqa: E402

import lattice_mlx  # noqa: E402
from lattice_mlx.bench.synthetic import random_checkpoint  # noqa: E402
from lattice_mlx.speculative.drafters import mtp_step  # noqa: E402

CONFIGS = {
    "tied": dict(seed=10),
    "untied": dict(seed=11, tie_word_embeddings=False),
    "hv4": dict(seed=12, linear_num_key_heads=1, linear_num_value_heads=4),  # more value heads than key heads
}
T = 12  # head slots compared: slot t pairs the target hidden at t with token t+1
TOL = 1e-5  # relative to the reference logits' largest magnitude


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_ref")
    return {name: random_checkpoint(root / name, **kw) for name, kw in CONFIGS.items()}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, checkpoints):
    """(this package's model, mlx-vlm's target, mlx-vlm's MTP drafter bound to it, token ids [T + 1])."""
    path = Path(checkpoints[request.param])
    model, _ = lattice_mlx.load(path)
    target = vlm_load_model(path)
    drafter, kind = load_drafter(str(path))
    assert kind == "mtp" and type(drafter).__name__ == "Qwen3_5MTPDraftModel"
    assert model.mtp.fc.weight.dtype == drafter.fc.weight.dtype == mx.float32
    ids = mx.array(np.random.default_rng(0).integers(0, model.args.vocab_size, T + 1))
    return model, target, drafter, ids


def target_hidden(model, ids: mx.array) -> mx.array:
    """This package's target hidden for the head, [1, T, H] (after the final norm)."""
    _, hidden = model(ids[None, :T], return_hidden=True)
    return hidden


def reference_logits(target, drafter, ids: mx.array, hidden: mx.array) -> mx.array:
    """mlx-vlm's head logits [T, V]: slots (ids[t + 1], hidden[t]) at RoPE positions 0..T-1, through the target's
    embedding and lm_head (what `bind` picks), as its `prefill_from_target_hidden` runs them."""
    drafter.reset(target)  # binds embed/lm_head, fresh KV cache, position 0
    h = drafter._forward_tokens(ids[None, 1:], hidden, mx.int32)  # the head's output after its final norm
    return drafter._lm_head_fn(h)[0]


def lattice_logits(model, ids: mx.array, hidden: mx.array, *, stepwise: bool) -> mx.array:
    """This package's head logits [T, V]: batched in one call, or slot by slot through mtp_step and the KV cache."""
    cache = model.mtp.make_cache()
    if stepwise:
        return mx.stack([mtp_step(model, ids[t + 1 : t + 2], hidden[0, t : t + 1], cache)[0] for t in range(T)])
    x = model.mtp(model.model.embed_tokens(ids[1:])[None], hidden, cache)
    return model.lm_logits(model.mtp.norm(x))[0]


def rel_err(a: mx.array, ref: mx.array) -> float:
    return mx.abs(a - ref).max().item() / mx.abs(ref).max().item()


@pytest.mark.parametrize("stepwise", [False, True], ids=["batched", "stepwise"])
def test_mtp_logits_match_mlx_vlm(pair, stepwise, compile_mode):
    model, target, drafter, ids = pair
    hidden = target_hidden(model, ids)
    ref = reference_logits(target, drafter, ids, hidden)
    ours = lattice_logits(model, ids, hidden, stepwise=stepwise)
    assert ours.shape == ref.shape == (T, model.args.vocab_size)
    err = rel_err(ours, ref)
    assert err <= TOL, f"max |lattice - mlx-vlm| MTP logits = {err:.2e} of their scale"


@pytest.mark.parametrize("norm", ["norm", "pre_fc_norm_hidden"])
def test_reference_detects_a_missing_norm_shift(checkpoints, norm):
    """Negative control: the comparison fails when one of the head's norms loses its +1 shift."""
    path = Path(checkpoints["tied"])
    model, _ = lattice_mlx.load(path)
    target = vlm_load_model(path)
    drafter, _ = load_drafter(str(path))
    ids = mx.array(np.random.default_rng(0).integers(0, model.args.vocab_size, T + 1))
    hidden = target_hidden(model, ids)
    ref = reference_logits(target, drafter, ids, hidden)
    assert rel_err(lattice_logits(model, ids, hidden, stepwise=False), ref) <= TOL
    module = getattr(model.mtp, norm)
    module.weight = module.weight - 1.0
    err = rel_err(lattice_logits(model, ids, hidden, stepwise=False), ref)
    assert err > 100 * TOL, f"dropping the +1 shift on mtp.{norm} changed the logits by only {err:.2e}"


def test_head_reads_the_hidden_mlx_vlm_feeds_it(pair):
    """mlx-vlm's target hands its head the hidden after the final norm (`hidden_states[-1]`); so must this package.
    The bound is loose: the two targets' GDN arithmetic differs (up to ~1e-3 of the scale seen on these random
    models), while the hidden before the final norm is off by O(1)."""
    model, target, _, ids = pair
    ours = target_hidden(model, ids)
    theirs = target.language_model(ids[None, :T], return_hidden=True).hidden_states[-1]
    assert rel_err(ours, theirs) <= 1e-2
    pre = model.model(ids[None, :T])
    assert rel_err(pre, theirs) > 0.1  # the check can tell the two hiddens apart
