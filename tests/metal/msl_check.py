"""Checks a rendered Metal source without an Apple toolchain: clang (libclang, C++14) against metal_shim.h, with
every warning that matters an error, a pointer or reference without an address space an error (as the Metal
compiler has it), the `[[...]]` attributes MLX generates checked by name and buffer index, and Apple's limits per
launch: threadgroup memory, threads per threadgroup, buffers, whole threadgroups.

Two rewrites before compiling, both where standard C++ lacks a Metal extension: a `threadgroup` array declared in
the kernel's body becomes a `static threadgroup` one (clang's C++ mode allows an address space only on variables of
static storage; a threadgroup variable lives for its threadgroup, which static storage models as far as the check
is concerned), and the explicit instantiation loses its `[[host_name(...)]] [[kernel]]` (C++ takes no attributes
there; the host name is checked to be the instantiated function's name).
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

from clang import cindex

SHIM = Path(__file__).with_name("metal_shim.h")
MAX_THREADGROUP_BYTES = 32 * 1024
MAX_THREADS = 1024
MAX_BUFFERS = 31
SIMD_WIDTH = 32
# Clang's flags: C++14 (the Metal Shading Language's base), no host headers, the warnings Metal also gives.
ARGS = ["-x", "c++", "-std=c++14", "-nostdinc", "-nostdinc++", f"-I{SHIM.parent}", "-Wall", "-Wextra",
        "-Wno-unused-parameter", "-Wno-unused-variable", "-Wno-unused-but-set-variable", "-Wno-sign-compare"]
# Attributes of MLX's generated signature and instantiation (unknown to clang: it ignores them and says so).
METAL_ATTRIBUTES = {"kernel", "buffer", "host_name", "dispatch_quadgroups_per_threadgroup",
                    "dispatch_simdgroups_per_threadgroup", "dispatch_threads_per_threadgroup", "grid_origin",
                    "grid_size", "quadgroup_index_in_threadgroup", "quadgroups_per_threadgroup",
                    "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup", "thread_execution_width",
                    "thread_index_in_quadgroup", "thread_index_in_simdgroup", "thread_index_in_threadgroup",
                    "thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
                    "threadgroups_per_grid", "threads_per_grid", "threads_per_simdgroup", "threads_per_threadgroup"}
_SIZES = {"float": 4, "int": 4, "uint": 4, "int32_t": 4, "uint32_t": 4, "half": 2, "bfloat": 2, "float16_t": 2,
          "bfloat16_t": 2, "short": 2, "ushort": 2, "int16_t": 2, "uint16_t": 2, "char": 1, "uchar": 1, "bool": 1,
          "int8_t": 1, "uint8_t": 1, "int64_t": 8, "uint64_t": 8, "long": 8, "ulong": 8, "float2": 8, "float4": 16,
          "half2": 4, "half4": 8, "int2": 8, "int4": 16, "uint2": 8, "uint4": 16}
_TG_DECL = re.compile(r"^(\s*)threadgroup(\s+[A-Za-z_][\w:]*\s+[A-Za-z_]\w*\s*\[)", re.M)
_TG_ARRAY = re.compile(r"^\s*threadgroup\s+([A-Za-z_][\w:]*)\s+([A-Za-z_]\w*)\s*((?:\[[^\]]+\]\s*)+);", re.M)
_CONSTEXPR = re.compile(r"\b(?:constexpr|const)\s+(?:int|uint|bool)\s+([A-Za-z_]\w*)\s*=\s*([^;]+);")
_INSTANCE = re.compile(r'^template \[\[host_name\("(\w+)"\)\]\] \[\[kernel\]\] (decltype\((\w+)<.*)$', re.M)
_ATTR = re.compile(r"\[\[\s*([A-Za-z_]\w*)\s*(?:\(([^)]*)\))?\s*\]\]")
_INDEX = None


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    threadgroup_bytes: int = 0
    threads: int = 0
    buffers: int = 0


def _index() -> cindex.Index:
    global _INDEX
    if _INDEX is None:
        _INDEX = cindex.Index.create()
    return _INDEX


def prepared(source: str) -> str:
    """The source as clang reads it (module docstring: its two rewrites)."""
    source = _TG_DECL.sub(r"\1static threadgroup\2", source)
    return _INSTANCE.sub(r"template \2", source)


def _allowed(diag: cindex.Diagnostic) -> bool:
    """Diagnostics that say nothing about Metal: the shim's `thread` tag, and MLX's Metal attributes, which clang
    does not know (checked by `_attributes` instead)."""
    text = diag.spelling
    if text == "'btf_type_tag' attribute ignored":
        return True
    m = re.fullmatch(r"unknown attribute '(\w+)' ignored", text)
    return m is not None and m.group(1) in METAL_ATTRIBUTES


def _attributes(source: str) -> list[str]:
    errors, seen = [], set()
    for name, arg in _ATTR.findall(source):
        if name not in METAL_ATTRIBUTES:
            errors.append(f"attribute [[{name}]] is not one Metal gives kernels")
        elif name == "buffer":
            i = int(arg)
            if i in seen:
                errors.append(f"buffer index {i} used twice")
            seen.add(i)
    for host, _, fn in _INSTANCE.findall(source):
        if host != fn:
            errors.append(f"the instantiation's host name {host} is not its function's name {fn}")
    if seen and sorted(seen) != list(range(len(seen))):
        errors.append(f"buffer indices {sorted(seen)} are not 0..{len(seen) - 1}")
    return errors


_POINTERS = {cindex.TypeKind.POINTER, cindex.TypeKind.LVALUEREFERENCE, cindex.TypeKind.RVALUEREFERENCE}
_ARRAYS = {cindex.TypeKind.CONSTANTARRAY, cindex.TypeKind.DEPENDENTSIZEDARRAY}
_DECLS = {cindex.CursorKind.VAR_DECL, cindex.CursorKind.PARM_DECL, cindex.CursorKind.FIELD_DECL,
          cindex.CursorKind.CSTYLE_CAST_EXPR, cindex.CursorKind.CXX_STATIC_CAST_EXPR,
          cindex.CursorKind.CXX_REINTERPRET_CAST_EXPR, cindex.CursorKind.CXX_CONST_CAST_EXPR}


def _walk(cursor: cindex.Cursor, errors: list[str], tg_names: list[str], first_line: int) -> None:
    for c in cursor.get_children():
        if c.location.file is not None and c.location.file.name != UNIT:
            continue
        if c.kind in _DECLS and c.type.kind in _POINTERS:
            spelled = c.type.spelling
            canonical = c.type.get_pointee().get_canonical().spelling
            tokens = [t.spelling for t in c.get_tokens()][:2]
            if "address_space(" not in canonical and 'btf_type_tag("thread")' not in spelled and "auto" not in tokens:
                what = c.spelling or "a cast"
                errors.append(f"line {c.location.line - first_line}: {what} has type '{spelled}', a pointer or "
                              "reference with no address space (device, constant, threadgroup or thread)")
        if c.kind == cindex.CursorKind.VAR_DECL and c.type.kind in _ARRAYS and \
                "address_space(3)" in c.type.get_canonical().spelling:
            tg_names.append(c.spelling)
        _walk(c, errors, tg_names, first_line)


def threadgroup_bytes(source: str, values: dict[str, int]) -> tuple[int, list[str]]:
    """(bytes of threadgroup memory the kernel declares, their names), its array sizes evaluated from the template
    values and the body's integer constants."""
    names = dict(values)
    for name, expr in _CONSTEXPR.findall(source):
        try:
            names[name] = _eval(expr, names)
        except (NameError, SyntaxError, TypeError):
            pass
    total, found = 0, []
    for ctype, name, dims in _TG_ARRAY.findall(source):
        n = _SIZES[ctype]
        for d in re.findall(r"\[([^\]]+)\]", dims):
            n *= _eval(d, names)
        total += n
        found.append(name)
    return total, found


