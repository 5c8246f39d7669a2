"""Dialect macros: one kernel body (with `LX_*` names) renders to Metal or CUDA source for MLX custom kernels, or to
C++ for the CPU render (cpu_render.py), which runs the same body on this machine's CPU as a GPU would run it.

The body is written once; `render(body, dialect)` swaps each `LX_*` name for the dialect's spelling and
`header(dialect)` holds the few helpers that cannot be a plain substitution (warp sum, 8-wide loads). `build` gives
the `Kernel` every dispatcher calls: it launches on the backend in use, checks each new variant once (a failure to
build or launch falls back to the op's reference for that kernel alone), and can be recorded instead of launched
(`recording`: the variants a model asks for, with no device and nothing computed).
"""

import functools
import hashlib
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from lattice_mlx import settings

# Thread ids: TID = thread in its threadgroup/block, GID = thread in the grid, BID = threadgroup/block in the grid,
# NBLK = threadgroups/blocks in the grid. SHARED declares threadgroup/shared memory; BARRIER syncs a threadgroup.
_METAL = {
    "LX_TID_X": "thread_position_in_threadgroup.x",
    "LX_GID_X": "thread_position_in_grid.x",
    "LX_GID_Y": "thread_position_in_grid.y",
    "LX_BID_Z": "threadgroup_position_in_grid.z",
    "LX_BID_X": "threadgroup_position_in_grid.x",
    "LX_BID_Y": "threadgroup_position_in_grid.y",
    "LX_NBLK_X": "threadgroups_per_grid.x",
    "LX_SHARED": "threadgroup",
    "LX_BARRIER": "threadgroup_barrier(mem_flags::mem_threadgroup)",
    "LX_SIMD_SUM": "simd_sum",
    "LX_SHFL": "lx_shfl",
    "LX_SHFL_XOR": "lx_shfl_xor",
    "LX_EXP": "metal::exp",
    "LX_EXP2": "metal::exp2",
    "LX_COS": "metal::cos",
    "LX_SIN": "metal::sin",
    "LX_LOG": "metal::log",
    "LX_RSQRT": "metal::rsqrt",
    "LX_FMAX": "metal::max",
    "LX_FABS": "metal::abs",
    "LX_LOAD8": "lx_load8",
    "LX_LOAD_U4": "*(const device uint4*)",
    "LX_BYTE_F": "lx_byte_f",
    "LX_F32": "static_cast<float>",
    "LX_FMA": "metal::fma",
}

_CUDA = {
    "LX_TID_X": "threadIdx.x",
    "LX_GID_X": "(blockIdx.x * blockDim.x + threadIdx.x)",
    "LX_GID_Y": "(blockIdx.y * blockDim.y + threadIdx.y)",
    "LX_BID_Z": "blockIdx.z",
    "LX_BID_X": "blockIdx.x",
    "LX_BID_Y": "blockIdx.y",
    "LX_NBLK_X": "gridDim.x",
    "LX_SHARED": "__shared__",
    "LX_BARRIER": "__syncthreads()",
    "LX_SIMD_SUM": "lx_warp_sum",
    "LX_SHFL": "lx_shfl",
    "LX_SHFL_XOR": "lx_shfl_xor",
    "LX_EXP": "expf",
    "LX_EXP2": "exp2f",
    "LX_COS": "cosf",
    "LX_SIN": "sinf",
    "LX_LOG": "logf",
    "LX_RSQRT": "rsqrtf",
    "LX_FMAX": "fmaxf",
    "LX_FABS": "fabsf",
    "LX_LOAD8": "lx_load8",
    "LX_LOAD_U4": "*(const uint4*)",
    "LX_BYTE_F": "lx_byte_f",
    "LX_F32": "static_cast<float>",
    "LX_FMA": "fmaf",
}

