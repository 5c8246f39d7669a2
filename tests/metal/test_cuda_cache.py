"""CUDA kernel builds kept in MLX's PTX cache (metal/cuda_cache.py): the module name MLX looks for (libstdc++'s
std::hash of the source MLX generates), the module files, and the builds themselves (nvcc here, NVRTC where a
libnvrtc is found; on a CUDA device, MLX's own generated source and a launch from the cache)."""

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from lattice_mlx import settings
from lattice_mlx.bench.synthetic import QWEN3_5_0_8B
from lattice_mlx.metal import _dialect, cpu_render, cuda_cache, metal_source, nvrtc
from lattice_mlx.variants import SMALL, distinct, model_calls

HASH_PROGRAM = r"""
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::ifstream f(argv[i], std::ios::binary);
    std::stringstream s;
    s << f.rdbuf();
    std::cout << std::hex << std::hash<std::string>{}(s.str()) << "\n";
  }
}
"""


def small_calls(widths=(1, 2, 5)) -> list[_dialect.Call]:
    """One call per variant of a small bf16 4-bit model (every kernel the decode loops use)."""
    text = {**QWEN3_5_0_8B, **SMALL}
    return list(distinct(model_calls(text, dtype=mx.bfloat16, bits=4, group_size=64, widths=widths)).values())


def one_per_kernel(calls):
    out = {}
    for c in calls:
        out.setdefault(c.kernel.name, c)
    return list(out.values())


@pytest.mark.skipif(cpu_render.compiler() is None, reason="no C++ compiler")
def test_std_hash_is_libstdcxx(tmp_path):
    """The module name's hash equals C++'s std::hash<std::string> for lengths around every 8-byte boundary and for
    a generated kernel source."""
    src = tmp_path / "h.cpp"
    src.write_text(HASH_PROGRAM)
    subprocess.run([cpu_render.compiler(), "-O1", "-o", str(tmp_path / "h"), str(src)], check=True)
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (0, 1, 7, 8, 9, 15, 16, 17, 1000)]
    call = small_calls((1,))[0]
    blobs.append(cuda_cache.mlx_source(call.kernel, list(call.inputs), list(call.template),
                                       list(call.output_dtypes))[1].encode())
    paths = []
    for i, b in enumerate(blobs):
        paths.append(tmp_path / f"b{i}")
        paths[-1].write_bytes(b)
    out = subprocess.run([str(tmp_path / "h"), *map(str, paths)], check=True, capture_output=True, text=True)
    assert [int(h, 16) for h in out.stdout.split()] == [cuda_cache.std_hash(b) for b in blobs]


class _Kernel:
    """What mlx_source reads of a _dialect.Kernel."""

    name, build_name = "k", "k_0123456789"
    inputs, outputs = ("x", "w", "n"), ("y",)

    def source(self, dialect):
        return "  y[0] = x[x_shape[0] + w_strides[1]] * n[0];"


def test_mlx_source_is_mlx_build_kernel():
    """The source MLX 0.32's cuda_kernel generates (custom_kernel.cpp's build_kernel), written out by hand from it:
    header, namespace, signature (a shape / strides / ndim argument only for an array input the body names it for),
    template constants in order (an int, a bool, a dtype), body; the kernel's name carries the template suffix."""
    x, w, n = mx.zeros((2, 3), mx.bfloat16), mx.zeros((4, 5), mx.uint32), mx.array(3)
    name, src = cuda_cache.mlx_source(_Kernel(), [x, w, n], [("R", 4), ("ON", True), ("OT", mx.bfloat16)],
                                      [mx.float32])
    assert name == "custom_kernel_k_0123456789_4_t_bfloat16_t"
    assert src == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        + _dialect.header("cuda")
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_k_0123456789_4_t_bfloat16_t(\n"
        "    const __nv_bfloat16* x,\n    const __grid_constant__ Shape x_shape,\n"
        "    const uint32_t* w,\n    const __grid_constant__ Strides w_strides,\n"
        "    const int32_t* n,\n"
        "    float* y) {\n"
        "  constexpr int R = 4;\n  constexpr bool ON = true;\n  using OT = __nv_bfloat16;\n\n"
        "  y[0] = x[x_shape[0] + w_strides[1]] * n[0];"
        "\n}\n\n} // namespace mlx::core::cu\n")
    assert cuda_cache.module_name(name, src) == f"{name}_{cuda_cache.std_hash(src.encode()):x}"


