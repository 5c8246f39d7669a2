"""Every Metal source this package can ask MLX to compile, compiled here without a Mac: the variants come from the
model's own forwards (lattice_mlx.variants), for the demo checkpoint and the Qwen3.5 family's shapes, in every
activation dtype and weight format; each source is MLX's own text for the call (checked against MLX itself) and is
compiled by clang against tests/metal/metal_shim.h with Apple's limits checked (tests/metal/msl_check.py). The
check's teeth: planted Metal errors must each fail it."""

import json
from itertools import product
from pathlib import Path

import mlx.core as mx
import pytest

cindex = pytest.importorskip("clang.cindex", reason="libclang is not installed: pip install libclang")

import msl_check  # noqa: E402

from lattice_mlx import variants  # noqa: E402
from lattice_mlx.bench.synthetic import FAMILY  # noqa: E402
from lattice_mlx.metal import metal_source  # noqa: E402

DEMO = Path(variants.__file__).parent / "assets" / "demo" / "config.json"
_demo = json.loads(DEMO.read_text())["text_config"]
# Head dims the dispatchers take that no checkpoint above has: attention D = 128, GDN Dk = 96 (an odd number of
# 32-lane chunks) with Dv = 48, and GDN Dk = Dv = 256 (the largest Dk the kernels take)
DIMS = {"dims-d128-dk96": {**_demo, "head_dim": 128, "linear_key_head_dim": 96, "linear_value_head_dim": 48},
        "dims-dk256": {**_demo, "linear_key_head_dim": 256, "linear_value_head_dim": 256}}
CONFIGS = {"demo": _demo, **FAMILY, **DIMS}
DTYPES = (mx.float32, mx.bfloat16, mx.float16)
# (bits, group size): 4-bit affine in every group size the kernels take, 8-bit (no fused matmul kernel: the other
# kernels still run) and unquantized weights (the dense matmul kernel)
WEIGHTS = ((4, 32), (4, 64), (4, 128), (8, 64), (None, 64))


def sources_of(calls) -> dict[str, msl_check.Source]:
    """One entry per distinct source text and launch shape."""
    out = {}
    for call in calls:
        text = metal_source.source(call)
        values = {k: int(v) for k, v in call.template if isinstance(v, (int, bool))}
        out.setdefault((text, call.threadgroup, tuple(g % t == 0 for g, t in zip(call.grid, call.threadgroup))),
                       (msl_check.Source(text, values, call.threadgroup, call.grid), call))
    return out


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_metal_variant_compiles(config, record_property):
    calls = {}
    for dtype, (bits, gs) in product(DTYPES, WEIGHTS):
        calls.update(variants.distinct(variants.model_calls(CONFIGS[config], dtype=dtype, bits=bits,
                                                            group_size=gs)))
    found = sources_of(calls.values())
    items = list(found.values())
    # the text compiled is MLX's own: MLX builds it here too while exporting a function (nothing runs)
    theirs = metal_source.mlx_sources([call for _, call in items])
    assert [s.text for s, _ in items] == theirs, "the reproduced source differs from MLX's"
    reports = msl_check.check([s for s, _ in items])
    failures = [f"{call.kernel.name} {call.template} tg={call.threadgroup}: {e}"
                for (_, call), r in zip(items, reports) for e in r.errors]
    record_property("metal_variants", len(items))
    record_property("metal_kernels", sorted({call.kernel.name for _, call in items}))
    assert not failures, f"{len(failures)} problems, e.g.:\n" + "\n".join(failures[:20])
    assert len({call.kernel.name for _, call in items}) >= 20  # every kernel of the package is reached


