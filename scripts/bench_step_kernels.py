"""GPU time per call (CUPTI, through `gpu_kernels.py` of ../shared/device copied into --profiler-dir) of a decode step's
kernels in isolation: the greedy argmax kernel (metal/argmax.py) against MLX's argmax at the 0.8B vocabulary
(248,320, bf16, rows 1 / 4 / 5), and the GDN mixer's conv-fused kernel at T = 1 and 4.

The conv-fused kernel: 9.8 us per launch at T = 1 in run 5 (89ffd77), 24-29 us since run 8 (run 17 alone: 26.1 us),
after the body gained two small int inputs (`cols`, fd78ec5; `pick`, e5bcc08) and 64-bit offsets. Run 17 ruled out the
rows per threadgroup (1-16: 25.6-27.5 us). The variants here:
  prod      the kernel as shipped;
  pick16    `pick` as a 16-byte array: MLX's CUDA allocator serves arrays of <= 8 bytes from one managed pool marked
            read-mostly, whose pages the host's own small arrays share (the hypothesis: a GPU read of it faults);
  const     no `cols` / `pick` inputs: their values as literals, 32-bit offsets (the run-5 body's form);
  fresh_cols  `cols` made from host values at every call instead of once per value (`_cols` is cached).
The attention kernel (17.9 us per launch in a plain step) likewise, as shipped and with its scale, split/causal
pair and key count as 16-byte arrays (`params16`).
Each variant's outputs are compared bitwise with prod's before it is timed; a case that fails is recorded as an
error and the others still run.

Usage (device): python scripts/bench_step_kernels.py --profiler-dir .device-tools --out step_kernels.json
"""

import argparse
import functools
import importlib.util
import json
import os

import mlx.core as mx

from lattice_mlx.metal import _dialect, attention, gated_delta
from lattice_mlx.metal.argmax import argmax_kernel, argmax_ref
from lattice_mlx.metal.gated_delta import gated_delta_conv_kernel


def cases() -> dict:
    out = {}
    for rows in (1, 4, 5):
        x = (mx.random.normal((rows, 248320)) * 4).astype(mx.bfloat16)
        mx.eval(x)
        out[f"argmax_kernel_rows{rows}"] = lambda x=x: argmax_kernel(x)
        out[f"mx_argmax_rows{rows}"] = lambda x=x: argmax_ref(x)
    Hk, Dk, Hv, Dv, KC = 16, 128, 16, 128, 4
    C = 2 * Hk * Dk + Hv * Dv
    w = (mx.random.normal((C, KC)) * 0.3).astype(mx.bfloat16)
    A_log, dt_bias = mx.zeros((Hv,)), mx.zeros((Hv,), dtype=mx.bfloat16)
    state = mx.random.normal((1, Hv, Dv, Dk)) * 0.1
    mx.eval(w, state, A_log, dt_bias)

    def conv_case(T, step, variant="prod"):
        qkv = mx.random.normal((1, T, C)).astype(mx.bfloat16)
        a, b = mx.random.normal((1, T, Hv)).astype(mx.bfloat16), mx.random.normal((1, T, Hv)).astype(mx.bfloat16)
        conv = mx.random.normal((1, KC - 1, C)).astype(mx.bfloat16)
        mx.eval(qkv, a, b, conv)

        heads = (Hk, Dk, Hv, Dv)
        pick16 = mx.zeros((4,), dtype=mx.int32)
        mx.eval(pick16)

        def prod():
            return gated_delta_conv_kernel(qkv, conv, w, a, b, A_log, dt_bias, state, heads=heads, step_states=step)

        if variant == "prod":
            return prod

        def fn():
            saved = gated_delta._NO_PICK, gated_delta._cols
            if variant == "pick16":
                gated_delta._NO_PICK = pick16
            elif variant == "fresh_cols":
                gated_delta._cols = gated_delta._cols.__wrapped__
            else:
                return conv_const_kernel(qkv, conv, w, a, b, A_log, dt_bias, state, heads, step)
            try:
                return prod()
            finally:
                gated_delta._NO_PICK, gated_delta._cols = saved

        fn.check = lambda: all(mx.array_equal(x, y).item() for x, y in zip(fn(), prod()))
        return fn

    for T, step in ((1, False), (1, True), (4, True), (4, False)):
        out[f"gdn_conv_T{T}_step{int(step)}"] = conv_case(T, step)
    for T, step in ((1, False), (4, True)):
        for variant in ("fresh_cols", "pick16", "const"):
            out[f"gdn_conv_T{T}_step{int(step)}_{variant}"] = conv_case(T, step, variant)
    for T in (1, 4):  # the 0.8B attention (Hq 8, Hkv 2, D 256) over 128 keys; its parameters as 4-8 or 16 bytes
        out[f"sdpa_T{T}_L128"] = sdpa_case(T, padded=False)
        out[f"sdpa_T{T}_L128_params16"] = sdpa_case(T, padded=True)
    return out


