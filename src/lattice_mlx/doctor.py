"""`python -m lattice_mlx.doctor [--model PATH]`: does every kernel this model would use build and compute right here?

The kernels come from the model's own forwards (lattice_mlx.variants: its config, dtype and quantization; no weights
are read). For each kernel, the op call that launched it runs again on random inputs, on this machine's backend,
against its plain-ops reference: at a small shape and at the model's own. One row per kernel and shape: kernel,
variant, backend, max error (relative to the reference's largest value), microseconds per call, status. On a
machine with no GPU backend the rows run the kernel bodies through the CPU render at the small shape (and time the
reference at the model's). Exits 1 if any kernel is wrong or failed to build, 2 if the model cannot be read.
"""

import argparse
import dataclasses
import inspect
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from importlib import metadata

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import settings
from .cli import ArgumentParser
from .load import DEMO_MODEL, LoadError, read_config, resolve_path
from .metal import _dialect, cpu_render, use_kernels
from .metal.q4_matmul import Pre
from .variants import SMALL, model_calls

# The largest error a kernel may show against its reference, relative to the reference's largest magnitude, by the
# op's activation dtype. A kernel sums in another order than the plain ops and rounds its intermediates once where
# MLX's ops round per op: on random inputs a bf16 GDN output came within 2e-2 of its reference (cancellation in
# small dot products), where an indexing or synchronisation bug is off by O(1). The bounds sit between the two.
TOLERANCE = {mx.float32: 1e-3, mx.float16: 1e-2, mx.bfloat16: 6e-2}
MAX_ROWS = 16384  # a matmul's weight rows at most (the kernel's variant is the same from 8k rows up)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def setup_arg_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m lattice_mlx.doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory or hub id (default: the embedded demo model)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="activation dtype (default: the checkpoint's)")
    p.add_argument("--json", help="also write the rows and versions to this file")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per row (default 20)")
    return p


def model_settings(path) -> tuple[dict, mx.Dtype, int | None, int]:
    """(text config, activation dtype, bits or None, group size) of a checkpoint, from its config.json alone."""
    config = read_config(path)
    text = dict(config.get("text_config") or config)
    name = text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16"
    quant = config.get("quantization") or {}
    return text, DTYPES.get(name, mx.bfloat16), quant.get("bits"), quant.get("group_size", 64)


def first_per_kernel(calls: list[_dialect.Call]) -> dict[str, _dialect.Call]:
    out = {}
    for call in calls:
        if call.op is not None:
            out.setdefault(call.kernel.name, call)
    return out


def _random_like(x, rng: np.random.Generator):
    """x with every floating array replaced by random values of its shape and dtype (norm weights near 1, uint32
    weights random bits); integer arrays (token ids, picks, offsets) and everything else kept."""
    if isinstance(x, mx.array):
        if x.dtype == mx.uint32:
            return mx.array(rng.integers(0, 2**32, size=x.shape, dtype=np.uint32))
        if mx.issubdtype(x.dtype, mx.floating):
            return mx.array((rng.standard_normal(x.shape) * 0.5).astype(np.float32)).astype(x.dtype)
        return x
    if isinstance(x, nn.RMSNorm):
        norm = nn.RMSNorm(x.weight.shape[0], eps=x.eps)
        w = 1.0 + 0.1 * rng.standard_normal(x.weight.shape)
        norm.weight = mx.array(w.astype(np.float32)).astype(x.weight.dtype)
        return norm
    if isinstance(x, Pre):
        return dataclasses.replace(x, weight=_random_like(x.weight, rng), src=_random_like(x.src, rng))
    if isinstance(x, (tuple, list)):
        return type(x)(_random_like(v, rng) for v in x)
    if isinstance(x, dict):
        return {k: _random_like(v, rng) for k, v in x.items()}
    return x


def _capped(op: _dialect.OpCall) -> _dialect.OpCall:
    """A matmul over a very wide weight (an lm_head) at its first MAX_ROWS rows: the same kernel variant."""
    args, kwargs = list(op.args), dict(op.kwargs)
    w = args[1] if len(args) > 1 else None
    if isinstance(w, mx.array) and w.ndim == 2 and w.shape[0] > MAX_ROWS and kwargs.get("residual") is None \
            and not kwargs.get("glu"):
        args[1:] = [a[:MAX_ROWS] if isinstance(a, mx.array) and a.ndim == 2 else a for a in args[1:]]
    return dataclasses.replace(op, args=tuple(args), kwargs=kwargs)


def _outputs(x) -> list[mx.array]:
    return [x] if isinstance(x, mx.array) else [a for a in x if isinstance(a, mx.array)]


def compare(got, expect, dtype: mx.Dtype) -> tuple[float, float]:
    """(error, tolerance): the largest |got - expect| over the largest |expect|, per output, the worst, against
    TOLERANCE[dtype] (the activation dtype); integer outputs (argmax) must be equal (error = the fraction that
    differ)."""
    err, tol = 0.0, 0.0
    for g, e in zip(_outputs(got), _outputs(expect)):
        if g.shape != e.shape:
            return float("inf"), 0.0
        if not mx.issubdtype(e.dtype, mx.floating):
            err = max(err, mx.mean(g != e.astype(g.dtype)).item())
            continue
        g32, e32 = g.astype(mx.float32), e.astype(mx.float32)
        scale = max(mx.abs(e32).max().item(), 1e-30)
        diff = mx.abs(g32 - e32).max().item()
        err = max(err, diff / scale if np.isfinite(diff) else float("inf"))
        tol = TOLERANCE.get(dtype, TOLERANCE[mx.float32])
    return err, tol


