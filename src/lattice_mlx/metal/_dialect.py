"""Dialect macros: one kernel body (with `LX_*` names) renders to Metal or CUDA source for MLX custom kernels.

The body is written once; `render(body, dialect)` swaps each `LX_*` name for the dialect's spelling and
`header(dialect)` holds the few helpers that cannot be a plain substitution (warp sum, 8-wide loads).
"""

import functools
import hashlib
import math
import re

import mlx.core as mx
import numpy as np

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

_TABLES = {"metal": _METAL, "cuda": _CUDA}
_HEADERS = {"metal": _METAL_HEADER, "cuda": _CUDA_HEADER}
_NAME = re.compile(r"\bLX_[A-Z0-9_]+\b")


def render(body: str, dialect: str) -> str:
    """The body with every `LX_*` name replaced by the dialect's spelling; an unknown name is an error."""
    table = _TABLES[dialect]
    return _NAME.sub(lambda m: table[m.group(0)], body)


def header(dialect: str) -> str:
    return _HEADERS[dialect]


def backend() -> str:
    """'metal' or 'cuda': the dialect of the GPU MLX runs on."""
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


@functools.cache
def build(
    name: str, body: str, inputs: tuple[str, ...], outputs: tuple[str, ...], *, ensure_row_contiguous: bool = True,
    consts: tuple[tuple[str, str], ...] = (),
):
    """The MLX kernel object for this backend, made once per (name, body, consts). With `ensure_row_contiguous=False`
    inputs arrive as they are (views of a bigger buffer too); the body indexes them through `<input>_strides`.

    `consts` (from `constants`) become literals at the top of the body (the name gets a hash of it all), instead
    of small input arrays made on the host: on the H200 the GDN kernel took 23.7 us per launch with two such inputs
    (strides and columns, a step pick) and 7.1 us with their values as literals (and 32-bit offsets;
    docs/bench/h200/run19). Values that change per call (offsets, lengths) stay inputs."""
    dialect = backend()
    make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
    body = declare(consts) + body
    # the name carries a hash of the source and the inputs: MLX caches a compiled kernel by its name (CUDA: on disk,
    # under the temp folder), so an edited body or other constants must not reuse an old build
    key = "\x00".join([body, *inputs, *outputs])
    name = f"{name}_{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    return make(
        name=name,
        input_names=list(inputs),
        output_names=list(outputs),
        source=render(body, dialect),
        header=header(dialect),
        ensure_row_contiguous=ensure_row_contiguous,
    )
