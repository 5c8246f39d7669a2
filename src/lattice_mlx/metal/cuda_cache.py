"""Kernel builds kept on disk for MLX's CUDA backend: a custom kernel's variant compiled once per machine, not once
per process.

MLX compiles every `mx.fast.cuda_kernel` variant with NVRTC when a process first launches it and writes none to disk
(a first generation's cost: docs/results/code_measurements.md, 'Kernel builds kept on disk'), but it reads its PTX
cache (`MLX_PTX_CACHE_DIR`, else <temp>/mlx/<version>/ptx) before compiling any module. This module writes that cache
for our kernels: it rebuilds the source MLX generates for a variant (its `build_kernel`: header, signature, template
constants, body), names the module as MLX does (`<kernel>_<std::hash of the source, hex>`; `std_hash` is libstdc++'s), compiles it
with NVRTC under MLX's options, and writes the cubin and its kernel's lowered name where MLX looks. A module whose
name does not match is never read (MLX compiles as before); what it computes is MLX's own source under MLX's options.
`prebuild` compiles many variants in worker processes (NVRTC serialises the compiles of one process).

MLX's source includes its device header `utils.cuh`, which the wheel does not ship; the module compiles against
`DEVICE_HEADER`, which declares what a generated signature and our bodies use (the bf16 / fp16 types, `Shape` and
`Strides` laid out as MLX's `cuda::std::array<_, MAX_NDIM>`).

On unless LATTICE_KERNEL_CACHE=0 (run on a GPU: docs/kernels.md). Mirrors MLX 0.32.x
(`mlx/backend/cuda/custom_kernel.cpp`, `jit_module.cpp`).
"""

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx

from lattice_mlx import settings
from lattice_mlx.metal import nvrtc

MAX_NDIM = 10  # MLX's mlx/backend/cuda/device/config.h
DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
DEVICE_HEADER = f"""#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define MAX_NDIM {MAX_NDIM}
// NVRTC has no <cstdint>: the C library's own types (a repeated typedef of the same type is legal where nvcc's host
// headers declared them already)
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#ifdef _WIN32
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
typedef long int64_t;
typedef unsigned long uint64_t;
#endif
namespace mlx::core::cu {{
template <typename T>
struct lx_dims {{
  T v[MAX_NDIM];
  __device__ __forceinline__ T operator[](int i) const {{ return v[i]; }}
}};
using Shape = lx_dims<int32_t>;
using Strides = lx_dims<int64_t>;
}}  // namespace mlx::core::cu
"""

_CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
               mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
               mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double"}
_TYPE_STRINGS = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float64: "double",
                 mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
                 mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t"}
MAX_FILE_NAME = 245  # jit_module.cpp's get_ptx_path: longer module names become folders


def enabled() -> bool:
    return settings.on("kernel_cache")


def std_hash(data: bytes) -> int:
    """libstdc++'s std::hash<std::string> on 64-bit (std::_Hash_bytes, MurmurHash64A-like, seed 0xc70f6907)."""
    m64 = (1 << 64) - 1
    mul = 0xC6A4A7935BD1E995
    shift_mix = lambda v: v ^ (v >> 47)  # noqa: E731
    n, end = len(data), len(data) & ~7
    h = (0xC70F6907 ^ (n * mul)) & m64
    for i in range(0, end, 8):
        d = shift_mix(int.from_bytes(data[i : i + 8], "little") * mul & m64) * mul & m64
        h = (h ^ d) * mul & m64
    if n & 7:
        h = (h ^ int.from_bytes(data[end:], "little")) * mul & m64
    return shift_mix(shift_mix(h) * mul & m64)


def _template_suffix(template: Iterable) -> str:
    """custom_kernel.cpp's template_arguments_hash: what a template adds to the kernel's name."""
    out = ""
    for _, value in template:
        if isinstance(value, bool):
            out += "_t" if value else "_f"
        elif isinstance(value, int):
            out += f"_{value}"
        else:
            out += "_" + _TYPE_STRINGS[value]
    return out