def sdpa_case(T: int, padded: bool):
    q = mx.random.normal((1, 8, T, 256)).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, 2, 128, 256)).astype(mx.bfloat16) for _ in range(2))
    pads = (lambda scale: mx.array([scale, 0, 0, 0], dtype=mx.float32),
            lambda a, b: mx.array([a, b, 0, 0], dtype=mx.int32), mx.array([-1, 0, 0, 0], dtype=mx.int32))
    mx.eval(q, k, v, pads[2])
    scale_array, int_pair = functools.cache(pads[0]), functools.cache(pads[1])

    def prod():
        return attention.sdpa_kernel(q, k, v, scale=256 ** -0.5, causal=T > 1)

    if not padded:
        return prod

    def fn():
        saved = attention._scale_array, attention._int_pair, attention._ALL_KEYS
        attention._scale_array, attention._int_pair, attention._ALL_KEYS = scale_array, int_pair, pads[2]
        try:
            return prod()
        finally:
            attention._scale_array, attention._int_pair, attention._ALL_KEYS = saved

    fn.check = lambda: mx.array_equal(fn(), prod()).item()
    return fn


def const_body(C: int, Hv: int) -> str:
    """The conv-fused body without its cols / pick inputs: their plain-path values as literals, 32-bit offsets."""
    body = gated_delta._BODY_CONV
    for a, b in (("pick[0]", "0"), ("pick[1]", "0"), ("cols[0]", str(C)), ("cols[1]", "0"), ("cols[2]", str(Hv)),
                 ("cols[3]", "0"), ("cols[4]", str(Hv)), ("cols[5]", "0"), ("int64_t", "int")):
        assert a in body, a
        body = body.replace(a, b)
    return body


def conv_const_kernel(qkv, conv, w, a, b, A_log, dt_bias, state, heads, step):
    Hk, Dk, Hv, Dv = heads
    C, KC = 2 * Hk * Dk + Hv * Dv, w.shape[-1]
    B, T, _ = qkv.shape
    kernel = _dialect.build("lattice_gdn_conv_const", const_body(C, Hv), gated_delta._CONV_INPUTS[:-2],
                            gated_delta._CONV_OUTPUTS)
    return kernel(
        inputs=[qkv, conv, w, a, b, A_log, dt_bias, state.reshape(B, 1, Hv, Dv, Dk)],
        template=[("YT", qkv.dtype), ("Hk", Hk), ("Hv", Hv), ("Dk", Dk), ("Dv", Dv), ("KC", KC), ("STEP", step)],
        grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), (B, T, Hv, Dv, Dk) if step else (B, Hv, Dv, Dk), (B, KC - 1 + T, C)],
        output_dtypes=[qkv.dtype, mx.float32, qkv.dtype])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profiler-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("gpu_kernels", os.path.join(args.profiler_dir, "gpu_kernels.py"))
    prof_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof_mod)
    results = {}
    for name, fn in cases().items():
        try:  # one case's failure is recorded, the others still run
            if hasattr(fn, "check") and not fn.check():
                raise AssertionError("outputs differ from the shipped kernel's")
            for _ in range(3):
                mx.eval(fn())  # compile, warm
            with prof_mod.kernel_profile(steps=args.calls) as prof:
                for _ in range(args.calls):
                    mx.eval(fn())
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {results[name]['error']}", flush=True)
            continue
        s = prof.summary(top=3)
        results[name] = {"us": round(s["kernel_us_per_step"], 2), "kernels": s["kernels_per_step"]}
        print(f"{name}: {s['kernel_us_per_step']:.2f} us ({s['kernels_per_step']:.1f} kernels)", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