# The CPU render (cpu_render.h): thread positions are the current fiber's, threadgroup memory is a static array in a
# section the runtime fills with NaN bytes before every threadgroup, SIMD operations wait for their group's lanes.
_CPU = {
    "LX_TID_X": "lx_thr().tid.x",
    "LX_GID_X": "lx_thr().gid.x",
    "LX_GID_Y": "lx_thr().gid.y",
    "LX_BID_Z": "lx_thr().bid.z",
    "LX_BID_X": "lx_thr().bid.x",
    "LX_BID_Y": "lx_thr().bid.y",
    "LX_NBLK_X": "lx_thr().nblk.x",
    "LX_SHARED": 'static __attribute__((section("lxtg")))',
    "LX_BARRIER": "lx_barrier()",
    "LX_SIMD_SUM": "lx_simd_sum",
    "LX_SHFL": "lx_shfl",
    "LX_SHFL_XOR": "lx_shfl_xor",
    "LX_EXP": "std::exp",
    "LX_EXP2": "std::exp2",
    "LX_COS": "std::cos",
    "LX_SIN": "std::sin",
    "LX_LOG": "std::log",
    "LX_RSQRT": "lx_rsqrt",
    "LX_FMAX": "std::fmax",
    "LX_FABS": "std::fabs",
    "LX_LOAD8": "lx_load8",
    "LX_LOAD_U4": "lx_load_u4",
    "LX_BYTE_F": "lx_byte_f",
    "LX_F32": "static_cast<float>",
    "LX_FMA": "std::fma",
}

# Metal: the compiler vectorises the plain loop; lx_byte_f reads byte i (a value < 256) as a float.
_METAL_HEADER = """
template <typename T>
inline void lx_load8(const device T* p, thread float* o) {
  for (int i = 0; i < 8; ++i) o[i] = static_cast<float>(p[i]);
}
inline float lx_byte_f(uint32_t u, int i) { return static_cast<float>((u >> (8 * i)) & 0xFFu); }
inline float lx_shfl(float x, int l) { return simd_shuffle(x, ushort(l)); }
inline float lx_shfl_xor(float x, int m) { return simd_shuffle_xor(x, ushort(m)); }
"""

# CUDA: 16-byte loads unpacked by hand; lx_byte_f places byte i under the exponent of 2^23 (one PRMT and one
# FADD instead of the slow integer-to-float conversion).
_CUDA_HEADER = """
__device__ __forceinline__ float lx_warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float lx_shfl(float x, int l) { return __shfl_sync(0xffffffffu, x, l); }
__device__ __forceinline__ float lx_shfl_xor(float x, int m) { return __shfl_xor_sync(0xffffffffu, x, m); }
__device__ __forceinline__ void lx_load8(const float* p, float* o) {
  float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ void lx_load8(const __nv_bfloat16* p, float* o) {
  uint4 u = *(const uint4*)p;
  unsigned int w[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = __uint_as_float(w[i] << 16);
    o[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ void lx_load8(const __half* p, float* o) {
  uint4 u = *(const uint4*)p;
  const __half2* h = (const __half2*)&u;
  for (int i = 0; i < 4; ++i) {
    float2 f = __half22float2(h[i]);
    o[2 * i] = f.x; o[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ float lx_byte_f(uint32_t u, int i) {
  return __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650u | i)) - 8388608.0f;
}
"""

_TABLES = {"metal": _METAL, "cuda": _CUDA, "cpu": _CPU}
_HEADERS = {"metal": _METAL_HEADER, "cuda": _CUDA_HEADER, "cpu": ""}  # cpu: in cpu_render.h
_NAME = re.compile(r"\bLX_[A-Z0-9_]+\b")


def render(body: str, dialect: str) -> str:
    """The body with every `LX_*` name replaced by the dialect's spelling; an unknown name is an error."""
    table = _TABLES[dialect]
    return _NAME.sub(lambda m: table[m.group(0)], body)


def header(dialect: str) -> str:
    return _HEADERS[dialect]


def mode() -> str:
    """LATTICE_KERNELS (lattice_mlx.settings): "" (kernels on a GPU backend), "ref" (the plain-ops references
    everywhere) or "cpu" (the kernel bodies run through the CPU render: slow, for tests and the doctor)."""
    return settings.raw("kernels")


