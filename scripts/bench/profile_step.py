"""Where a decode step's time goes on a GPU backend: per-op costs, per-layer costs, op counts, full steps.

Usage: python scripts/bench/profile_step.py --out DIR [--shape 0.8b] [--dtype bfloat16] [--small]
Writes DIR/profile.json and prints one line per measurement. Each figure is the median over repetitions of
(time to evaluate N independent copies of the op in one graph) / N, so it includes MLX's per-op dispatch cost,
which is what a decode step pays.
"""

import argparse
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

RESULTS: dict = {}


def per_call(fn, *, n: int = 50, reps: int = 7) -> float:
    """Median microseconds per call of fn() when n calls are evaluated as one graph."""
    mx.eval(fn())
    times = []
    for _ in range(reps):
        outs = [fn() for _ in range(n)]
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        times.append((time.perf_counter() - tic) / n)
    return statistics.median(times) * 1e6


def record(name: str, value, unit: str = "us") -> None:
    RESULTS[name] = value
    print(f"{name}: {value:.2f} {unit}" if isinstance(value, float) else f"{name}: {value}", flush=True)


def count_ops(*outs) -> dict:
    """Primitive counts in the graph of outs (mx.export_to_dot), arrays without a primitive excluded."""
    path = "/tmp/lattice_profile_graph.dot"
    mx.export_to_dot(path, *outs)
    labels = re.findall(r'\[label ="([^"]*)"', open(path).read())
    counts: dict[str, int] = {}
    for lab in labels:
        if lab.startswith("(") or re.match(r"^[0-9(]", lab):
            continue
        key = re.sub(r"\d+$", "", lab.split()[0])
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def decode_rate(model, prompt: mx.array, n: int, *, pipelined: bool = True) -> float:
    """Tokens per second of a greedy plain decode loop (lattice model protocol), n tokens after prefill."""
    from lattice_mlx.decode import prefill

    cache = model.make_cache()
    logits, _ = prefill(model, prompt, cache)
    y = mx.argmax(logits, axis=-1)
    mx.eval(y)
    tic = time.perf_counter()
    for _ in range(n):
        nxt = mx.argmax(model(y.reshape(1, 1), cache)[0, -1], axis=-1)
        if pipelined:
            mx.async_eval(nxt)
            y.item()
        else:
            mx.eval(nxt)
        y = nxt
    y.item()
    return n / (time.perf_counter() - tic)