def activation_dtype(args: tuple) -> mx.Dtype:
    """The dtype of the op's first floating array argument."""
    for a in args:
        if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating):
            return a.dtype
        if isinstance(a, tuple) and a and isinstance(a[0], mx.array):  # a packed projection (src, b_col, a_col)
            return a[0].dtype
    return mx.float32


def _time(fn, repeats: int) -> float:
    """Median microseconds of one call, evaluated (a warm-up call first)."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e6 * float(np.median(times))


def variant_label(call: _dialect.Call) -> str:
    parts = [f"{k}={getattr(v, 'name', None) or str(v).replace('mlx.core.', '')}" for k, v in call.template]
    return " ".join(parts) + f" tg={'x'.join(map(str, call.threadgroup))}"


def run_row(call: _dialect.Call, size: str, backend: str, repeats: int) -> dict:
    """One kernel against its reference (plain ops all the way down) on random inputs of the recorded call's
    shapes."""
    op = _capped(call.op)
    rng = np.random.default_rng(0)
    args, kwargs = _random_like(op.args, rng), _random_like(op.kwargs, rng)
    params = inspect.signature(op.reference).parameters
    ref_kwargs = {k: v for k, v in kwargs.items() if k in params}
    row = dict(kernel=call.kernel.name, size=size, variant=variant_label(call), backend=backend, error=None,
               tolerance=None, us=None, status="ok")
    mode = "cpu" if backend == "cpu render" else ""
    try:
        with settings.override(kernels="ref"):
            expect = op.reference(*args, **ref_kwargs)
            mx.eval(expect)
            if backend == "reference":
                row["us"] = _time(lambda: op.reference(*args, **ref_kwargs), repeats)
                row["status"] = "reference"
                return row
        with settings.override(kernels=mode):
            got = op.fn(*args, **kwargs)
            mx.eval(got)
            row["error"], row["tolerance"] = compare(got, expect, activation_dtype(op.args))
            row["status"] = "ok" if row["error"] <= row["tolerance"] else "WRONG"
            row["us"] = _time(lambda: op.fn(*args, **kwargs), 1 if mode == "cpu" else repeats)
    except _dialect.KernelFailed as e:
        row["status"] = f"FAILED: {e}"
    except Exception as e:  # noqa: BLE001 (reported in its row: the doctor checks everything it can)
        row["status"] = f"ERROR: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    return row


def run(text: dict, dtype: mx.Dtype, bits: int | None, group_size: int, *, repeats: int = 20) -> Iterator[dict]:
    """The rows for a model of text config `text` (see the module docstring), one at a time."""
    small = first_per_kernel(model_calls({**text, **SMALL}, dtype=dtype, bits=bits, group_size=group_size))
    full = first_per_kernel(model_calls(text, dtype=dtype, bits=bits, group_size=group_size))
    gpu = use_kernels() and _dialect.mode() != "cpu"
    for name in sorted(set(small) | set(full)):
        if gpu:
            for size, calls in (("small", small), ("model", full)):
                if name in calls:
                    yield run_row(calls[name], size, _dialect.backend(), repeats)
            continue
        if name in small and cpu_render.available():
            yield run_row(small[name], "small", "cpu render", repeats)
        if name in full:
            yield run_row(full[name], "model", "reference", max(1, repeats // 4))


def versions() -> dict:
    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    try:
        chip = mx.device_info().get("device_name", "")
    except Exception:  # noqa: BLE001 (an older MLX, or no device: the OS's word instead)
        chip = ""
    from . import __version__

    return {"mlx": version("mlx"), "mlx-lm": version("mlx-lm"), "lattice-mlx": __version__,
            "os": platform.platform(), "chip": chip or platform.processor() or platform.machine(),
            "backend": "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else "cpu"}


HEADER = f"{'kernel':32} {'size':5} {'backend':10} {'max error':>10} {'tolerance':>9} {'us/call':>9}  status  variant"


def format_row(r: dict) -> str:
    err = "-" if r["error"] is None else f"{r['error']:.2e}"
    tol = "-" if r["tolerance"] is None else f"{r['tolerance']:.0e}"
    us = "-" if r["us"] is None else f"{r['us']:.1f}"
    return f"{r['kernel']:32} {r['size']:5} {r['backend']:10} {err:>10} {tol:>9} {us:>9}  {r['status']}  {r['variant']}"


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    try:
        path = resolve_path(args.model) if args.model else DEMO_MODEL
        text, dtype, bits, group_size = model_settings(path)
        if args.dtype:
            dtype = DTYPES[args.dtype]
        _dialect.mode()  # a bad LATTICE_KERNELS is one line too
    except (LoadError, ValueError, OSError) as e:
        print(f"doctor: {e}", file=sys.stderr)
        return 2
    print(f"model: {args.model or 'the embedded demo model'} ({dtype}, "
          f"{f'{bits}-bit, group {group_size}' if bits else 'unquantized'})")
    print(HEADER + "\n" + "-" * len(HEADER), flush=True)
    rows = []
    for row in run(text, dtype, bits, group_size, repeats=args.repeats):  # a row as soon as it is known
        rows.append(row)
        print(format_row(row), flush=True)
    info = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    bad = [r for r in rows if r["status"] not in ("ok", "reference")]
    if not any(r["backend"] not in ("reference",) for r in rows):
        print("no kernel ran here (no GPU backend and no C++ compiler for the CPU render): the references run")
    print(f"{len(rows) - len(bad)} of {len(rows)} rows ok" + (f"; {len(bad)} wrong or failed" if bad else ""))
    if args.json:
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as f:
            json.dump({"model": args.model or "demo", "dtype": str(dtype), "bits": bits, "group_size": group_size,
                       "rows": rows, "versions": info}, f, indent=1)
        os.replace(tmp, args.json)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
