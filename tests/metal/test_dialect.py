"""The shared kernel bodies render to Metal and CUDA source that is at least syntax-shaped; with nvcc on the
PATH the CUDA render is also compiled for sm_90 in the shape MLX gives it (signature, template constants)."""

import re
import shutil
import subprocess

import pytest

from lattice_mlx.metal import _dialect, argmax, gated_delta, q4_embedding, q4_matmul, rms_pair

BODIES = {
    "gated_delta": gated_delta._BODY,
    "gated_delta_batched": gated_delta._BODY_BATCHED,
    "gated_delta_conv": gated_delta._BODY_CONV,
    "gated_delta_conv_no_pick": gated_delta._BODY_CONV_NO_PICK,
    **{f"q4_{kind}{'_res' * res}": q4_matmul.body(kind, res) for kind in q4_matmul._LOAD_X for res in (False, True)},
    **{f"q4_{kind}_glu": q4_matmul.body(kind, False, True) for kind in ("none", "rms")},
    **{f"dense_{kind}{'_res' * res}": q4_matmul.body(kind, res, fmt="dense") for kind in q4_matmul._LOAD_X
       for res in (False, True)},
    **{f"dense_{kind}_glu": q4_matmul.body(kind, False, True, "dense") for kind in ("none", "rms")},
    "q4_embedding": q4_embedding._BODY,
    "argmax": argmax._BODY,
    "rms_pair": rms_pair._BODY,
    "rms_pair_pre": rms_pair._BODY_PRE,
}
MARKERS = {
    "metal": ["simd_sum", "thread_position_in_grid", "thread_position_in_threadgroup", "metal::", "threadgroup_barrier"],
    "cuda": ["__shfl_xor_sync", "blockIdx", "threadIdx", "__byte_perm", "__syncthreads"],
}  # (the header carries two of each dialect's, so every body shows them)
OTHER = {"metal": "cuda", "cuda": "metal"}


