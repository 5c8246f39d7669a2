"""Where a verify row stops being the decode step at its position: bitwise, op by op.

A T-token forward (a verify, as the speculative loop runs it: recording, return_hidden) against T one-token
forwards (plain decoding) from the same cache. Reports, per path (layer by layer; compiled), whether each row's
logits are bitwise equal and, on the layer path, the first op whose output row differs although its inputs did not.
`--batch B`: B sequences of the same length in one forward ([B, T] against B rows of one token each), the shapes of
a batch's verify against its plain steps (every 4-bit matmul of more than the fused kernel's rows is MLX's).

Usage: python scripts/bench/batch_invariance.py [--model 0.8b] [--dtype bfloat16] [--ts 2,4] [--batch 1] [--out DIR]
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from lattice_mlx import cache as cache_ops
from lattice_mlx.bench.oracles import OracleDrafter
from lattice_mlx.bench.run import DTYPES, SHAPES
from lattice_mlx.bench.synthetic import random_model
from lattice_mlx.decode import generate_step
from lattice_mlx.models import compiled, layers
from lattice_mlx.models import qwen3_5 as q35
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import SpecOptions, SpecStats, speculate

# (module, name, axis of T in the output, output index when the op returns a tuple)
PATCH = [
    (layers, "q4_matmul", 1, None),
    (layers, "dense_matmul", 1, None),
    (q35, "sdpa", 2, None),
    (q35, "gated_delta_conv_update", 1, 0),
    (q35, "qk_norm_rope", 2, "all"),
    (mx.fast, "rms_norm", 1, None),
    (mx.fast, "rope", 2, None),
]


class Recorder:
    def __init__(self):
        self.calls: list[tuple[str, int, mx.array]] = []
        self.saved = []

    def __enter__(self):
        for mod, name, axis, idx in PATCH:
            fn = getattr(mod, name)
            self.saved.append((mod, name, fn))

            def wrap(*a, _fn=fn, _name=name, _axis=axis, _idx=idx, **kw):
                out = _fn(*a, **kw)
                outs = list(out) if _idx == "all" else [out[_idx] if _idx is not None else out]
                mx.eval(outs)
                self.calls += [(_name, _axis, o) for o in outs]
                return out

            setattr(mod, name, wrap)
        return self

    def __exit__(self, *exc):
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)


def bits_equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.all(a == b).item())


def compare(model, prompt: mx.array, T: int, *, record_ops: bool, cache=None, seed: int = 1) -> dict:
    """prompt [B, P]: B sequences side by side (rows b * T + t in the report)."""
    B = prompt.shape[0]
    if cache is None:
        cache = model.make_cache()
        model(prompt, cache)
        mx.eval([c.state for c in cache])
    snap = cache_ops.snapshot(cache)
    toks = mx.array(np.random.default_rng(seed).integers(0, model.args.vocab_size, (B, T)).astype(np.int32))

    step_logits, step_calls = [], []
    for t in range(T):
        with Recorder() if record_ops else _null() as rec:
            lg = model(toks[:, t : t + 1], cache)  # plain decode step: final norm fused into the lm_head
            mx.eval(lg, [c.state for c in cache])
        step_logits.append(lg[:, 0])
        step_calls.append(rec.calls if rec else [])
    cache_ops.restore(cache, snap)
    cache_ops.begin(cache)
    with Recorder() if record_ops else _null() as rec:
        lg, hidden = model(toks, cache, return_hidden=True)  # the verify forward
        mx.eval(lg, hidden)
    cache_ops.commit(cache)
    cache_ops.restore(cache, snap)
    verify_calls = rec.calls if rec else []

    rows = []
    for b in range(B):
        for t in range(T):
            x, y = lg[b, t].astype(mx.float32), step_logits[t][b].astype(mx.float32)
            rows.append({"row": b * T + t, "bitwise": bits_equal(lg[b, t], step_logits[t][b]),
                         "max_abs": mx.abs(x - y).max().item(),
                         "argmax_equal": mx.argmax(x).item() == mx.argmax(y).item()})
    res = {"T": T, "rows": rows}
    if record_ops:
        first = []
        for t in range(T):
            calls = step_calls[t]
            n = min(len(calls), len(verify_calls))
            found = None
            for i in range(n):
                name, axis, o_step = calls[i]
                vname, _, o_ver = verify_calls[i]
                if vname != name:
                    found = {"op": i, "name": f"{name} vs {vname}", "note": "call sequences diverge"}
                    break
                row = mx.take(o_ver, mx.array([t]), axis=axis)
                if not bits_equal(row, o_step):
                    d = mx.abs(row.astype(mx.float32) - o_step.astype(mx.float32)).max().item()
                    found = {"op": i, "name": name, "shape_step": list(o_step.shape),
                             "shape_verify": list(o_ver.shape), "max_abs": d}
                    break
            first.append({"row": t, "first_diff": found, "ops": n})
        res["first_diff"] = first
        res["op_counts"] = {"step": len(step_calls[0]), "verify": len(verify_calls)}
    return res


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def sweep(model, prompt: mx.array, T: int, positions: int, *, record_ops: bool) -> dict:
    """`compare` at `positions` successive cache lengths (one plain step between them): which op differs first, how
    often."""
    import collections
    cache = model.make_cache()
    model(prompt, cache)
    mx.eval([c.state for c in cache])
    firsts, rows_bad = collections.Counter(), 0
    for j in range(positions):
        r = compare(model, prompt, T, record_ops=record_ops, cache=cache, seed=j)
        rows_bad += sum(not row["bitwise"] for row in r["rows"])
        for f in r.get("first_diff", []):
            if f["first_diff"] is not None:
                firsts[f"{f['first_diff']['name']}#{f['first_diff']['op']}"] += 1
        lg = model(mx.full((prompt.shape[0], 1), j + 1, dtype=mx.int32), cache)
        mx.eval(lg, [c.state for c in cache])
    return {"T": T, "positions": positions, "rows_not_bitwise": rows_bad, "first_diff_ops": dict(firsts)}


def loop_check(model, prompts: list[list[int]], n: int, ks: list[int], p: float) -> list[dict]:
    """Whole generations: plain twice (is plain decoding deterministic?), then MTP with oracle drafts (every draft the
    recorded plain token with probability p) per K; the first position where MTP's tokens leave plain's."""
    out = []
    for i, ids in enumerate(prompts):
        def plain():
            return [t for t, _ in zip(generate_step(model, mx.array(ids), sampler=Sampler()), range(n))]
        ref, again = plain(), plain()
        row = {"prompt": i, "plain_repeatable": ref == again}
        for k in ks:
            opts = SpecOptions(draft_tokens=k, adaptive=False)
            stats = SpecStats.of(opts)
            drafter = OracleDrafter(model, Sampler(), ref, p, seed=i)
            got = [t for t, _ in zip(speculate(model, mx.array(ids), sampler=Sampler(), options=opts,
                                                      stats=stats, drafter=drafter), range(n))]
            first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            row[f"K{k}"] = {"first_divergence": first, "acceptance": round(stats.to_dict()["acceptance_rate"], 3)}
        print(f"prompt {i}: {row}", flush=True)
        out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="0.8b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--ts", default="2,4")
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--batch", type=int, default=1, help="sequences side by side in each forward (same length)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--loop", type=int, default=0, help="also N prompts of whole generations (plain vs oracle MTP)")
    ap.add_argument("--tokens", type=int, default=112)
    ap.add_argument("--sweep", type=int, default=0, help="compare at N successive positions (counts, first ops)")
    ap.add_argument("--paths", default="layers,compiled", help="paths to check (layers, compiled)")
    args = ap.parse_args()
    model = random_model(**SHAPES[args.model], bits=4, group_size=64, dtype=DTYPES[args.dtype])
    prompt = mx.array(np.random.default_rng(0).integers(0, model.args.vocab_size, (args.batch, args.prompt))
                      .astype(np.int32))
    out = {"model": args.model, "dtype": args.dtype, "batch": args.batch, "device": str(mx.default_device()),
           "results": []}
    paths = args.paths.split(",")
    for T in map(int, filter(None, args.ts.split(","))) if not args.sweep else ():
        for path in paths:
            with compiled.forced(path == "compiled"):
                r = compare(model, prompt, T, record_ops=path == "layers")
            r["path"] = path
            out["results"].append(r)
            eq = "".join("=" if row["bitwise"] else ("~" if row["argmax_equal"] else "X") for row in r["rows"])
            print(f"T={T} {path:8s} rows bitwise [{eq}] max_abs "
                  f"{max(row['max_abs'] for row in r['rows']):.3g}", flush=True)
            for f in r.get("first_diff", []):
                print(f"   row {f['row']}: first differing op {f['first_diff']}", flush=True)
    if args.sweep:
        for T in map(int, filter(None, args.ts.split(","))):
            for path in paths:
                with compiled.forced(path == "compiled"):
                    r = sweep(model, prompt, T, args.sweep, record_ops=path == "layers")
                print(f"sweep T={T} {path}: {r}", flush=True)
                out.setdefault("sweep", []).append({**r, "path": path})
    if args.loop:
        rng = np.random.default_rng(2)
        prompts = [rng.integers(1, model.args.vocab_size, 64).tolist() for _ in range(args.loop)]
        for path in paths:
            with compiled.forced(path == "compiled"):
                print(f"loop, {path} path:", flush=True)
                out[f"loop_{path}"] = loop_check(model, prompts, args.tokens, [2, 3], 1.0)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "batch_invariance.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
