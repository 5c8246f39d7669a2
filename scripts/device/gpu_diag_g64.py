"""Where the NaN logits of the 4-bit group-64 tiny checkpoints come from (H200 run 14: the tiny test shapes, hidden
size 64, converted at group size 64 give NaN prefill logits on the GPU, traced or not; at group 32 they are finite).

Three checks, each on the default (GPU) stream against the CPU stream:
1. MLX's own ops: mx.quantize, mx.dequantize and mx.quantized_matmul over K = 64..256, groups 32/64/128, rows M;
2. this project's 4-bit kernel at K = 64 (every prologue it supports there);
3. the tiny checkpoint's prefill with the kernels on and off (LATTICE_KERNELS=ref): every module's output checked,
   the first that is not finite reported, and every 4-bit linear's output against a CPU-stream reference.

Usage: python scripts/device/gpu_diag_g64.py --out FILE.json
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np


def finite(a: mx.array) -> bool:
    return bool(mx.isfinite(a.astype(mx.float32)).all().item())


def err(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())


def mlx_ops() -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for K in (64, 128, 256):
        for gs in (32, 64, 128):
            if gs > K:
                continue
            for dtype in (mx.float32, mx.bfloat16):
                w = mx.array(rng.standard_normal((96, K)).astype(np.float32)).astype(dtype)
                q = mx.quantize(w, group_size=gs, bits=4)
                with mx.stream(mx.cpu):
                    qc = mx.quantize(w, group_size=gs, bits=4)
                    dqc = mx.dequantize(*qc, group_size=gs, bits=4)
                dq = mx.dequantize(*q, group_size=gs, bits=4)
                row = dict(K=K, group=gs, dtype=str(dtype), quantize_equal=all(
                    err(a, b) == 0 for a, b in zip(q, qc)), dequantize_err=err(dq, dqc), dequantize_finite=finite(dq))
                for M in (1, 2, 4, 8, 9, 16, 33):
                    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
                    y = mx.quantized_matmul(x, *qc, transpose=True, group_size=gs, bits=4)
                    with mx.stream(mx.cpu):
                        yc = mx.quantized_matmul(x, *qc, transpose=True, group_size=gs, bits=4)
                    row[f"qmm_M{M}"] = {"finite": finite(y), "err": err(y, yc) if finite(y) else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def own_kernel() -> list[dict]:
    from lattice_mlx.metal import q4_matmul as q4

    rows = []
    rng = np.random.default_rng(1)
    for gs in (32, 64):
        for dtype in (mx.float32, mx.bfloat16):
            w = mx.array(rng.standard_normal((96, 64)).astype(np.float32))
            wq, s, b = mx.quantize(w, group_size=gs, bits=4)
            s, b = s.astype(dtype), b.astype(dtype)
            for M in (1, 4, 8):
                x = mx.array(rng.standard_normal((M, 64)).astype(np.float32)).astype(dtype)
                nw = mx.array(rng.standard_normal((64,)).astype(np.float32)).astype(dtype)
                for pre in (None, q4.Pre("rms", nw, 1e-6)):
                    y = q4.q4_matmul_kernel(x, wq, s, b, group_size=gs, pre=pre)
                    with mx.stream(mx.cpu):
                        yr = q4.q4_matmul_ref(x, wq, s, b, group_size=gs, pre=pre)
                    row = dict(group=gs, dtype=str(dtype), M=M, pre=pre.kind if pre else "none", finite=finite(y),
                               err=err(y, yr))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def model_trace(path: str, kernels: bool) -> dict:
    """The prefill of 6 tokens on the GPU, every module's output checked; the 4-bit linears also on the CPU stream."""
    from lattice_mlx import load
    from lattice_mlx.models import qwen3_5 as q

    if kernels:
        os.environ.pop("LATTICE_KERNELS", None)
    else:
        os.environ["LATTICE_KERNELS"] = "ref"
    model, _ = load(path)
    log: list[dict] = []
    originals = {}

    def wrap(cls, meth="__call__"):
        orig = getattr(cls, meth)
        originals[(cls, meth)] = orig

        def call(self, *a, **k):
            out = orig(self, *a, **k)
            o = out[0] if isinstance(out, tuple) else out
            mx.eval(o)
            entry = {"module": f"{cls.__name__}.{meth}", "shape": list(o.shape), "finite": finite(o)}
            if cls is q.Q4Linear and a:
                with mx.stream(mx.cpu):  # the CPU stream: use_kernels() is False, plain ops on the CPU
                    ref = orig(self, *a, **k)
                    mx.eval(ref)
                entry["cpu_err"] = err(o, ref) if entry["finite"] else None
                entry["cpu_finite"] = finite(ref)
                entry["in_finite"] = finite(a[0])
                entry["kw"] = sorted(k for k in k if k is not None)
            log.append(entry)
            return out

        setattr(cls, meth, call)

    for cls in (q.Q4Linear, q.GatedDeltaNet, q.Attention, q.MLP, q.DecoderLayer):
        wrap(cls)
    wrap(q.Q4Embedding, "__call__")
    wrap(q.Q4Embedding, "as_linear")
    try:
        logits = model(mx.array([[5, 9, 33, 21, 7, 100]]))
        mx.eval(logits)
        first_bad = next((e for e in log if not e["finite"]), None)
        return {"kernels": kernels, "logits_finite": finite(logits), "first_bad": first_bad,
                "modules": len(log), "log": log[:80]}
    finally:
        for (cls, meth), orig in originals.items():
            setattr(cls, meth, orig)
        os.environ.pop("LATTICE_KERNELS", None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from lattice_mlx.bench.synthetic import random_checkpoint
    from lattice_mlx.convert import convert
    from lattice_mlx.metal import use_kernels

    result = {"device": str(mx.default_device()), "mlx_ops": mlx_ops(),
              "own_kernel": own_kernel() if use_kernels() else "no GPU", "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        src = random_checkpoint(Path(tmp) / "untied", seed=1, tie_word_embeddings=False)
        for gs in (32, 64):
            for rot in (None, 1):
                dst = convert(str(src), str(Path(tmp) / f"q{gs}_{rot}"), rotate_seed=rot, quantize_bits=4,
                              group_size=gs)
                for kernels in (True, False):
                    name = f"g{gs}_rot{rot}_{'kernels' if kernels else 'ref'}"
                    r = model_trace(dst, kernels)
                    result["models"][name] = r
                    print(name, json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