def backend() -> str:
    """'metal', 'cuda' or 'cpu' (the CPU render): the dialect kernels launch in."""
    if mode() == "cpu":
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def literal(value: float | int | bool) -> str:
    """`value` as a source literal both dialects read the same: a float as its fp32 value to 9 digits (exact)."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        assert -(2**31) <= int(value) < 2**31, value
        return str(int(value))
    if not isinstance(value, (float, np.floating)):
        raise TypeError(f"a kernel constant is a bool, an int or a float, not {type(value).__name__}")
    value = float(np.float32(value))
    assert math.isfinite(value), value
    return f"{value:.9e}f"


def constants(**values: float | int | bool) -> tuple[tuple[str, str], ...]:
    """Named constants for `build` (the `consts` argument), hashable for its cache."""
    return _constants(tuple(sorted((k, type(v), v) for k, v in values.items())))


@functools.cache
def _constants(items: tuple) -> tuple[tuple[str, str], ...]:  # keyed by type too: True == 1 as a dict key
    return tuple((k, literal(v)) for k, _, v in items)


def declare(consts: tuple[tuple[str, str], ...]) -> str:
    """The declarations `build` puts at the top of a body for `consts` (from `constants`)."""
    def ctype(v: str) -> str:
        return "bool" if v in ("true", "false") else "float" if v.endswith("f") else "int"
    return "".join(f"  const {ctype(v)} {k} = {v};\n" for k, v in consts)


class KernelFailed(RuntimeError):
    """The kernel cannot build or launch here: its dispatcher runs the op's reference instead."""


_FAILED: dict[str, str] = {}  # kernel name -> why it failed, for this process


def failed() -> dict[str, str]:
    """The kernels that failed in this process (name -> the first line of the error)."""
    return dict(_FAILED)


@dataclass(frozen=True)
class OpCall:
    """A call of an op's kernel function (`op`): the function, its reference (same contract) and the arguments."""

    fn: Callable
    reference: Callable
    args: tuple
    kwargs: dict


_ops: list[OpCall] = []  # the op calls in progress while recording