@pytest.mark.parametrize("bits", [4, None], ids=["q4", "dense"])
def test_the_16_row_variants_compile(bits):
    """LATTICE_FUSED_ROWS=16: the fused matmul's variants holding 16 rows (a batch's steps of 9-16 sequences), from
    the 0.8B shape's own forwards, compile under Apple's limits (their threadgroup memory and registers grow with
    the rows held)."""
    from lattice_mlx import settings

    with settings.override(fused_rows="16"):
        calls = variants.distinct(variants.model_calls(FAMILY["0.8b"], dtype=mx.bfloat16, bits=bits, group_size=64,
                                                       widths=(12,)))
    wide = [c for c in calls.values() if dict(c.template).get("MM") == 16]
    assert wide, "no variant holding 16 rows was reached"
    found = sources_of(wide)
    reports = msl_check.check([src for src, _ in found.values()])
    failures = [f"{call.kernel.name} {call.template}: {e}" for (_, call), r in zip(found.values(), reports)
                for e in r.errors]
    assert not failures, "\n".join(failures[:20])


# --- the check's teeth: each planted error must fail it -----------------------------------------------------------

ANCHOR = "  const int lane = thread_position_in_threadgroup.x;\n"


@pytest.fixture(scope="module")
def conv_source():
    """A real variant: the GDN decode kernel of the 0.8B shape in bf16."""
    calls = variants.model_calls(FAMILY["0.8b"], dtype=mx.bfloat16, bits=4, group_size=64, widths=(1,))
    call = next(c for c in calls if c.kernel.name == "lattice_gated_delta_conv")
    (src, _), = sources_of([call]).values()
    assert ANCHOR in src.text
    return src


PLANTS = {
    "cuda-builtin": (ANCHOR, ANCHOR + "  const int t = threadIdx.x;\n", "threadIdx"),
    "cuda-sync": (ANCHOR, ANCHOR + "  __syncthreads();\n", "__syncthreads"),
    "cuda-math": ("metal::exp(", "expf(", "expf"),
    "undeclared": (ANCHOR, ANCHOR + "  lx_no_such_name += 1.0f;\n", "lx_no_such_name"),
    "device-as-threadgroup": (ANCHOR, ANCHOR + "  threadgroup float* p = state_out;\n", "threadgroup float *"),
    "threadgroup-over-32k": (ANCHOR, ANCHOR + "  threadgroup float big[9000];\n  big[lane] = 0.0f;\n",
                             "bytes of threadgroup memory"),
    "pointer-without-address-space": (ANCHOR, ANCHOR + "  const float* p = (const float*)state_in;\n",
                                      "no address space"),
    "cxx17-in-metal": (ANCHOR, ANCHOR + "  if constexpr (Dk > 0) {}\n", "C++17"),
    "unknown-attribute": ("[[kernel]] void", "[[kernel]] [[visible]] void", "[[visible]]"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_metal_error_fails_the_check(conv_source, plant):
    old, new, expect = PLANTS[plant]
    assert old in conv_source.text
    bad = msl_check.Source(conv_source.text.replace(old, new, 1), conv_source.values, conv_source.threadgroup,
                           conv_source.grid)
    clean, planted = msl_check.check([conv_source, bad])  # in one batch: the error stays with its source
    assert clean.errors == []
    assert planted.errors and any(expect in e for e in planted.errors), planted.errors


def test_launch_limits_fail_the_check(conv_source):
    def with_launch(tg, grid):
        return msl_check.Source(conv_source.text, conv_source.values, tg, grid)

    over, partial, odd = msl_check.check([with_launch((32, 64, 1), (32, 128, 16)),
                                          with_launch((32, 4, 1), (32, 6, 16)),
                                          with_launch((16, 1, 1), (32, 1, 1))])
    assert any("2048 threads" in e for e in over.errors)
    assert any("partial threadgroup" in e for e in partial.errors)
    assert any("whole SIMD groups" in e for e in odd.errors)


def test_too_many_buffers_fail_the_check():
    args = ",\n".join(f"  device float* b{i} [[buffer({i})]]" for i in range(32))
    text = f"[[kernel]] void k(\n{args}) {{\n  b0[0] = 1.0f;\n}}\n"
    (report,) = msl_check.check([msl_check.Source(text, {}, (32, 1, 1), (32, 1, 1))])
    assert report.buffers == 32 and any("32 buffer arguments" in e for e in report.errors)
