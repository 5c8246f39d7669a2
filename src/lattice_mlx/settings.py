"""The one reader of the environment. Each setting is read when asked for (a shell or a test may change the
environment between calls); `override` sets settings inside a block, whatever the environment says (the bench's A/B
legs, tests). A value a setting does not take is a ValueError naming the variable and what it takes."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import mlx.core as mx

SWITCH = ("1", "0", "")  # on / off settings: 1 on, 0 off, unset the default
# The default of the tracing switches: on where a trace pays, a GPU backend (graph building on the host is what it
# saves); off on MLX's CPU backend, where the first replay of each trace compiles C++ (tens of seconds on a fresh
# machine) and a warm traced step ran no faster than one built op by op (docs/results/code_measurements.md,
# 'tracing on the CPU')
GPU_ONLY = "gpu"


@dataclass(frozen=True)
class Setting:
    variable: str
    default: str
    choices: tuple[str, ...] | None  # None: any string
    hint: str  # what the variable takes, for the error


SETTINGS = {
    "kernels": Setting("LATTICE_KERNELS", "", ("", "ref", "cpu"),
                       "use ref (plain-ops references), cpu (the kernel bodies on the CPU render) or leave it unset"),
    # speculation="auto" (the API's and generate's default) speculates where this is on and the checkpoint has a head
    # (speculative.auto_applies); off by default until the default's evidence holds (docs/adr/0008)
    "mtp": Setting("LATTICE_MTP", "0", SWITCH, "use 1 (MTP on where the checkpoint has a head) or 0 (off)"),
    "compile": Setting("LATTICE_COMPILE", GPU_ONLY, SWITCH,
                       "use 1 (compiled), 0 (layer by layer) or leave it unset (compiled on a GPU)"),
    "trace_steps": Setting("LATTICE_TRACE_STEPS", GPU_ONLY, SWITCH,
                           "use 1 (traced plain steps), 0 (built per step) or leave it unset (traced on a GPU)"),
    "trace_rounds": Setting("LATTICE_TRACE_ROUNDS", GPU_ONLY, SWITCH,
                            "use 1 (traced rounds), 0 (built per round) or leave it unset (traced on a GPU)"),
    # Prompt rows' attention on MLX's CUDA backend: MLX's fused SDPA (cuDNN, which builds a graph for every new prompt
    # shape, in each process) with 1; written out in ops with 0 (the default), as MLX itself runs it where cuDNN does
    # not apply (head dimensions over 128: every Qwen3.5 checkpoint's attention)
    # a batch's 4-bit projections of few outputs split over K past the fused kernel's rows on CUDA (q4_matmul.SplitK)
    "split_k": Setting("LATTICE_SPLIT_K", "1", SWITCH, "use 1 (split where it applies) or 0 (never)"),
    # a batch engine's waiting prompts (one chunk each, from scratch; of unequal lengths left-padded to the longest)
    # prefilled in one forward over their rows instead of a forward each (batch.BatchDecoder._prefill_group); on
    # since measured on a GPU (docs/adr/0009)
    "batch_prefill": Setting("LATTICE_BATCH_PREFILL", "1", SWITCH,
                             "use 1 (waiting prompts prefilled together) or 0 (a forward each)"),
    # the rows the fused 4-bit kernel takes at most (q4_matmul.max_rows): 8, or 16 for a batch's steps of up to 16
    # sequences as well (fewer launches than MLX's quantized matmul with its norm, activation and copies apart); 8
    # until an A/B on a GPU says otherwise (batch_throughput.py --fused-rows-ab 16)
    "fused_rows": Setting("LATTICE_FUSED_ROWS", "8", ("8", "16"), "use 8 or 16"),
    "cudnn_sdpa": Setting("LATTICE_CUDNN_SDPA", "0", SWITCH,
                          "use 1 (MLX's fused attention for prompt rows on CUDA) or 0 (written out in ops)"),
    "pipeline_transport": Setting("LATTICE_PIPELINE_TRANSPORT", "", ("", "sendrecv", "collective"),
                                  "use one of sendrecv, collective"),
    "bench_lock": Setting("LATTICE_BENCH_LOCK", "/tmp/lattice_mlx_bench.lock", None, ""),
    "git_rev": Setting("LATTICE_GIT_REV", "", None, ""),
    "cxx": Setting("CXX", "", None, ""),  # the CPU render's compiler
    "cache_home": Setting("XDG_CACHE_HOME", "", None, ""),  # where the CPU render keeps its builds
    "cache": Setting("LATTICE_CACHE", "", None, ""),  # where the embedded demo's weights are unpacked (load.demo_model)
    # CUDA kernel builds kept on disk (metal/cuda_cache.py; bitwise MLX's own builds: docs/kernels.md)
    "kernel_cache": Setting("LATTICE_KERNEL_CACHE", "1", SWITCH,
                            "use 1 (CUDA kernel builds written to MLX's PTX cache, once per machine) or 0 (off)"),
    # MLX's CUDA quantized matmul past the fused kernel's rows (a batch), or a dequantized weight and cuBLAS: an A/B
    # of the batch benchmark (scripts/bench/batch_throughput.py --dequant-ab); 0 (never) until measured
    "dequant_rows": Setting("LATTICE_DEQUANT_ROWS", "0", None, "use a whole number of rows >= 0 (0: never)"),
    "nvrtc": Setting("LATTICE_NVRTC", "", None, ""),  # libnvrtc's path, where the process has not loaded one
    # where MLX reads and writes its PTX cache, and the folders it is found from
    "ptx_cache_dir": Setting("MLX_PTX_CACHE_DIR", "", None, ""),
    "tmpdir": Setting("TMPDIR", "", None, ""),
    "tmp": Setting("TMP", "", None, ""),
    "temp": Setting("TEMP", "", None, ""),
    "tempdir": Setting("TEMPDIR", "", None, ""),
    "cuda_home": Setting("CUDA_HOME", "", None, ""),
    "cuda_path": Setting("CUDA_PATH", "", None, ""),
}
_overrides: dict[str, object] = {}


def raw(name: str) -> str:
    """The setting's value as a string: overridden, else the environment's, else the default; checked."""
    if name in _overrides:
        return _overrides[name]
    s = SETTINGS[name]
    value = os.environ.get(s.variable, s.default)
    if name == "kernels":
        value = value.lower()
    if s.choices is not None and value not in s.choices and value != s.default:
        raise ValueError(f"{s.variable}={value!r}: {s.hint}")
    return value


def on(name: str) -> bool:
    """An on / off setting: 1 on, 0 off, unset its default (GPU_ONLY: on unless MLX's default device is the CPU)."""
    value = raw(name) or SETTINGS[name].default
    if value == GPU_ONLY:
        return mx.default_device().type != mx.DeviceType.cpu
    return value == "1"


@contextmanager
def override(**values) -> Iterator[None]:
    """The settings given hold inside the block (True / False for on / off ones, None: as the environment says)."""
    saved = dict(_overrides)
    for name, value in values.items():
        if name not in SETTINGS:
            raise KeyError(name)
        if value is None:
            _overrides.pop(name, None)
        else:
            _overrides[name] = ("1" if value else "0") if isinstance(value, bool) else value
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


@dataclass(frozen=True)
class Settings:
    """Every setting at one moment (for a benchmark's record)."""

    kernels: str
    mtp: str
    compile: str
    trace_steps: str
    trace_rounds: str
    cudnn_sdpa: str
    pipeline_transport: str
    bench_lock: str
    git_rev: str
    cxx: str
    cache_home: str


def current() -> Settings:
    return Settings(**{f.name: raw(f.name) for f in fields(Settings)})
