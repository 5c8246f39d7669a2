"""MLX's own CUDA builds against the ones metal/cuda_cache.py keeps (LATTICE_KERNEL_CACHE=1), variant by variant.

`--save FILE`: every kernel variant a model's decode loops ask for (lattice_mlx.variants at widths 1-8, the 0.8B shape,
bf16, 4-bit) runs its op once on seeded random inputs in this process; the outputs go to FILE (.npz) with the
process's first-use build count and seconds (_dialect.first_uses) and the modules it built (cuda_cache.built).
Run it in fresh processes, each with its own MLX_PTX_CACHE_DIR: once with the setting off (MLX builds every variant),
once on (this package builds them), once more on with the same folder (everything read from disk).
`--compare A B ...`: whether every output is bitwise the same across the files, and what each process spent.
"""

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np

from lattice_mlx.bench.synthetic import FAMILY
from lattice_mlx.doctor import _capped, _outputs, _random_like
from lattice_mlx.load import keep_kernel_builds
from lattice_mlx.metal import _dialect, cuda_cache
from lattice_mlx.variants import PREBUILD_WIDTHS, distinct, model_calls


def save(path: str, shape: str) -> int:
    text = FAMILY[shape]
    tic = time.perf_counter()
    keep_kernel_builds({"text_config": text, "quantization": {"bits": 4, "group_size": 64}}, mx.bfloat16)
    prebuild_s = time.perf_counter() - tic
    calls = [c for c in distinct(model_calls(text, dtype=mx.bfloat16, bits=4, group_size=64,
                                             widths=PREBUILD_WIDTHS)).values() if c.op is not None]
    out, failed = {}, []
    tic = time.perf_counter()
    for i, call in enumerate(calls):
        op = _capped(call.op)
        rng = np.random.default_rng(i)
        args, kwargs = _random_like(op.args, rng), _random_like(op.kwargs, rng)
        try:
            got = _outputs(op.fn(*args, **kwargs))
            mx.eval(got)
        except _dialect.KernelFailed as e:
            failed.append(f"{call.kernel.name}: {e}")
            continue
        for j, a in enumerate(got):
            out[f"{i:03d}_{call.kernel.name}_{j}"] = np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)
    meta = {"variants": len(calls), "run_s": time.perf_counter() - tic, "prebuild_s": prebuild_s,
            "first_uses": _dialect.first_uses(), "kept": cuda_cache.built(), "kernel_cache": cuda_cache.enabled(),
            "failed": failed, "mlx": mx.__version__}
    np.savez(path, meta=json.dumps(meta), **out)
    print(json.dumps(meta))
    return 1 if failed else 0


def compare(paths: list[str]) -> int:
    files = [np.load(p) for p in paths]
    keys = [k for k in files[0].files if k != "meta"]
    report = {"files": {p: json.loads(str(f["meta"])) for p, f in zip(paths, files)}, "outputs": len(keys)}
    differ = [k for k in keys for f in files[1:] if k not in f.files or not np.array_equal(files[0][k], f[k],
                                                                                         equal_nan=True)]
    report["differ"] = sorted(set(differ))
    report["same"] = bool(keys) and not differ and not any(m["failed"] for m in report["files"].values())
    print(json.dumps(report, indent=1))
    return 0 if report["same"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save")
    p.add_argument("--shape", default="0.8b")
    p.add_argument("--compare", nargs="+")
    args = p.parse_args()
    return save(args.save, args.shape) if args.save else compare(args.compare)


if __name__ == "__main__":
    sys.exit(main())