def test_module_path_is_mlx_get_ptx_path(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert cuda_cache.module_path("a_1f") == tmp_path / "a_1f.ptx"
    long = "x" * 245 + "y" * 245 + "z" * 3  # past 245 characters a name is cut into folders
    assert cuda_cache.module_path(long) == tmp_path / ("x" * 245) / ("y" * 245) / "zzz.ptx"
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "t"))
    assert cuda_cache.module_path("a") == tmp_path / "t" / "mlx" / mx.__version__ / "ptx" / "a.ptx"


def _device_tree(root: Path) -> None:
    """MLX's include names as NVRTC is given them: our device header, the empty cooperative_groups."""
    (root / "mlx/backend/cuda/device").mkdir(parents=True)
    (root / nvrtc.DEVICE_HEADER_NAME).write_text(cuda_cache.DEVICE_HEADER)
    (root / "cooperative_groups.h").write_text(nvrtc.COOPERATIVE_GROUPS)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on the PATH")
def test_generated_sources_compile_against_the_device_header(tmp_path):
    """MLX's generated source of one variant of every kernel, with our device header, builds for the H200 (nvcc
    here; the product builds with NVRTC, under MLX's options)."""
    _device_tree(tmp_path)
    failures = []
    for call in one_per_kernel(small_calls()):
        name, src = cuda_cache.mlx_source(call.kernel, list(call.inputs), list(call.template), list(call.output_dtypes))
        path = tmp_path / f"{call.kernel.name}.cu"
        path.write_text(src)
        res = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-I", str(tmp_path), "-o", str(path) + ".cubin",
                              str(path)], capture_output=True, text=True, check=False)
        if res.returncode:
            failures.append(f"{call.kernel.name}: {res.stderr[-1500:]}")
    assert not failures, "\n".join(failures)


def _nvrtc_path() -> str | None:
    with contextlib.suppress(nvrtc.NvrtcError, OSError):
        path = nvrtc.find(settings.raw("nvrtc"))
        nvrtc.Nvrtc(path).version()
        return path
    return None


needs_nvrtc = pytest.mark.skipif(_nvrtc_path() is None or cuda_cache.cuda_include() is None,
                                 reason="no libnvrtc (LATTICE_NVRTC) or CUDA headers (CUDA_HOME)")


