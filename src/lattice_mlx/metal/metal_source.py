"""The Metal source MLX compiles for one kernel call, reproduced in Python, and MLX's own text of it.

MLX's `mx.fast.metal_kernel` (mlx/backend/common/metal_kernel.cpp, MLX 0.32.x; checked against MLX_VERSION below by
tests/metal/test_metal_sources.py) wraps a body in a generated `[[kernel]]` function: the header, a template line
when there are template arguments, one `[[buffer(i)]]` argument per input (`constant` address space under 8
elements, `device` otherwise; a reference for a scalar), each followed by its `_shape`, `_strides` and `_ndim`
buffers when the body names them, one `device` pointer per output (`atomic<T>` with atomic_outputs), then the
thread-position attributes whose names the body contains, the body, and an explicit instantiation under the
generated name. At build time MLX puts its Metal utilities (metal_stdlib, `using namespace metal`, bfloat16_t,
float16_t, ...) in front; tests/metal/metal_shim.h stands in for those.
"""

import os
import re
import tempfile
from contextlib import contextmanager

import mlx.core as mx

from lattice_mlx.metal import _dialect

MLX_VERSION = "0.32.4"
MAX_CONSTANT_ARRAY_SIZE = 8  # inputs with fewer elements go in the constant address space
# (name, type) of the attributes MLX adds when the body mentions the name, in MLX's order
ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"), ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"), ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"), ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"), ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
_TYPES = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t", mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t", mx.float32: "float", mx.complex64: "complex64_t",
}


def type_string(dtype: mx.Dtype) -> str:
    return _TYPES[dtype]


def _template_value(v) -> str:
    if isinstance(v, bool):  # std::ostream without boolalpha
        return "1" if v else "0"
    return str(v) if isinstance(v, int) else type_string(v)


def kernel_name(call: _dialect.Call) -> str:
    """MLX's name for the instantiation: custom_kernel_<name>, the template values, each input's dtype (with `s` for
    a scalar, `c` for the constant address space) and each output's."""
    name = "custom_kernel_" + call.kernel.build_name
    if call.template:
        name += "__" + "_".join(_template_value(v) for _, v in call.template)
    for a in call.inputs:
        name += "_" + type_string(a.dtype) + ("s" if a.ndim == 0 else "c" if a.size < MAX_CONSTANT_ARRAY_SIZE else "")
    return name + "".join("_" + type_string(d) for d in call.output_dtypes)


def source(call: _dialect.Call, *, atomic_outputs: bool = False) -> str:
    """The text MLX compiles for `call` (without MLX's utilities in front)."""
    body, name = call.kernel.source("metal"), kernel_name(call)
    out = _dialect.header("metal")
    if call.template:
        kinds = ["bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename" for _, v in
                 call.template]
        out += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, call.template)) + ">\n"
    out += f"[[kernel]] void {name}(\n"
    args, index = [], 0
    for n, a in zip(call.kernel.inputs, call.inputs):
        space = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        args.append(f"  const {space} {type_string(a.dtype)}{'&' if a.ndim == 0 else '*'} {n} [[buffer({index})]]")
        index += 1
        if a.ndim > 0:
            for suffix, ctype in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                                  ("_ndim", "const constant int&")):
                if n + suffix in body:
                    args.append(f"  {ctype} {n}{suffix} [[buffer({index})]]")
                    index += 1
    for n, d in zip(call.kernel.outputs, call.output_dtypes):
        t = f"atomic<{type_string(d)}>" if atomic_outputs else type_string(d)
        args.append(f"  device {t}* {n} [[buffer({index})]]")
        index += 1
    args += [f"  {t} {a} [[{a}]]" for a, t in ATTRIBUTES if a in body]
    out += ",\n".join(args) + ") {\n" + body + "\n}\n"
    if call.template:
        inst = name + "<" + ", ".join(_template_value(v) for _, v in call.template) + ">"
        out += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({inst}) {inst};\n'
    return out


def mlx_sources(calls: list[_dialect.Call]) -> list[str]:
    """MLX's own text for each call, from MLX itself: `mx.fast.metal_kernel` builds its source on any machine while
    a function is being exported (nothing runs), and prints it with verbose=True. Reads MLX's output on fd 1."""
    inputs = [mx.broadcast_to(mx.zeros((), dtype=a.dtype), a.shape) for c in calls for a in c.inputs]

    def fn(*arrays):
        outs, i = [], 0
        for c in calls:
            k = mx.fast.metal_kernel(name=c.kernel.build_name, input_names=list(c.kernel.inputs),
                                     output_names=list(c.kernel.outputs), source=c.kernel.source("metal"),
                                     header=_dialect.header("metal"),
                                     ensure_row_contiguous=c.kernel.ensure_row_contiguous)
            outs += k(inputs=list(arrays[i : i + len(c.inputs)]), template=list(c.template), grid=c.grid,
                      threadgroup=c.threadgroup, output_shapes=[tuple(s) for s in c.output_shapes],
                      output_dtypes=list(c.output_dtypes), verbose=True)
            i += len(c.inputs)
        return outs

    with tempfile.TemporaryDirectory() as tmp, printed() as text:
        mx.export_function(os.path.join(tmp, "k.mlxfn"), fn, *inputs)
    blocks = generated_sources(text[0])
    assert len(blocks) == len(calls), f"MLX printed {len(blocks)} sources for {len(calls)} calls"
    return blocks


@contextmanager
def printed():
    """What the process writes to fd 1 inside the block (MLX prints a verbose kernel's source from C++), as the one
    string in the list it yields, filled when the block ends."""
    out = []
    with tempfile.TemporaryFile(mode="w+b") as log:
        saved = os.dup(1)
        os.dup2(log.fileno(), 1)
        try:
            yield out
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            log.seek(0)
            out.append(log.read().decode())


def generated_sources(text: str) -> list[str]:
    """The kernel sources MLX printed (verbose=True), in order: Metal's and CUDA's custom kernels alike."""
    return re.findall(r"Generated source code for `[^`]*`:\n```\n(.*?)\n```\n", text, flags=re.S)
