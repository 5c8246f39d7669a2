"""Graph nodes (MLX primitives) of a traced plain step and of a traced pipelined MTP round as a GPU would run them,
counted on the CPU: every custom kernel is replaced by a stand-in node, so the graph has the GPU path's shape (which
kernels run, and every reshape, slice, gather and scalar op around them) without a GPU. On the H200 each node costs
host time (the trace's replay and MLX's dispatch: ~11 us per node in run 14, views included), so this counts what a
round costs the host before a device call measures it.

Usage: python scripts/bench/graph_nodes.py [--shape 0.8b] [--k 3] [--json FILE]
       python scripts/bench/graph_nodes.py --batch 4,16 [--k 3] [--layers 4]   (a continuous batch's traced plain
       step and its MTP round of depth k over B sequences: batch.BatchSteps, bench/oracles.ForcedBatchRounds; MLX's
       fast ops, which the CPU runs as their plain-op fallbacks, stood in as one node each, as a GPU runs them)

The numbers are the GPU path's only as far as the stand-in matches: a custom kernel shows as one `CustomKernel`
node (an `mx.depends` of its outputs on its inputs, plus the outputs' constants, which are not counted); nothing
else differs. Values are meaningless (the stand-ins output zeros), shapes are exact.
"""

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

_FAKE = "__lattice_fake_kernel__"


def fake_kernels() -> None:
    """Make the dispatchers take their kernel paths on the CPU, each kernel call one countable node."""

    zeros: dict = {}  # (shape, dtype) -> a materialised zeros array: a leaf, so it adds no node of its own

    def make(*, name, input_names, output_names, source, header="", ensure_row_contiguous=True, **_):
        def call(*, inputs, output_shapes, output_dtypes, **_):
            outs = []
            for shape, dtype in zip(output_shapes, output_dtypes):
                key = (tuple(shape), dtype)
                if key not in zeros:  # (first met outside a trace: a round or step is built op by op first)
                    zeros[key] = mx.zeros(key[0], dtype=dtype)
                    mx.eval(zeros[key])
                outs.append(zeros[key])
            return mx.depends(outs, list(inputs))

        return call

    mx.fast.cuda_kernel = make
    mx.fast.metal_kernel = make
    mx.cuda.is_available = lambda: True
    from lattice_mlx.metal import q4_embedding

    q4_embedding.rounding_for = lambda dtype: 0  # (it calibrates against MLX's lookup by running the kernel)

    def on() -> bool:
        return os.environ.get("LATTICE_KERNELS", "").lower() != "ref"

    for name, module in list(sys.modules.items()):
        if name.startswith("lattice_mlx") and getattr(module, "use_kernels", None) is not None:
            module.use_kernels = on


def fake_fast_ops() -> None:
    """MLX's fast norms, RoPE and attention as one node each (the CPU builds them from their plain-op fallbacks, a
    GPU launches one kernel): a stand-in of the output's shape that depends on the inputs, counted as a kernel."""
    zeros: dict = {}

    def stand_in(x, *rest, **kw):
        key = (tuple(x.shape), x.dtype)
        if key not in zeros:
            zeros[key] = mx.zeros(key[0], dtype=key[1])
            mx.eval(zeros[key])
        inputs = [a for a in (x, *rest, *kw.values()) if isinstance(a, mx.array)]  # (a mask, an offset too)
        return mx.depends([zeros[key]], inputs)[0]

    for name in ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention"):
        setattr(mx.fast, name, stand_in)


DOT_DIR: Path | None = None  # --dot: each graph's dot file is kept there


