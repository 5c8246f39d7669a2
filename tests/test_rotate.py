"""A rotated model computes the same function, MTP head included, for both hidden choices."""

import mlx.core as mx
import numpy as np
import pytest

import lattice_mlx
from lattice_mlx import load
from lattice_mlx.convert import convert
from lattice_mlx.decode import generate_step
from lattice_mlx.rotate import rotate_model, rotation
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import SpecOptions, SpecStats, speculate

IDS = mx.array([[3, 17, 250, 9, 64, 128, 5, 77, 300, 12]])


def mtp_logits(model, mode: str) -> mx.array:
    """Target forward, then one MTP step at every position, through the same basis changes the drafter uses."""
    head = model.mtp
    head.input_hidden = mode
    _, hidden = model(IDS, return_hidden=True)
    emb = model.model.embed_tokens(mx.array([[17, 250, 9, 64, 128, 5, 77, 300, 12, 4]]))
    x = head(emb, head.from_target(hidden))
    return model.lm_logits(head.to_target(head.norm(x)))


def test_rotation_is_orthogonal():
    for dims in (64, 320, 1024):
        q = rotation(dims, seed=3)
        assert np.allclose(q @ q.T, np.eye(dims), atol=1e-12)


@pytest.mark.parametrize("mode", ["post", "pre"])
def test_rotated_model_and_mtp_head_compute_the_same_function(checkpoint, mode, on_cpu):
    # float64 on the CPU (the GDN recurrence still runs in fp32): in fp32 these random models amplify the rounding
    # of the reordered sums to ~1e-4, which would hide a real error of that size.
    ref, _ = load(checkpoint)
    rot, _ = load(checkpoint)
    ref.set_dtype(mx.float64)
    rot.set_dtype(mx.float64)
    rotate_model(rot, seed=7)
    assert not rot.args.tie_word_embeddings
    target_err = mx.abs(rot(IDS) - ref(IDS)).max().item()
    mtp_err = mx.abs(mtp_logits(rot, mode) - mtp_logits(ref, mode)).max().item()
    assert target_err <= 1e-4 and mtp_err <= 1e-4, (target_err, mtp_err)


def test_missing_counter_rotation_breaks_the_head(checkpoints):
    ref, _ = load(checkpoints["untied"])
    rot, _ = load(checkpoints["untied"])
    rotate_model(rot, seed=7, skip_mtp_counter_rotation=True)
    assert mx.abs(rot(IDS) - ref(IDS)).max().item() <= 1e-4  # the target is still right ...
    agree = (mx.argmax(mtp_logits(rot, "post"), -1) == mx.argmax(mtp_logits(ref, "post"), -1)).mean().item()
    assert agree < 0.5  # ... but the head now computes something else


def test_rotated_checkpoint_reloads_without_flags(checkpoints, tmp_path):
    src = checkpoints["tied"]
    dst = convert(str(src), str(tmp_path / "rot"), rotate_seed=5, mtp_dtype=None)
    rot, _ = load(dst)
    ref, _ = load(src)
    assert mx.abs(rot(IDS) - ref(IDS)).max().item() <= 1e-4
    assert mx.abs(mtp_logits(rot, "post") - mtp_logits(ref, "post")).max().item() <= 1e-4


@pytest.mark.parametrize("group_size", [32, 64])
def test_greedy_mtp_equals_plain_on_rotated_q4(checkpoints, tmp_path, group_size):
    dst = convert(str(checkpoints["untied"]), str(tmp_path / "rq"), rotate_seed=1, quantize_bits=4,
                  group_size=group_size)
    model, _ = load(dst)
    prompt = mx.array([5, 9, 33, 21, 7, 100])
    steps = generate_step(model, prompt, sampler=Sampler())
    plain = [next(steps) for _ in range(40)]
    options = SpecOptions(draft_tokens=3, adaptive=False)
    gen = speculate(model, prompt, sampler=Sampler(), options=options, stats=SpecStats.of(options))
    assert [next(gen) for _ in range(40)] == plain


def _dense_demo():
    """The shipped demo with its 4-bit layers dequantized (rotation needs dense weights)."""
    import mlx.nn as nn

    model, tok = load()
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
            dense = nn.Embedding(*w.shape) if isinstance(m, nn.QuantizedEmbedding) else nn.Linear(w.shape[1],
                                                                                                 w.shape[0], bias=False)
            dense.weight = w
            parent = model
            *path, last = name.split(".")
            for p in path:
                parent = parent[int(p)] if p.isdigit() else getattr(parent, p)
            setattr(parent, last, dense)
    model.set_dtype(mx.float32)
    return model, tok


def test_demo_head_needs_its_counter_rotation():
    """MTP/target argmax agreement on held-out text: kept by the rotation, near chance without the counter-rotation."""
    import json
    from pathlib import Path

    prompts = json.loads((Path(lattice_mlx.__file__).parent / "assets" / "prompts" / "demo_heldout.json").read_text())
    ref, tok = _dense_demo()
    ids = mx.array([tok.encode("".join(p["prompt"] for p in prompts["prompts"][:6]))[:200]])

    def agreement(model):
        logits, hidden = model(ids, return_hidden=True)
        head = model.mtp
        u = head(model.model.embed_tokens(ids[:, 1:]), head.from_target(hidden[:, :-1]))
        draft = mx.argmax(model.lm_logits(head.to_target(head.norm(u)))[0, :-1], axis=-1)
        return (draft == mx.argmax(logits[0, 1:-1], axis=-1)).mean().item()

    base = agreement(ref)
    rotated, _ = _dense_demo()
    rotate_model(rotated, seed=3)
    broken, _ = _dense_demo()
    rotate_model(broken, seed=3, skip_mtp_counter_rotation=True)
    assert base > 0.3
    assert abs(agreement(rotated) - base) < 0.02
    assert agreement(broken) < 0.05  # chance is 1/8192; a broken head lands on a few frequent tokens at most
