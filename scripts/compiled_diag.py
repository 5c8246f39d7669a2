"""Where the compiled path differs from the layer path on a GPU. H200 run 4 (TF32 on): a recorded 4-token verify's
fp32 logits were up to 4.6e-3 off in rows 1-3 (row 0 equal) while decode steps matched to 1e-5; CPU: equal.

Each variant prints max |compiled - layer| per logit row. Variants: TF32 on / off (MLX_ENABLE_TF32, one child
process each, since MLX reads it once), two checkpoints (the test's `pattern`, head_dim 16, which no kernel runs;
and a kernel-sized one, head_dim 64 / GDN heads 64), kernels ref / on (a fresh model each, so no trace is shared),
and three forwards: a recorded 4-token verify, the same 4 tokens unrecorded, one unrecorded decode step.

Usage: python scripts/compiled_diag.py [--out FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = [5, 9, 33, 21, 7, 100, 3, 3, 17]
CHECKPOINTS = {
    "pattern_hd16": dict(seed=2, num_hidden_layers=5, linear_num_key_heads=1, linear_num_value_heads=4,
                         layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                      "linear_attention"]),
    "kernel_sized_hd64": dict(seed=4, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                              vocab_size=1024),
}


def forward(model, compile_flag: str, tokens: list[int], recorded: bool):
    import mlx.core as mx

    from lattice_mlx import cache as caches
    from lattice_mlx.decode import prefill

    os.environ["LATTICE_COMPILE"] = compile_flag
    cache = model.make_cache()
    prefill(model, mx.array(PROMPT), cache)
    if recorded:
        caches.begin(cache)
    out = model(mx.array([tokens]), cache)
    mx.eval(out)
    return out


def child() -> dict:
    import mlx.core as mx

    from lattice_mlx.bench.synthetic import random_checkpoint
    from lattice_mlx.load import load_model
    from lattice_mlx.metal import use_kernels

    res = {"device": str(mx.default_device()), "MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32", "default")}
    with tempfile.TemporaryDirectory() as d:
        for name, cfg in CHECKPOINTS.items():
            path = random_checkpoint(Path(d) / name, **cfg)
            for kernels in ("ref", "on"):
                os.environ["LATTICE_KERNELS"] = "ref" if kernels == "ref" else ""
                model, _ = load_model(path)  # fresh: no traces from the other kernel setting
                row = {"kernels_run": use_kernels()}
                for label, tokens, recorded in (("verify4_recorded", [4, 8, 15, 16], True),
                                                ("forward4_unrecorded", [4, 8, 15, 16], False),
                                                ("decode1_unrecorded", [4], False)):
                    a, b = forward(model, "0", tokens, recorded), forward(model, "1", tokens, recorded)
                    row[label] = [f"{x:.2e}" for x in mx.abs(a - b).max(axis=-1)[0].tolist()]
                    row[label + "_layer_repeat"] = mx.abs(a - forward(model, "0", tokens, recorded)).max().item()
                res[f"{name}/kernels_{kernels}"] = row
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child()))
        return
    results = []
    for tf32 in ("1", "0"):
        env = dict(os.environ, MLX_ENABLE_TF32=tf32)
        proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                              check=False)
        results.append(json.loads(proc.stdout) if proc.returncode == 0 else {"MLX_ENABLE_TF32": tf32,
                                                                              "error": proc.stderr[-1500:]})
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
