"""The kernel variants the enumeration finds (lattice_mlx.variants: the model's forwards on placeholder weights) cover
what the real decode loops launch: the loops run on the demo model with every kernel call spied on (collected, then
answered by the reference), and each variant they asked for must be one the enumeration lists. A loop that grows a
new kind of call without the enumeration following fails here, so the Metal source check cannot silently miss it."""

import json
from pathlib import Path

import mlx.core as mx
import pytest

from lattice_mlx import SpecOptions, generate, load, variants
from lattice_mlx.metal import _dialect

DEMO = Path(variants.__file__).parent / "assets" / "demo" / "config.json"
LOOPS = {
    "plain": dict(),
    "plain-sampled": dict(temp=0.7, seed=1),
    "mtp-default": dict(speculation=SpecOptions()),
    "mtp-batched-k3": dict(speculation=SpecOptions(draft_tokens=3, adaptive=False, verify="batched")),
    "mtp-sequential-k2": dict(speculation=SpecOptions(draft_tokens=2, adaptive=False, verify="sequential")),
    "mtp-pipelined-k4-sampled": dict(speculation=SpecOptions(draft_tokens=4, adaptive=False, verify="pipelined"),
                                     temp=0.7, seed=2),
    "tree": dict(speculation=SpecOptions(tree="2-2-1")),
}


@pytest.fixture(scope="module")
def enumerated():
    config = json.loads(DEMO.read_text())
    quant = config["quantization"]
    return set(variants.distinct(variants.model_calls(config["text_config"], dtype=mx.bfloat16, bits=quant["bits"],
                                                      group_size=quant["group_size"])))


@pytest.mark.parametrize("loop", list(LOOPS))
def test_decode_loops_launch_only_enumerated_variants(loop, enumerated):
    model, tok = load(dtype="bfloat16")
    with _dialect.recording(spy=True) as spied:
        generate(model, tok, "def add(a, b):\n    return", max_tokens=12, **LOOPS[loop])
    assert spied, "the loop asked for no kernel: the spy saw nothing"
    missing = {c.variant() for c in spied} - enumerated
    assert not missing, f"{len(missing)} variants the enumeration misses, e.g. {sorted(missing)[:3]}"