def stock_rate(stock, prompt: mx.array, n: int) -> float:
    from mlx_lm.generate import generate_step

    steps = generate_step(prompt, stock, max_tokens=n + 1)
    next(steps)
    tic = time.perf_counter()
    for _ in steps:
        pass
    return n / (time.perf_counter() - tic)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--small", action="store_true", help="a small shape (CPU dry run)")
    p.add_argument("--tokens", type=int, default=96)
    args = p.parse_args()
    from lattice_mlx.bench.run import build_stock
    from lattice_mlx.bench.synthetic import QWEN3_5_0_8B, hub_config, random_model

    dtype = getattr(mx, args.dtype)
    from lattice_mlx.bench.report import provenance

    meta = {"device": str(mx.default_device()), "mlx": mx.__version__, "platform": platform.platform(),
            **provenance(), "dtype": args.dtype,
            "env": {k: v for k, v in os.environ.items() if k.startswith("LATTICE_")}}
    shape = dict(QWEN3_5_0_8B)
    if args.small:
        shape.update(hidden_size=256, intermediate_size=512, vocab_size=4096, num_hidden_layers=8)
    tic = time.perf_counter()
    mx.random.seed(0)
    model = random_model(**shape, bits=4, group_size=64, dtype=dtype)
    record("build_model_s", time.perf_counter() - tic, "s")
    H = shape["hidden_size"]
    x = mx.random.normal((1, 1, H)).astype(dtype)
    mx.eval(x)

    # -- single ops --------------------------------------------------------------------------------------------
    def qmm(n_out, k_in, rows=1):
        w = mx.random.normal((n_out, k_in)).astype(dtype)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        xx = mx.random.normal((1, rows, k_in)).astype(dtype)
        mx.eval(wq, s, b, xx)
        return lambda: mx.quantized_matmul(xx, wq, s, b, transpose=True, group_size=64, bits=4)

    a = shape
    kd, vd = a["linear_num_key_heads"] * a["linear_key_head_dim"], a["linear_num_value_heads"] * a["linear_value_head_dim"]
    conv_dim = 2 * kd + vd
    I = a["intermediate_size"]
    qd = a["num_attention_heads"] * a["head_dim"]
    kvd = a["num_key_value_heads"] * a["head_dim"]
    for name, (n_out, k_in) in {
        "qmm_gdn_qkv": (conv_dim, H), "qmm_gdn_z": (vd, H), "qmm_gdn_b": (a["linear_num_value_heads"], H),
        "qmm_gdn_out": (H, vd), "qmm_mlp_up": (I, H), "qmm_mlp_down": (H, I), "qmm_attn_q": (2 * qd, H),
        "qmm_attn_kv": (kvd, H), "qmm_attn_o": (H, qd), "qmm_fused_gdn_in": (conv_dim + vd + 2 * a["linear_num_value_heads"], H),
        "qmm_fused_mlp": (2 * I, H), "qmm_fused_attn": (2 * qd + 2 * kvd, H),
    }.items():
        record(name, per_call(qmm(n_out, k_in)))
    w = mx.random.normal((H,)).astype(dtype)
    record("rms_norm", per_call(lambda: mx.fast.rms_norm(x, w, 1e-6)))
    record("add", per_call(lambda: x + x))
    record("silu_mul", per_call(lambda: nn.silu(x) * x))
    fused = mx.compile(lambda g, u: nn.silu(g) * u)
    record("silu_mul_compiled", per_call(lambda: fused(x, x)))
    ci = mx.random.normal((1, 4, conv_dim)).astype(dtype)
    cw = mx.random.normal((conv_dim, 4, 1)).astype(dtype)
    mx.eval(ci, cw)
    record("conv1d_T1", per_call(lambda: mx.conv1d(ci, cw, groups=conv_dim)))
    record("conv_mulsum_T1", per_call(lambda: (ci * cw[:, :, 0].T).sum(axis=1, keepdims=True)))
    st = mx.random.normal((1, 3, conv_dim)).astype(dtype)
    row = mx.random.normal((1, 1, conv_dim)).astype(dtype)
    mx.eval(st, row)
    record("concatenate_conv", per_call(lambda: mx.concatenate([st, row], axis=1)))
    record("copy_slice", per_call(lambda: mx.contiguous(ci[:, :, kd:2 * kd])))
    from lattice_mlx.metal.gated_delta import gated_delta_update
    Hv, Dv, Hk, Dk = a["linear_num_value_heads"], a["linear_value_head_dim"], a["linear_num_key_heads"], a["linear_key_head_dim"]
    qg = mx.random.normal((1, 1, Hk, Dk)).astype(dtype)
    vg = mx.random.normal((1, 1, Hv, Dv)).astype(dtype)
    ag = mx.random.normal((1, 1, Hv)).astype(dtype)
    s0 = mx.zeros((1, Hv, Dv, Dk))
    Al, dtb = mx.zeros((Hv,)), mx.zeros((Hv,))
    mx.eval(qg, vg, ag, s0)
    record("gdn_kernel_T1", per_call(lambda: gated_delta_update(qg, qg, vg, ag, ag, Al, dtb, s0)))
    record("custom_kernel_floor_T1_note", "gdn_kernel_T1 above includes its input preparation")

    # -- layers -------------------------------------------------------------------------------------------------
    from lattice_mlx.decode import prefill

    cache = model.make_cache()
    prefill(model, mx.arange(64) % 1000, cache)
    layers = model.model.layers if hasattr(model, "model") else model.language_model.layers
    gi = next(i for i, l in enumerate(layers) if l.is_linear)
    ai = next(i for i, l in enumerate(layers) if not l.is_linear)
    from lattice_mlx import cache as caches

    def layer_fn(i):
        def f():
            caches.begin(cache[i]) if hasattr(cache[i], "recording") else None
            return layers[i](x, cache[i])
        return f

    # Layers mutate their caches; time them in a chain so the state dependency is real.
    def chain_time(fn, n=40, reps=5):
        times = []
        for _ in range(reps):
            outs = []
            for _ in range(n):
                outs.append(fn())
            mx.synchronize()
            tic = time.perf_counter()
            mx.eval(outs)
            times.append((time.perf_counter() - tic) / n)
        return statistics.median(times) * 1e6

    gdn_layer = layers[gi]
    attn_layer = layers[ai]
    c_g, c_a = model.make_cache()[gi], model.make_cache()[ai]
    mx.eval(attn_layer(mx.random.normal((1, 64, H)).astype(dtype), c_a))
    record("layer_gdn_T1", chain_time(lambda: gdn_layer(x, c_g)))
    record("layer_attn_T1", chain_time(lambda: attn_layer(x, c_a)))
    record("mlp_T1", per_call(lambda: gdn_layer.mlp(x)))
    record("gdn_mixer_T1", chain_time(lambda: gdn_layer.linear_attn(x, c_g)))
    record("ops_layer_gdn", count_ops(gdn_layer(x, c_g)))
    record("ops_layer_attn", count_ops(attn_layer(x, c_a)))
    h = mx.random.normal((1, 1, H)).astype(dtype)
    record("lm_head", per_call(lambda: model.lm_logits(h) if hasattr(model, "lm_logits") else model(h)))
    record("embed", per_call(lambda: model.model.embed_tokens(mx.array([[7]]))))

    # -- whole steps ---------------------------------------------------------------------------------------------
    out = model(mx.array([[3]]), cache)
    record("ops_step", count_ops(out))
    record("ops_step_total", sum(RESULTS["ops_step"].values()))
    mx.eval(out)
    prompt = mx.arange(32) % 1000
    stock, diff = build_stock(model, hub_config(**shape))
    record("stock_max_logit_diff", diff)
    for rep in range(3):
        record(f"lattice_tok_s_sync_{rep}", decode_rate(model, prompt, args.tokens, pipelined=False), "tok/s")
        record(f"lattice_tok_s_{rep}", decode_rate(model, prompt, args.tokens), "tok/s")
        record(f"stock_tok_s_{rep}", stock_rate(stock, prompt, args.tokens), "tok/s")
    lat = statistics.median(RESULTS[f"lattice_tok_s_{r}"] for r in range(3))
    sto = statistics.median(RESULTS[f"stock_tok_s_{r}"] for r in range(3))
    record("lattice_over_stock", lat / sto, "x")
    # Cached forward over T tokens inside a speculative region (per-step GDN states recorded), rolled back each time.
    from lattice_mlx.sample import Sampler
    from lattice_mlx.speculative.drafters import MTPDrafter

    for T in range(1, 10):
        times = []
        for _ in range(15):
            caches.begin(cache)
            mx.synchronize()
            tic = time.perf_counter()
            mx.eval(model(mx.arange(T)[None] + 7, cache))
            times.append(time.perf_counter() - tic)
            caches.rollback(cache, T)
            caches.commit(cache)
        record(f"forward_T{T}_us", statistics.median(times) * 1e6)
    for T in range(2, 10):
        record(f"forward_T{T}_over_T1", RESULTS[f"forward_T{T}_us"] / RESULTS["forward_T1_us"], "x")
    # MTP head: drafting K tokens (K head forwards + lm_head + argmax, one graph, one sync)
    logits, hidden = model(prompt[None], return_hidden=True)
    drafter = MTPDrafter(model, Sampler())
    drafter.start(prompt.tolist(), 5, hidden[0], None)
    for K in (1, 2, 3, 4):
        times = []
        for i in range(12):
            drafter.observe([5], hidden[0, -1:])
            mx.synchronize()
            tic = time.perf_counter()
            mx.eval(drafter.propose(prompt.tolist(), K)[0])  # drafts are lazy: time their evaluation too
            times.append(time.perf_counter() - tic)
            drafter.rollback()
        record(f"mtp_draft_K{K}_us", statistics.median(times) * 1e6)
    # Python graph-building time of one step (no evaluation)
    times = []
    for _ in range(20):
        tic = time.perf_counter()
        o = model(mx.array([[3]]), cache)
        times.append(time.perf_counter() - tic)
        mx.eval(o)
    record("graph_build_ms", statistics.median(times) * 1e3, "ms")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "profile.json").write_text(json.dumps({"meta": meta, "results": RESULTS}, indent=2))


if __name__ == "__main__":
    main()
