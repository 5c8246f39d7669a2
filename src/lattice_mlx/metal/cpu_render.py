"""The CPU render: a kernel body rendered to C++ (dialect "cpu"), compiled with the machine's C++ compiler and run
threadgroup by threadgroup with every thread a fiber (cpu_render.h), so barriers, threadgroup memory and SIMD-group
sums and shuffles keep their GPU semantics. It exists to execute the shipped bodies' arithmetic where no GPU is
(CI, this machine, `python -m lattice_mlx.doctor` on a CPU): slow, at small shapes. Every buffer access is
bounds-checked, outputs start as NaN (or the caller's init_value) and threadgroup memory as NaN bytes.

`kernel(...)` takes what `mx.fast.metal_kernel` takes and returns a callable with its call signature. Inputs are
copied to the host row-contiguous (a strided input's `_strides` are the copy's), so `ensure_row_contiguous=False`
kernels get correct but contiguous strides. It runs eagerly: inside an mx.compile trace the inputs cannot be read.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from lattice_mlx import settings

_HERE = Path(__file__).parent
# C++ spelling and host dtype (bf16 travels as its 16 bits) of each MLX dtype a kernel argument can have
_TYPES = {
    mx.float32: ("float", np.float32), mx.float16: ("lx_f16", np.uint16), mx.bfloat16: ("lx_bf16", np.uint16),
    mx.int32: ("int32_t", np.int32), mx.uint32: ("uint32_t", np.uint32), mx.int64: ("int64_t", np.int64),
    mx.uint64: ("uint64_t", np.uint64), mx.bool_: ("bool", np.bool_),
}
# what an output holds before the kernel writes it: NaN, or an unlikely integer
_POISON = {mx.float32: np.float32("nan"), mx.float16: np.uint16(0x7E00), mx.bfloat16: np.uint16(0x7FC0)}


class RenderError(RuntimeError):
    """The render could not build or run a kernel (compiler error, bounds, divergence, deadlock)."""


def compiler() -> str | None:
    """The C++ compiler the render uses: $CXX, else c++, g++ or clang++ on the PATH."""
    for name in (settings.raw("cxx"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def available() -> bool:
    return compiler() is not None


def _cache_dir() -> Path:
    root = settings.raw("cache_home") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "lattice_mlx" / "cpu_render"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _literal(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return _TYPES[v][0]


def translation_unit(name: str, source: str, header: str, inputs: list[tuple[str, mx.Dtype, int]],
                     outputs: list[tuple[str, mx.Dtype]], template: list) -> str:
    """The C++ unit of one variant: the body as a function of checked buffers (and the shapes / strides it names),
    its template arguments as constants, and `lx_launch`, which the host calls."""
    params, fields, sets = [], [], []
    for i, (n, dtype, ndim) in enumerate(inputs):
        ctype = _TYPES[dtype][0]
        params.append(f"lx_ptr<const {ctype}> {n}")
        sets.append(f"  lx_a.{n} = lx_ptr<const {ctype}>{{(const {ctype}*)bufs[{i}], sizes[{i}], 0, \"{n}\"}};")
        for suffix, ctype2 in (("shape", "int"), ("strides", "int64_t")):
            if f"{n}_{suffix}" in source:
                params.append(f"const {ctype2}* {n}_{suffix}")
                src = "shapes" if suffix == "shape" else "strides"
                sets.append(f"  lx_a.{n}_{suffix} = {src} + {8 * i};")
        if f"{n}_ndim" in source:
            params.append(f"int {n}_ndim")
            sets.append(f"  lx_a.{n}_ndim = {ndim};")
    for j, (n, dtype) in enumerate(outputs):
        ctype = _TYPES[dtype][0]
        i = len(inputs) + j
        params.append(f"lx_ptr<{ctype}> {n}")
        sets.append(f"  lx_a.{n} = lx_ptr<{ctype}>{{({ctype}*)bufs[{i}], sizes[{i}], 0, \"{n}\"}};")
    fields = [p + ";" for p in params]
    args = ", ".join(f"lx_a.{p.split()[-1]}" for p in params)
    consts = "".join(
        f"  using {k} = {_literal(v)};\n" if isinstance(v, mx.Dtype) else f"  constexpr {type(v).__name__} {k} = "
        f"{_literal(v)};\n" for k, v in template)
    return (f'#include "cpu_render.h"\n// {name}\n{header}\n'
            f"static void lx_body({', '.join(params)}) {{\n{consts}{source}\n}}\n"
            f"static struct {{\n  {chr(10).join('  ' + f for f in fields).strip()}\n}} lx_a;\n"
            f"static void lx_entry() {{\n  lx_body({args});\n  lx_cur->state = LX_DONE;\n}}\n"
            'extern "C" int lx_launch(void** bufs, const int64_t* sizes, const int* shapes, const int64_t* strides, '
            "const int* grid, const int* tg, char* err) {\n" + "\n".join(sets) + "\n"
            "  const int rc = lx_run(grid, tg);\n  if (rc) std::snprintf(err, 512, \"%s\", lx_error);\n  return rc;\n}\n")


_LIBS: dict[str, ctypes.CDLL] = {}


def compile_unit(unit: str) -> ctypes.CDLL:
    """The unit built into a shared library (cached on disk by its text) and loaded."""
    digest = hashlib.sha1(unit.encode()).hexdigest()[:16]
    if digest in _LIBS:
        return _LIBS[digest]
    cxx = compiler()
    if cxx is None:
        raise RenderError("the CPU render needs a C++ compiler (c++, g++ or clang++ on the PATH, or $CXX)")
    out = _cache_dir() / f"{digest}.so"
    if not out.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src, lib = Path(tmp) / "k.cpp", Path(tmp) / "k.so"
            src.write_text(unit)
            cmd = [cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-Wno-unknown-pragmas",
                   f"-I{_HERE}", str(src), "-o", str(lib)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                errors = [ln for ln in res.stderr.splitlines() if "error" in ln] or res.stderr.splitlines()
                raise RenderError(f"the C++ compiler rejected the kernel: {errors[0] if errors else res.returncode}")
            os.replace(lib, out)  # atomic: parallel test workers may build the same unit
    lib = ctypes.CDLL(str(out))
    lib.lx_launch.restype = ctypes.c_int
    _LIBS[digest] = lib
    return lib


def _to_host(a: mx.array) -> np.ndarray:
    if a.dtype not in _TYPES:
        raise RenderError(f"the CPU render takes no {a.dtype} arguments")
    if a.dtype in (mx.bfloat16, mx.float16):
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a, copy=True))


def kernel(*, name: str, input_names: list[str], output_names: list[str], source: str, header: str = "",
           ensure_row_contiguous: bool = True):
    """`mx.fast.metal_kernel`'s contract on the CPU render (source already in the "cpu" dialect)."""

    def call(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(), init_value=None, **_):
        if any(g % t for g, t in zip(grid, threadgroup)):
            raise RenderError(f"grid {tuple(grid)} is not a multiple of the threadgroup {tuple(threadgroup)}: Metal "
                              "would launch partial threadgroups and CUDA whole ones")
        host = [_to_host(a) for a in inputs]
        unit = translation_unit(name, source, header, [(n, a.dtype, a.ndim) for n, a in zip(input_names, inputs)],
                                list(zip(output_names, output_dtypes)), list(template))
        lib = compile_unit(unit)
        outs = []
        for shape, dtype in zip(output_shapes, output_dtypes):
            fill = _POISON.get(dtype, np.array(-0x5A5A5A5B).astype(_TYPES[dtype][1]))
            if init_value is not None:
                fill = np.array(mx.array(init_value, dtype=dtype).view(mx.uint16) if dtype in (mx.bfloat16,
                                mx.float16) else mx.array(init_value, dtype=dtype))
            outs.append(np.full(tuple(shape), fill, dtype=_TYPES[dtype][1]))
        bufs = host + outs
        shapes = np.zeros(8 * len(host) + 1, dtype=np.int32)
        strides = np.zeros(8 * len(host) + 1, dtype=np.int64)
        for i, a in enumerate(inputs):
            assert a.ndim <= 8, "at most 8 dimensions"
            shapes[8 * i : 8 * i + a.ndim] = a.shape
            strides[8 * i : 8 * i + a.ndim] = [s // host[i].itemsize for s in host[i].strides]
        ptrs = (ctypes.c_void_p * len(bufs))(*[b.ctypes.data for b in bufs])
        sizes = np.array([b.size for b in bufs], dtype=np.int64)
        dims = np.array([*grid, *threadgroup], dtype=np.int32)
        err = ctypes.create_string_buffer(512)
        rc = lib.lx_launch(ptrs, *(ctypes.c_void_p(a.ctypes.data) for a in (sizes, shapes, strides)),
                           ctypes.c_void_p(dims.ctypes.data), ctypes.c_void_p(dims.ctypes.data + 12), err)
        if rc:
            raise RenderError(f"{name}: {err.value.decode()}")
        res = []
        for o, dtype in zip(outs, output_dtypes):
            arr = mx.array(o)
            res.append(arr.view(dtype) if dtype in (mx.bfloat16, mx.float16) else arr)
        return res

    return call