def balanced(src: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in re.sub(r"//[^\n]*", "", src):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def assert_render_is_syntax_shaped(body: str, dialect: str) -> None:
    """Balanced brackets, no LX_ macro left, the dialect's own tokens present and the other's absent."""
    src = _dialect.header(dialect) + _dialect.render(body, dialect)
    assert balanced(src), "unbalanced brackets"
    assert not re.search(r"\bLX_\w+", src), "a dialect macro was left unexpanded"
    present = [m for m in MARKERS[dialect] if m in src]
    assert len(present) >= 2, f"too few {dialect} tokens: {present}"
    assert not [m for m in MARKERS[OTHER[dialect]] if m in src], f"{OTHER[dialect]} tokens leaked into {dialect}"


@pytest.mark.parametrize("dialect", ["metal", "cuda"])
@pytest.mark.parametrize("op", list(BODIES))
def test_render_is_syntax_shaped(op, dialect):
    assert_render_is_syntax_shaped(BODIES[op], dialect)


def test_unknown_macro_is_an_error():
    with pytest.raises(KeyError):
        _dialect.render("LX_NOT_A_MACRO(x);", "cuda")


PRELUDE = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
struct Shape { int d[8]; __device__ int operator[](int i) const { return d[i]; } };
struct Strides { int64_t d[8]; __device__ int64_t operator[](int i) const { return d[i]; } };
"""


def assert_nvcc_compiles(unit: str, tmp_path, name: str) -> None:
    """The CUDA translation unit compiles for sm_90 (the H200); nvcc's error tail otherwise."""
    src = tmp_path / f"{name}.cu"
    src.write_text(unit)
    cmd = ["nvcc", "-arch=sm_90", "-c", str(src), "-o", str(tmp_path / f"{name}.o")]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


def cuda_translation_unit(body, inputs, outputs, template, consts=()):
    """The kernel as MLX's cuda_kernel assembles it: header, a __global__ signature, template constants, body
    (with `consts`, from `_dialect.constants`, declared at its top as `_dialect.build` does)."""
    args = []
    for name, ctype in inputs:
        args.append(f"const {ctype}* {name}")
        if f"{name}_shape" in body:
            args.append(f"const __grid_constant__ Shape {name}_shape")
        if f"{name}_strides" in body:
            args.append(f"const __grid_constant__ Strides {name}_strides")
        if f"{name}_ndim" in body:
            args.append(f"const __grid_constant__ int {name}_ndim")
    args += [f"{ctype}* {name}" for name, ctype in outputs]
    consts_ = consts
    consts = "".join(
        f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {n} = {str(v).lower()};\n"
        if isinstance(v, (bool, int))
        else f"  using {n} = {v};\n"
        for n, v in template
    )
    return (
        PRELUDE
        + _dialect.header("cuda")
        + "__global__ void kernel(\n"
        + ",\n".join(args)
        + ") {\n"
        + consts
        + _dialect.render(_dialect.declare(tuple(consts_)) + body, "cuda")
        + "\n}\n"
    )


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on the PATH")
@pytest.mark.parametrize("op", list(BODIES))
def test_cuda_render_compiles(op, tmp_path):
    bf = "__nv_bfloat16"
    if op.startswith("gated_delta_conv"):
        ins = [("qkv", bf), ("conv_state", bf), ("conv_w", bf), ("a", bf), ("b", bf), ("A_log", "float"),
               ("dt_bias", bf), ("state_in", "float")] + [("pick", "int")] * (op == "gated_delta_conv")
        unit = cuda_translation_unit(
            BODIES[op],
            ins,
            [("y", bf), ("state_out", "float"), ("conv_in", bf)],
            [("YT", bf), ("Hk", 2), ("Hv", 4), ("Dk", 128), ("Dv", 64), ("KC", 4), ("STEP", True), ("DVW", 4)]
            + [("PR", 2)] * (op == "gated_delta_conv"),  # (picks per row: a batch's rounds)
            _dialect.constants(QKV_S=1544, QKV_C=0, B_S=1544, B_C=1536, A_S=1544, A_C=1540),
        )
    elif op.startswith("gated_delta"):
        ins = [(n, bf) for n in "qkvab"] + [("A_log", "float"), ("dt_bias", bf), ("state_in", "float")]
        unit = cuda_translation_unit(
            BODIES[op],
            ins,
            [("y", bf), ("state_out", "float")],
            [("YT", bf), ("Hk", 2), ("Hv", 4), ("Dk", 128), ("Dv", 64), ("STEP", True)],
        )
    elif op == "q4_embedding":
        ins = [("ids", "int32_t"), ("w", "uint32_t"), ("scales", bf), ("biases", bf)]
        unit = cuda_translation_unit(BODIES[op], ins, [("out", bf)], [("OT", bf), ("GS", 64), ("ROUND", 0)])
    elif op == "argmax":
        unit = cuda_translation_unit(BODIES[op], [("x", bf)], [("out", "uint32_t")], [("N", 248320)])
    elif op.startswith("rms_pair"):
        ins = [("e", bf), ("h", bf), ("we", bf), ("wh", bf)] + [("wp", bf)] * (op == "rms_pair_pre")
        unit = cuda_translation_unit(BODIES[op], ins, [("out", bf)], [("OT", bf), ("H", 1024)],
                                     _dialect.constants(EPS=1e-6, PRE_EPS=1e-6))
    else:
        fmt, _, kind = op.partition("_")
        kind, res = kind.removesuffix("_res").removesuffix("_glu"), op.endswith("_res")
        extra = {"rms": ["nw"], "gate": ["g"], "gated_rms": ["nw", "zs"]}.get(kind, [])
        weights = [("w", "uint32_t"), ("scales", bf), ("biases", bf)] if fmt == "q4" else [("w", bf)]
        ins = [("x", bf), *weights] + [(n, bf) for n in extra]
        ins += [("res", bf)] * res
        consts = [("OT", bf), ("MM", 4), ("R", 4), ("SK", 2), ("GS", 64), ("EPS", 1000), ("HD", 128), ("GSTR", 5120),
                  ("GB", 1), ("ZSTR", 8224), ("ZOFF", 6144)]
        unit = cuda_translation_unit(BODIES[op], ins, [("y", bf)], consts)
    assert_nvcc_compiles(unit, tmp_path, op)


def test_constants_are_exact_typed_literals():
    """Kernel parameters as literals (`_dialect.constants`): a float is its fp32 value exactly, an int stays an int,
    True and 1 are different constants, and the declarations name each type."""
    import numpy as np

    for v in (1e-6, 1e-5, 256 ** -0.5, 23.253496664211536, 1 / 3):
        lit = _dialect.literal(v)
        assert lit.endswith("f") and np.float32(float(lit[:-1])) == np.float32(v)
    assert _dialect.constants(A=True) == (("A", "true"),) and _dialect.constants(A=1) == (("A", "1"),)
    decl = _dialect.declare(_dialect.constants(EPS=1e-6, N=3, ON=False))
    assert decl.splitlines() == ["  const float EPS = 9.999999975e-07f;", "  const int N = 3;", "  const bool ON = false;"]
    assert _dialect.literal(np.int64(5)) == "5" and _dialect.literal(np.bool_(True)) == "true"
    with pytest.raises(AssertionError):
        _dialect.literal(float("nan"))
    with pytest.raises(TypeError):
        _dialect.literal("5")


def test_first_use_builds_are_counted_and_announced_once(monkeypatch, capsys):
    """A process's first launches of kernel variants on a GPU build them (on MLX's CUDA backend ~1.5 s each, tens of
    seconds for a first generation): they are counted for benchmarks, and once they pass ANNOUNCE_AFTER_S one line
    says so on stderr, once."""
    monkeypatch.setattr(_dialect, "_FIRST_USES", {"variants": 0, "seconds": 0.0})
    _dialect._first_use(0.6)
    assert capsys.readouterr().err == ""
    _dialect._first_use(0.6)
    _dialect._first_use(1.5)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compiling GPU kernels" in err
    assert _dialect.first_uses() == {"variants": 3, "seconds": pytest.approx(2.7)}