def op(reference: Callable) -> Callable:
    """Decorates an op's kernel function (`<op>_kernel`) with its reference, so that a recorded launch knows the
    op call it came from (`Call.op`): `python -m lattice_mlx.doctor` reruns that on other inputs against the
    reference. The reference takes the kernel function's arguments (keywords it has no use for are dropped)."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if _recorder is None:
                return fn(*args, **kwargs)
            _ops.append(OpCall(call, reference, args, kwargs))
            try:
                return fn(*args, **kwargs)
            finally:
                _ops.pop()

        call.reference = reference
        return call

    return wrap


def variant_key(name: str, inputs, template, output_dtypes, threadgroup) -> tuple:
    """What the compiled source depends on (MLX's metal_kernel: the template, each input's dtype and whether it is a
    scalar or under 8 elements, the output dtypes) and the threadgroup, which a launch checks. Hashable, and cheap:
    every launch outside a trace computes it."""
    return (name, tuple(template), tuple((a.dtype, a.ndim == 0, a.size < 8) for a in inputs), tuple(output_dtypes),
            tuple(threadgroup))


@dataclass(frozen=True)
class Call:
    """One launch a dispatcher asked for: the kernel and its arguments (what `recording` collects), and the op call
    it came from."""

    kernel: "Kernel"
    inputs: tuple
    template: tuple
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple
    output_dtypes: tuple
    init_value: float | None = None
    op: OpCall | None = None

    def variant(self) -> tuple:
        return variant_key(self.kernel.name, self.inputs, self.template, self.output_dtypes, self.threadgroup)


_recorder: list[Call] | None = None
_spying = False


def recording_active() -> bool:
    """Inside `recording()` (not `recording(spy=True)`)."""
    return _recorder is not None and not _spying


def collecting() -> bool:
    """Inside `recording()` either way: use_kernels() is true, whatever the backend."""
    return _recorder is not None


@contextmanager
def recording(*, spy: bool = False) -> Iterator[list[Call]]:
    """Inside the block every kernel call is collected (into the list it yields) instead of launched, and returns
    lazy zeros of its output shapes; use_kernels() is true whatever the backend. Nothing is computed.

    With `spy`, a collected call then raises KernelFailed (nothing marked failed), so every dispatcher runs its
    reference: a real decode loop runs as it would, with real values, and shows which calls it makes."""
    global _recorder, _spying
    before, _recorder, spied, _spying = _recorder, [], _spying, spy
    try:
        yield _recorder
    finally:
        _recorder, _spying = before, spied


class Kernel:
    """One kernel (a body, its argument names and constants), launched through MLX on Metal or CUDA, or the CPU render.

    The first call of each variant (`Call.variant`) on Metal or CUDA also runs it once on zero inputs of the same
    shapes and evaluates that, inside a guard: MLX builds custom kernels when a graph is evaluated, and the model's
    own calls are often inside an mx.compile trace, where nothing can be evaluated. A kernel that fails to build or
    launch is marked failed for the process, one line says so on stderr, and `KernelFailed` sends its dispatcher to
    the reference."""

    def __init__(self, name: str, body: str, inputs: tuple[str, ...], outputs: tuple[str, ...], *,
                 ensure_row_contiguous: bool, consts: tuple[tuple[str, str], ...]):
        self.name, self.inputs, self.outputs = name, inputs, outputs
        self.ensure_row_contiguous, self.consts = ensure_row_contiguous, consts
        self.body = declare(consts) + body
        # the name MLX caches a build under carries a hash of the source and the inputs (MLX's CUDA backend caches on
        # disk by name, under the temp folder): an edited body or other constants must not reuse an old build
        key = "\x00".join([self.body, *inputs, *outputs])
        self.build_name = f"{name}_{hashlib.sha1(key.encode()).hexdigest()[:10]}"
        self._impls: dict[str, Callable] = {}
        self.launched: set[tuple] = set()

    def source(self, dialect: str) -> str:
        return render(self.body, dialect)

    def _impl(self, dialect: str) -> Callable:
        if dialect not in self._impls:
            if dialect == "cpu":
                from lattice_mlx.metal import cpu_render

                make = cpu_render.kernel
            else:
                make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
            self._impls[dialect] = make(name=self.build_name, input_names=list(self.inputs),
                                        output_names=list(self.outputs), source=self.source(dialect),
                                        header=header(dialect), ensure_row_contiguous=self.ensure_row_contiguous)
        return self._impls[dialect]

    def __call__(self, *, inputs: list[mx.array], template: list, grid: tuple, threadgroup: tuple,
                 output_shapes: list, output_dtypes: list, init_value: float | None = None) -> list[mx.array]:
        if self.name in _FAILED:
            raise KernelFailed(f"{self.name}: {_FAILED[self.name]}")
        if _recorder is not None:
            call = Call(self, tuple(inputs), tuple(template), tuple(grid), tuple(threadgroup),
                        tuple(tuple(s) for s in output_shapes), tuple(output_dtypes), init_value,
                        _ops[-1] if _ops else None)
            _recorder.append(call)
            if _spying:
                raise KernelFailed("spied: the reference runs")
            return [mx.zeros(s, dtype=d) for s, d in zip(call.output_shapes, call.output_dtypes)]
        dialect = backend()
        if dialect == "cpu":  # the render reads its inputs now: not possible inside an mx.compile trace
            try:
                mx.eval(inputs)
            except Exception as e:  # noqa: BLE001 (not the kernel's failure: the reference runs, nothing is marked)
                raise KernelFailed(f"the CPU render cannot read these inputs ({e})") from e
        launch = dict(template=template, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes,
                      output_dtypes=output_dtypes, init_value=init_value)
        try:
            impl = self._impl(dialect)
            variant = variant_key(self.name, inputs, template, output_dtypes, threadgroup)
            if variant not in self.launched:
                if dialect != "cpu":
                    zeros = [mx.broadcast_to(mx.zeros((), dtype=a.dtype), a.shape) for a in inputs]
                    tic = time.perf_counter()
                    if dialect == "cuda":
                        _keep_build(self, inputs, template, output_dtypes)
                    mx.eval(impl(inputs=zeros, **launch))
                    _first_use(time.perf_counter() - tic)
                self.launched.add(variant)
            return impl(inputs=inputs, **launch)
        except Exception as e:  # noqa: BLE001 (any failure of a build or launch: this kernel falls back for good)
            self.fail(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}", dialect)
            raise KernelFailed(f"{self.name}: {_FAILED[self.name]}") from e

    def fail(self, why: str, dialect: str) -> None:
        _FAILED[self.name] = why
        print(f"lattice_mlx: kernel {self.name} failed on {dialect} ({why[:300]}); its plain-ops reference runs "
              "instead for the rest of this process. Please report it with the output of `python -m "
              "lattice_mlx.doctor`.", file=sys.stderr)


# The first launches of variants on Metal or CUDA in this process: how many, and the seconds their guarded runs took
# (MLX builds a custom kernel's variant there: an NVRTC compile of 1.3-1.8 s each on CUDA). Benchmarks read it to
# say what a first generation spent building kernels.
_FIRST_USES = {"variants": 0, "seconds": 0.0}


ANNOUNCE_AFTER_S = 1.0  # first-use builds past this many seconds in a process: one line on stderr, once


def _first_use(seconds: float) -> None:
    _FIRST_USES["variants"] += 1
    _FIRST_USES["seconds"] += seconds
    if _FIRST_USES["seconds"] > ANNOUNCE_AFTER_S and not _FIRST_USES.get("announced"):
        _FIRST_USES["announced"] = True
        print("lattice_mlx: compiling GPU kernels for this process (once per kernel shape; on MLX's CUDA backend "
              "about 1.5 s each, so a first generation can take tens of seconds)", file=sys.stderr, flush=True)


_KEEP_FAILED: list[str] = []


def _keep_build(kernel: "Kernel", inputs: list, template: list, output_dtypes: list) -> None:
    """With LATTICE_KERNEL_CACHE on (the default), the variant's module goes into MLX's PTX cache before MLX first
    launches it (cuda_cache.py: built here once per machine, read by every later process). A failure says so once
    and leaves the build to MLX, as before."""
    from lattice_mlx.metal import cuda_cache

    if _KEEP_FAILED or not cuda_cache.enabled():
        return
    try:
        cuda_cache.ensure(kernel, inputs, template, output_dtypes)
    except Exception as e:  # noqa: BLE001 (NVRTC missing or failing, a cache folder not writable: MLX builds it)
        _KEEP_FAILED.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        print(f"lattice_mlx: kernel builds are not kept on disk in this process ({_KEEP_FAILED[0][:300]})",
              file=sys.stderr)


def first_uses() -> dict:
    """{"variants": n, "seconds": s}: the variants first launched in this process so far, and their build time."""
    return {k: _FIRST_USES[k] for k in ("variants", "seconds")}


def kernels() -> list[Kernel]:
    """Every kernel built in this process (`Kernel.launched`: the variants of it that ran)."""
    return list(_BUILT)


_BUILT: list[Kernel] = []


@functools.cache
def build(name: str, body: str, inputs: tuple[str, ...], outputs: tuple[str, ...], *,
          ensure_row_contiguous: bool = True, consts: tuple[tuple[str, str], ...] = ()) -> Kernel:
    """The kernel of (name, body, consts), made once. With `ensure_row_contiguous=False` inputs arrive as they are
    (views of a bigger buffer too); the body indexes them through `<input>_strides`.

    `consts` (from `constants`) become literals at the top of the body (the name gets a hash of it all), instead
    of small input arrays made on the host: a launch with two such inputs cost over 3x one with literals
    (docs/kernels.md). Values that change per call (offsets, lengths) stay inputs."""
    kernel = Kernel(name, body, inputs, outputs, ensure_row_contiguous=ensure_row_contiguous, consts=consts)
    _BUILT.append(kernel)
    return kernel