def _eval(expr: str, names: dict) -> int:
    expr = expr.strip().replace("/", "//").replace("true", "1").replace("false", "0")
    if not re.fullmatch(r"[\w\s()*+\-/%]+", expr):
        raise SyntaxError(expr)
    return int(eval(expr, {"__builtins__": {}}, names))  # noqa: S307 (integer arithmetic on known names only)


UNIT = "kernels.metal"
BATCH = 64  # sources per clang run: the shim and clang's start-up are paid once a batch (8x faster than one by one)


@dataclass(frozen=True)
class Source:
    """One source to check: MLX's text for one call (`metal_source.source`), the call's integer template arguments,
    and its launch."""

    text: str
    values: dict
    threadgroup: tuple[int, int, int]
    grid: tuple[int, int, int]


def check(sources: list[Source]) -> list[Report]:
    """Every problem clang and the limits find in each source. Sources are compiled BATCH to a clang run, each in a
    namespace of its own; a diagnostic belongs to the source whose lines it is on."""
    reports = []
    for i in range(0, len(sources), BATCH):
        reports += _check_batch(sources[i : i + BATCH])
    return reports


def _check_batch(sources: list[Source]) -> list[Report]:
    unit, firsts = ['#include "metal_shim.h"\n'], []
    line = 2
    for i, src in enumerate(sources):
        text = prepared(src.text)
        unit.append(f"namespace lx_v{i} {{\n{text}\n}}\n")
        firsts.append(line + 1)  # the source's first line
        line += text.count("\n") + 3
    reports = [Report() for _ in sources]
    tu = _index().parse(UNIT, args=ARGS, unsaved_files=[(UNIT, "".join(unit))])

    def owner(ln: int) -> int:
        return max(i for i, f in enumerate(firsts) if f <= ln) if ln >= firsts[0] else 0

    for d in tu.diagnostics:
        if d.severity < cindex.Diagnostic.Warning or _allowed(d):
            continue
        if d.location.file is not None and d.location.file.name == UNIT:
            i = owner(d.location.line)
            reports[i].errors.append(f"line {d.location.line - firsts[i] + 1}: {d.spelling}")
        else:
            for r in reports:
                r.errors.append(f"{d.location.file}: {d.spelling}")
    for ns in tu.cursor.get_children():
        if ns.kind == cindex.CursorKind.NAMESPACE and ns.spelling.startswith("lx_v"):
            i = int(ns.spelling[4:])
            key = _pattern(sources[i].text)
            if key not in _WALKED:  # the declarations do not depend on the template's values: walk a pattern once
                errors: list[str] = []
                tg_names: list[str] = []
                _walk(ns, errors, tg_names, firsts[i] - 1)
                _WALKED[key] = (errors, tg_names)
            errors, tg_names = _WALKED[key]
            reports[i].errors += errors
            _limits(sources[i], reports[i], tg_names)
    return reports