def mlx_source(kernel, inputs: list[mx.array], template: list, output_dtypes: list) -> tuple[str, str]:
    """(kernel name, source) as MLX's cuda_kernel generates them for this variant of `kernel` (_dialect.Kernel)."""
    from lattice_mlx.metal import _dialect

    body = kernel.source("cuda")
    name = "custom_kernel_" + kernel.build_name + _template_suffix(template)
    src = DEFAULT_HEADER + _dialect.header("cuda")
    src += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    src += f"__global__ void {name}(\n"
    for n, a in zip(kernel.inputs, inputs):
        src += f"    const {_CUDA_TYPES[a.dtype]}* {n},\n"
        if a.ndim > 0:
            for suffix, ctype in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if n + suffix in body:
                    src += f"    const __grid_constant__ {ctype} {n}{suffix},\n"
    src += ",\n".join(f"    {_CUDA_TYPES[d]}* {n}" for n, d in zip(kernel.outputs, output_dtypes)) + ") {\n"
    if template:
        for n, value in template:
            if isinstance(value, bool):
                src += f"  constexpr bool {n} = {'true' if value else 'false'};\n"
            elif isinstance(value, int):
                src += f"  constexpr int {n} = {value};\n"
            else:
                src += f"  using {n} = {_CUDA_TYPES[value]};\n"
        src += "\n"
    src += body + "\n}\n\n} // namespace mlx::core::cu\n"
    return name, src


def module_name(kernel_name: str, source: str) -> str:
    return f"{kernel_name}_{std_hash(source.encode()):x}"


def cache_dir() -> Path:
    """Where MLX reads PTX modules from: MLX_PTX_CACHE_DIR, else <temp>/mlx/<MLX version>/ptx (the temp folder as
    std::filesystem::temp_directory_path finds it)."""
    if settings.raw("ptx_cache_dir"):
        return Path(settings.raw("ptx_cache_dir")).absolute()
    tmp = next((v for v in (settings.raw(n) for n in ("tmpdir", "tmp", "temp", "tempdir")) if v), "/tmp")
    return Path(tmp) / "mlx" / mx.__version__ / "ptx"


def module_path(name: str) -> Path:
    path, rest = cache_dir(), name
    while len(rest) > MAX_FILE_NAME:
        path, rest = path / rest[:MAX_FILE_NAME], rest[MAX_FILE_NAME:]
    return path / (rest + ".ptx")


def cuda_include(nvrtc_major: int = 13) -> str | None:
    """The CUDA headers' folder, looked for where MLX looks (jit_module.cpp's include_path_args): the nvidia/cu13
    package (cuda_runtime before CUDA 13) beside the mlx package, else CUDA_HOME, CUDA_PATH, /usr/local/cuda."""
    sub = "cu13" if nvrtc_major >= 13 else "cuda_runtime"
    path = Path(mx.__file__).parent.parent / "nvidia" / sub / "include"  # (mx.__file__: <site>/mlx/core*.so)
    home = settings.raw("cuda_home") or settings.raw("cuda_path") or "/usr/local/cuda"
    # (the runtime's headers: pip's NVRTC package alone makes that folder with nvrtc.h only)
    for folder in (path, Path(home) / "include"):
        if (folder / "cuda_bf16.h").is_file():
            return str(folder)
    return None


def arch() -> str:
    """The device's NVRTC target as MLX chooses it: sm_<major><minor>, with an `a` from compute capability 9 on."""
    info = mx.device_info()
    if "compute_capability_major" in info:
        major, minor = int(info["compute_capability_major"]), int(info["compute_capability_minor"])
    elif str(info.get("architecture", "")).startswith("sm_") and len(str(info["architecture"])) > 4:
        cc = str(info["architecture"])[3:]
        major, minor = int(cc[:-1]), int(cc[-1])
    else:
        raise nvrtc.NvrtcError("MLX does not say this GPU's compute capability")
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def options(target: str, nvrtc_major: int = 13) -> list[str]:
    """MLX's NVRTC options (jit_module.cpp's compile) and include folders: the mlx package's include/ and
    include/cccl, then the CUDA headers."""
    opts = ["--device-as-default-execution-space", f"--gpu-architecture={target}"]
    include = Path(mx.__file__).parent / "include"
    for path in (include, include / "cccl"):
        if path.is_dir():
            opts.append(f"--include-path={path}")
    cuda = cuda_include(nvrtc_major)
    if cuda is None:
        raise nvrtc.NvrtcError("no CUDA headers found (set CUDA_HOME)")
    return opts + [f"--include-path={cuda}"]


_nvrtc: nvrtc.Nvrtc | None = None
_lock = threading.Lock()


def _compiler() -> nvrtc.Nvrtc:
    global _nvrtc
    with _lock:
        if _nvrtc is None:
            _nvrtc = nvrtc.Nvrtc(nvrtc.find(settings.raw("nvrtc")))
        return _nvrtc