def graph_nodes(*outs: mx.array, name: str = "graph") -> dict:
    """Primitive nodes behind `outs` (before evaluation), by primitive."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        text = Path(f.name).read_text()
    if DOT_DIR is not None:
        (DOT_DIR / f"{name}.dot").write_text(text)
    labels = re.findall(r'label ="([^"]+)", shape=rectangle', text)
    counts: dict[str, int] = {}
    for label in labels:
        label = "CustomKernel" if label == "Depends" else label
        counts[label] = counts.get(label, 0) + 1
    return {"total": sum(counts.values()), "by_primitive": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


def step_nodes(model, ids: list[int], steps: int = 4) -> dict:
    """A traced plain step's graph (its token and every cache array it writes)."""
    from lattice_mlx.decode import TracedSteps, prefill
    from lattice_mlx.sample import Sampler

    sampler = Sampler(temp=0.0)
    cache = model.make_cache(trimmable=False)
    logits, _ = prefill(model, mx.array(ids), cache)
    y = sampler(logits)
    traced = TracedSteps(model, sampler, cache)
    for _ in range(steps):
        y = traced.step(y)
        mx.eval(y, *traced._state())
    y = traced.step(y)
    return graph_nodes(y, *traced._state(), name="step")


def round_nodes(model, ids: list[int], k: int, rounds_n: int = 4) -> dict:
    """A traced pipelined round's graph (oracle drafts, as the benchmark runs it): its tokens, n and every state
    array it writes."""
    from lattice_mlx.bench.oracles import DeviceOracle
    from lattice_mlx.decode import prefill
    from lattice_mlx.sample import Sampler
    from lattice_mlx.speculative.pipelined import PipelinedRounds, tracing

    sampler = Sampler(temp=0.0)
    with tracing(True):
        cache = model.make_cache(trimmable=False)
        logits, hidden = prefill(model, mx.array(ids), cache, return_hidden=True)
        first = sampler(logits).item()
        oracle = DeviceOracle(list(range(1, 200)), 0.8, model.args.vocab_size, k, seed=0)
        rounds = PipelinedRounds(model, sampler, k, ids, first, hidden, cache, oracle)
        verified = 0
        for r in range(rounds_n):
            rounds.bounds(r, verified)
            tokens, n = rounds.round(r, k)
            mx.eval(tokens, n, *rounds._state())
            verified += n.item() + 1
        rounds.bounds(rounds_n, verified)
        assert rounds._can_trace(k), "the measured round is not a traced one"
        tokens, n = rounds.round(rounds_n, k)
        return graph_nodes(tokens, n, *rounds._state(), name=f"round_k{k}")


def batch_step_nodes(model, B: int, steps: int = 3) -> dict:
    """A continuous batch's traced plain step over B sequences (batch.BatchSteps' body, built op by op: the graph
    its trace holds): its tokens and every cache array it writes."""
    from lattice_mlx import settings
    from lattice_mlx.batch import BatchDecoder

    with settings.override(trace_steps=True):
        engine = BatchDecoder(model, max_batch=B)
        for b in range(B):
            engine.add(list(range(3, 35 + b)), max_tokens=steps + 8)
        while engine.waiting:
            engine.step()
        for _ in range(steps):
            engine.step()
        engine._flush()
        traced = engine._steps
        traced._bind(engine.cache)
        for c in traced.kv:
            c.reserve(1)
        mx.eval(traced._state())  # (a buffer grown by reserve is the trace's input, not its work)
        y = mx.array(engine._last, dtype=mx.uint32)
        state, ys = traced._body(traced._state(), [y, traced._numbers(engine._route)])
        return graph_nodes(ys, *state, name=f"batch_step_b{B}")