@needs_nvrtc
def test_prebuild_writes_what_mlx_reads(monkeypatch, tmp_path):
    """prebuild in two worker processes: one module per distinct source (variants differing only in what the source
    does not depend on share one), each a cubin beside `<qualified name>\\t<lowered name>`; a second prebuild finds
    them all; a job that cannot build is named on stderr and the others are built."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    calls = small_calls((1, 2))
    sources = {cuda_cache.mlx_source(c.kernel, list(c.inputs), list(c.template), list(c.output_dtypes)) for c in calls}
    assert cuda_cache.prebuild(calls, workers=2, target="sm_90a") == len(sources)
    for name, src in sources:
        path = cuda_cache.module_path(cuda_cache.module_name(name, src))
        assert path.read_bytes()[:4] == b"\x7fELF"
        qualified, lowered = path.with_suffix(".txt").read_text().rstrip("\n").split("\t")
        assert qualified == f"mlx::core::cu::{name}" and name in lowered and lowered.startswith("_Z")
    assert not list(tmp_path.rglob("*.tmp"))
    assert cuda_cache.prebuild(calls, workers=2, target="sm_90a") == 0

    broken = _dialect.Kernel("lattice_broken", "  this is not C++;", ("x",), ("y",), ensure_row_contiguous=True,
                             consts=())
    good = calls[0]
    shutil.rmtree(tmp_path)
    bad = _dialect.Call(broken, (mx.zeros(4),), (), (1, 1, 1), (1, 1, 1), ((4,),), (mx.float32,))
    assert cuda_cache.prebuild([bad, good], workers=1, target="sm_90a") == 1


@needs_nvrtc
def test_ensure_builds_once_per_build_setup(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    c = small_calls((1,))[0]
    args = (c.kernel, list(c.inputs), list(c.template), list(c.output_dtypes))
    assert cuda_cache.ensure(*args, target="sm_90a") is True
    assert cuda_cache.ensure(*args, target="sm_90a") is False
    # a module another build left (another GPU, NVRTC or device header: its stamp differs) is built again
    stamp = next(tmp_path.rglob("*.lattice"))
    stamp.write_text("built elsewhere")
    assert cuda_cache.ensure(*args, target="sm_90a") is True
    assert cuda_cache.ensure(*args, target="sm_80") is True and cuda_cache.ensure(*args, target="sm_80") is False


def test_a_failing_keep_is_said_once_and_left_to_mlx(monkeypatch, capsys):
    """A build that cannot be kept (no NVRTC, say) prints one line; later variants are not tried again."""
    tries = []

    def fail(*a, **k):
        tries.append(1)
        raise nvrtc.NvrtcError("NVRTC not found")

    monkeypatch.setattr(cuda_cache, "ensure", fail)
    monkeypatch.setattr(_dialect, "_KEEP_FAILED", [])
    with settings.override(kernel_cache=True):
        for _ in range(3):
            _dialect._keep_build(None, [], [], [])
    assert len(tries) == 1
    assert capsys.readouterr().err.count("not kept on disk") == 1
    with settings.override(kernel_cache=False):  # off: never tried
        monkeypatch.setattr(_dialect, "_KEEP_FAILED", [])
        _dialect._keep_build(None, [], [], [])
    assert len(tries) == 1


cuda_only = pytest.mark.skipif(mx.metal.is_available() or mx.default_device() == mx.cpu
                               or not hasattr(mx, "device_info"), reason="MLX's CUDA backend only")


@cuda_only
def test_mlx_generates_the_source_we_name():
    """MLX's own generated source (verbose launch) of one variant of every kernel equals mlx_source's."""
    for call in one_per_kernel(small_calls()):
        impl = call.kernel._impl("cuda")
        with metal_source.printed() as text:
            impl(inputs=list(call.inputs), template=list(call.template), grid=call.grid,
                 threadgroup=call.threadgroup, output_shapes=[list(s) for s in call.output_shapes],
                 output_dtypes=list(call.output_dtypes), verbose=True)
        name, src = cuda_cache.mlx_source(call.kernel, list(call.inputs), list(call.template), list(call.output_dtypes))
        (body,) = metal_source.generated_sources(text[0])
        assert body == src, call.kernel.name


@cuda_only
def test_mlx_launches_the_kept_build():
    """MLX launches a variant from the module kept under its name, not from its own compile: the module written
    there is built from an altered body (x * 3 + 1 where the kernel says x * 2 + 1), and the launch computes that."""
    tag = os.urandom(4).hex()  # a body no process has built before
    kernel = _dialect.Kernel(f"lattice_probe_{tag}", "  y[LX_GID_X] = x[LX_GID_X] * 2.0f + 1.0f;", ("x",), ("y",),
                             ensure_row_contiguous=True, consts=())
    x = mx.arange(64, dtype=mx.float32)
    job = cuda_cache.job(kernel, [x], [], [mx.float32], cuda_cache.arch())
    altered = dict(job, source=job["source"].replace("* 2.0f", "* 3.0f"))
    assert altered["source"] != job["source"]
    cuda_cache._compiler().build(altered)  # (written at job's path: the name MLX derives from the real source)
    y = kernel._impl("cuda")(inputs=[x], template=[], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
                             output_dtypes=[mx.float32])[0]
    assert mx.array_equal(y, x * 3 + 1).item()
