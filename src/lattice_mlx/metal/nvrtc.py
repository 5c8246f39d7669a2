"""NVRTC through ctypes, and the module files MLX's PTX cache reads (cuda_cache.py). Imports nothing but the standard
library: it also runs as a build worker by its file path (`python nvrtc.py LIB JOBS`, JOBS a JSON file), so that
builds run in parallel (NVRTC serialises compiles within a process)."""

import ctypes
import ctypes.util
import json
import os
import sys
import threading
from pathlib import Path

DEVICE_HEADER_NAME = "mlx/backend/cuda/device/utils.cuh"
# MLX's generated source includes <cooperative_groups.h>, which no body of ours uses: an empty namespace in its place
# leaves every kernel's PTX the same and makes a compile several times faster (docs/results/code_measurements.md)
COOPERATIVE_GROUPS = "#pragma once\nnamespace cooperative_groups {}\n"


class NvrtcError(RuntimeError):
    pass


def find(override: str = "") -> str:
    """libnvrtc: `override`, else the copy this process has loaded (MLX's, from whatever folder), else one the loader
    finds."""
    if override:
        return override
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "/libnvrtc.so" in path:
                    return path
    except OSError:
        pass
    for path in _pip_libraries():  # pip's nvidia-cuda-nvrtc (a dependency of MLX's CUDA wheel)
        return path
    found = ctypes.util.find_library("nvrtc")
    if found:
        return found
    for soname in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        try:
            ctypes.CDLL(soname)
            return soname
        except OSError:
            continue
    raise NvrtcError("NVRTC not found (set LATTICE_NVRTC to libnvrtc's path)")


def _pip_libraries() -> list[str]:
    """libnvrtc from pip's nvidia-cuda-nvrtc packages (nvidia/<cu13, cuda_nvrtc>/lib), newest CUDA first."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [p for root in roots for p in Path(root).glob("*/lib/libnvrtc.so*") if "builtins" not in p.name]
    return [str(p) for p in sorted(found, reverse=True)]


class Nvrtc:
    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]

    def _check(self, res: int, what: str, prog=None) -> None:
        if res == 0:
            return
        log = ""
        if prog is not None:
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value + 1)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace").strip()
        raise NvrtcError(f"{what}: {self.lib.nvrtcGetErrorString(res).decode()}" + (f"\n{log}" if log else ""))

    def version(self) -> tuple[int, int]:
        a, b = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b)), "nvrtcVersion")
        return a.value, b.value

    def compile(self, source: str, kernel_name: str, options: list[str], device_header: str) -> tuple[bytes, str]:
        """(cubin, the kernel's lowered name) of `source`, with `device_header` as MLX's device header."""
        prog = ctypes.c_void_p()
        names = (ctypes.c_char_p * 2)(DEVICE_HEADER_NAME.encode(), b"cooperative_groups.h")
        headers = (ctypes.c_char_p * 2)(device_header.encode(), COOPERATIVE_GROUPS.encode())
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 2, headers,
                                                names), "nvrtcCreateProgram")
        try:
            self._check(self.lib.nvrtcAddNameExpression(prog, kernel_name.encode()), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            self._check(self.lib.nvrtcCompileProgram(prog, len(options), opts), "nvrtcCompileProgram", prog)
            lowered = ctypes.c_char_p()
            self._check(self.lib.nvrtcGetLoweredName(prog, kernel_name.encode(), ctypes.byref(lowered)),
                        "nvrtcGetLoweredName")
            mangled = lowered.value.decode()
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            buf = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            return buf.raw, mangled
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def build(self, job: dict) -> None:
        """One job (source, name: the kernel's qualified name, options, header, path: the module's .ptx file):
        compiled and written."""
        cubin, mangled = self.compile(job["source"], job["name"], job["options"], job["header"])
        write_module(Path(job["path"]), job["name"], cubin, mangled, job["stamp"])


def write_module(path: Path, kernel_name: str, image: bytes, mangled: str, stamp: str) -> None:
    """A module's two files as MLX reads them (<name>.ptx: the image; <name>.txt: `name<TAB>lowered name` lines),
    then the stamp of how it was built (<name>.lattice: read by cuda_cache, never by MLX), each written whole under
    a temporary name and renamed: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = f".{os.getpid()}.{threading.get_ident()}.tmp"
    for target, data in ((path.with_suffix(".txt"), f"{kernel_name}\t{mangled}\n".encode()), (path, image),
                         (path.with_suffix(".lattice"), stamp.encode())):
        tmp = target.with_name(target.name + tag)
        tmp.write_bytes(data)
        os.replace(tmp, target)


def main() -> int:
    """Worker: `nvrtc.py LIB JOBS` (a JSON list's file); one result line per job on stdout ("" or the error's first
    line)."""
    nvrtc = Nvrtc(sys.argv[1])
    for job in json.loads(Path(sys.argv[2]).read_text()):
        try:
            nvrtc.build(job)
            print(json.dumps(""), flush=True)
        except (NvrtcError, OSError) as e:
            print(json.dumps(str(e).splitlines()[0] if str(e) else type(e).__name__), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