_WALKED: dict[str, tuple[list[str], list[str]]] = {}


def _pattern(text: str) -> str:
    """The source without what template values change: the generated function name and the instantiation."""
    text = _INSTANCE.sub("", text)
    return re.sub(r"\bcustom_kernel_\w+", "custom_kernel", text)


def _limits(src: Source, report: Report, tg_names: list[str]) -> None:
    report.errors += _attributes(src.text)
    report.buffers = len(re.findall(r"\[\[buffer\(\d+\)\]\]", src.text))
    tg, grid = src.threadgroup, src.grid
    report.threads = tg[0] * tg[1] * tg[2]
    report.threadgroup_bytes, declared = threadgroup_bytes(src.text, src.values)
    if sorted(declared) != sorted(tg_names):
        report.errors.append(f"threadgroup arrays found by clang {tg_names} and sized here {declared} differ")
    if report.threadgroup_bytes > MAX_THREADGROUP_BYTES:
        report.errors.append(f"{report.threadgroup_bytes} bytes of threadgroup memory (Apple GPUs: at most "
                             f"{MAX_THREADGROUP_BYTES})")
    if report.threads > MAX_THREADS:
        report.errors.append(f"{report.threads} threads per threadgroup (at most {MAX_THREADS})")
    if report.threads % SIMD_WIDTH:
        report.errors.append(f"{report.threads} threads per threadgroup: not whole SIMD groups of {SIMD_WIDTH}")
    if report.buffers > MAX_BUFFERS:
        report.errors.append(f"{report.buffers} buffer arguments (Metal: at most {MAX_BUFFERS})")
    if any(g % t for g, t in zip(grid, tg)):
        report.errors.append(f"grid {grid} is not whole threadgroups of {tg}: Metal would launch a partial "
                             "threadgroup where CUDA launches a whole one")