def batch_round_nodes(model, B: int, k: int, rounds_n: int = 3) -> dict:
    """A continuous batch's MTP round of depth k over B sequences (speculative/batched.BatchRounds._round, the body
    of its trace; SYNTHETIC acceptance, bench/oracles.ForcedBatchRounds): its tokens, counts and every state array
    it writes."""
    from lattice_mlx.bench.oracles import ForcedBatchRounds

    engine = ForcedBatchRounds(model, k=k, p_correct=0.8, max_batch=B)
    for b in range(B):
        engine.add(list(range(3, 35 + b)), max_tokens=(rounds_n + 4) * (k + 1))
    while engine.waiting:
        engine.step()
    for _ in range(rounds_n):
        engine.step()
    engine._flush()
    engine._pending()
    assert engine.ptok.shape[1] == k + 1, "the measured round is not a steady one (a traced round's)"
    for c in engine._model_kv():  # as BatchRounds._replay sets a traced round up
        c.reserve(k + 1)
    for c in engine.head_cache:
        c.reserve(k + 1 + engine.k_max)
    engine.holes = True
    mx.eval([a for a in engine._state() if a is not None])  # (buffers reserve grew or compacted: inputs, not work)
    with engine._columns_on_device(engine._round_kv(), k + 1):
        _, n, tokens = engine._round(k)
        state = [a for a in engine._state() if a is not None]
        return graph_nodes(n, tokens, *state, name=f"batch_round_b{B}_k{k}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.8b")
    ap.add_argument("--k", default="2,3")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--head-bits", type=int, default=0, help="4: the MTP head in 4 bits too (convert --quantize-mtp)")
    ap.add_argument("--layers", type=int, help="fewer decoder layers than the shape's (faster; per-layer nodes scale)")
    ap.add_argument("--show", action="store_true", help="print the primitives of each graph")
    ap.add_argument("--batch", help="B,..: count a continuous batch's plain step and round at these sizes instead")
    ap.add_argument("--json")
    ap.add_argument("--dot", help="a folder to keep each graph's dot file in")
    args = ap.parse_args()
    global DOT_DIR
    DOT_DIR = Path(args.dot) if args.dot else None
    if DOT_DIR is not None:
        DOT_DIR.mkdir(parents=True, exist_ok=True)
    import lattice_mlx.cli  # noqa: F401  (every module imported, so fake_kernels reaches each one's use_kernels)
    from lattice_mlx import decode  # noqa: F401
    from lattice_mlx.bench import run as bench  # noqa: F401
    from lattice_mlx.bench.synthetic import random_model
    from lattice_mlx.speculative import pipelined as rounds  # noqa: F401

    fake_kernels()
    mx.random.seed(0)
    shape = dict(bench.SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    model = random_model(**shape, bits=4, dtype=bench.DTYPES[args.dtype])
    if args.head_bits:
        model.mtp = bench.quantized_head(model, group_size=64)
    if args.batch:
        fake_fast_ops()
        out = {"shape": args.shape, "dtype": args.dtype, "layers": model.args.num_hidden_layers, "batch": {}}
        for B in map(int, args.batch.split(",")):
            row = out["batch"][B] = {"step": batch_step_nodes(model, B)}
            for k in map(int, args.k.split(",")):
                row[f"round_k{k}"] = batch_round_nodes(model, B, k)
            print(f"B={B}: " + "; ".join(f"{key} {g['total']} nodes, {g['by_primitive'].get('CustomKernel', 0)} "
                                         f"kernels (custom or fast), {g['by_primitive'].get('Arange', 0)} aranges"
                                         for key, g in row.items()))
            if args.show:
                for key, g in row.items():
                    print(f"  {key}", json.dumps(g["by_primitive"]))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    ids = list(range(3, 35))
    out = {"shape": args.shape, "dtype": args.dtype, "head_bits": args.head_bits or None,
           "step": step_nodes(model, ids)}
    print(f"plain step: {out['step']['total']} nodes, {out['step']['by_primitive'].get('CustomKernel', 0)} kernels")
    for k in map(int, args.k.split(",")):
        row = out[f"round_k{k}"] = round_nodes(model, ids, k)
        print(f"K={k} round: {row['total']} nodes, {row['by_primitive'].get('CustomKernel', 0)} custom kernels")
    if args.show:
        for key in out:
            if isinstance(out[key], dict):
                print(key, json.dumps(out[key]["by_primitive"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