def job(kernel, inputs: list[mx.array], template: list, output_dtypes: list, target: str) -> dict:
    """What building this variant's module takes (nvrtc.Nvrtc.build): MLX's source, the kernel's qualified name,
    MLX's options, our device header, where MLX will look for it, and the stamp its build leaves beside it."""
    kernel_name, source = mlx_source(kernel, inputs, template, output_dtypes)
    opts, stamp = _build_config(target)
    return dict(source=source, name=f"mlx::core::cu::{kernel_name}", options=list(opts), header=DEVICE_HEADER,
                path=str(module_path(module_name(kernel_name, source))), stamp=stamp)


@functools.cache
def _build_config(target: str) -> tuple[tuple[str, ...], str]:
    """(NVRTC options, the stamp of a build: header, options and NVRTC version) for `target`, once per process."""
    version = _compiler().version()
    opts = tuple(options(target, version[0]))
    stamp = hashlib.sha1("\x00".join([DEVICE_HEADER, nvrtc.COOPERATIVE_GROUPS, *opts, str(version)]).encode())
    return opts, stamp.hexdigest()


def _present(job: dict) -> bool:
    """Whether MLX's cache holds this job's module as this build would write it: its name covers MLX's source
    alone, so a module built for another GPU, by another NVRTC or against another device header is built again."""
    path = Path(job["path"])
    try:
        return path.with_suffix(".txt").exists() and path.with_suffix(".lattice").read_text() == job["stamp"]
    except OSError:
        return False


# Modules this process built (at load, and at a variant's first launch) and the seconds that took: benchmarks
# report them beside the first generation's
_BUILT = {"modules": 0, "seconds": 0.0}


def built() -> dict:
    return dict(_BUILT)


def ensure(kernel, inputs: list[mx.array], template: list, output_dtypes: list, *, target: str | None = None) -> bool:
    """Writes this variant's module into MLX's PTX cache unless it is there; True when it was built here."""
    todo = job(kernel, inputs, template, output_dtypes, target or arch())
    if _present(todo):
        return False
    tic = time.perf_counter()
    _compiler().build(todo)
    _BUILT["modules"] += 1
    _BUILT["seconds"] += time.perf_counter() - tic
    return True


def prebuild(calls: Iterable, *, workers: int | None = None, target: str | None = None) -> int:
    """Builds the modules of recorded calls (_dialect.Call) that MLX's cache lacks: the first here (a failure to build
    at all, no CUDA headers say, raises), the rest in `workers` worker processes (default: one per core). Returns
    how many were built. A module that fails to build is left to MLX (which fails it, or builds it, as it would
    have)."""
    target = target or arch()
    variants = {}
    for call in calls:
        variants.setdefault(call.variant(), call)
    todo = {}
    for call in variants.values():
        j = job(call.kernel, list(call.inputs), list(call.template), list(call.output_dtypes), target)
        if not _present(j):
            todo.setdefault(j["path"], (call.kernel.name, j))
    if not todo:
        return 0
    jobs = list(todo.values())
    tic = time.perf_counter()
    name, first = jobs.pop(0)
    try:
        _compiler().build(first)
        done = 1
    except nvrtc.NvrtcError as e:
        if "open source file" in str(e):  # the build itself cannot work here (headers): no worker tries
            raise
        print(f"lattice_mlx: kernel {name} not prebuilt ({str(e).splitlines()[0]})", file=sys.stderr)
        done = 0
    workers = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    lib = _compiler().path
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for w in range(workers if jobs else 0):
            mine = jobs[w::workers]
            path = Path(tmp) / f"jobs{w}.json"
            path.write_text(json.dumps([j for _, j in mine]))
            procs.append((subprocess.Popen([sys.executable, nvrtc.__file__, lib, str(path)], stdout=subprocess.PIPE,
                                           text=True), mine))
        for proc, mine in procs:
            out, _ = proc.communicate()
            results = []
            for line in out.splitlines():
                try:
                    results.append(json.loads(line))
                except ValueError:
                    results.append(f"unreadable worker output: {line[:80]}")
            for (name, _), err in zip(mine, results):
                if err:
                    print(f"lattice_mlx: kernel {name} not prebuilt ({err})", file=sys.stderr)
            done += sum(1 for err in results if not err)
            if len(results) < len(mine) or proc.returncode:
                print(f"lattice_mlx: a kernel build worker stopped (exit {proc.returncode}); MLX builds the rest",
                      file=sys.stderr)
    _BUILT["modules"] += done
    _BUILT["seconds"] += time.perf_counter() - tic
    return done
