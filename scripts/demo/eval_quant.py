"""Held-out perplexity, MTP top-1 and live MTP acceptance of the demo model: bf16 vs Q4 vs rotated Q4 (g32, g64).

Usage: python scripts/demo/eval_quant.py --hf .demo-build/hf --out docs/results/archive/quarot_cpu
(`.demo-build/hf` is the bf16 hub-layout checkpoint `scripts/demo/train_demo.py` writes.) Runs in fp32 activations.
"""

import argparse
import json
import math
import platform
import sys
import sysconfig
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from lattice_mlx import SpecOptions, generate, load
from lattice_mlx.bench.report import provenance
from lattice_mlx.bench.run import HELDOUT_PROMPTS
from lattice_mlx.convert import convert

VARIANTS = {"bf16": {}, "q4-g64": {"quantize_bits": 4, "group_size": 64},
            "q4-g32": {"quantize_bits": 4, "group_size": 32},
            "rot-q4-g64": {"quantize_bits": 4, "group_size": 64, "rotate_seed": 0},
            "rot-q4-g32": {"quantize_bits": 4, "group_size": 32, "rotate_seed": 0}}


def heldout_ids(tok, paths: list[str], tokens: int) -> list[list[int]]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [tok.encode((lib / p).read_text())[:tokens] for p in paths if (lib / p).exists()]


def teacher_forced(model, docs: list[list[int]]) -> dict:
    nll, n, hits_mtp, n_mtp = 0.0, 0, 0, 0
    for ids in docs:
        x = mx.array([ids])
        logits, h = model(x, return_hidden=True)
        nll += nn.losses.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").item()
        n += len(ids) - 1
        head = model.mtp
        u = head(model.model.embed_tokens(x[:, 1:]), head.from_target(h[:, :-1]))
        pred = mx.argmax(model.lm_logits(head.to_target(head.norm(u)))[0, :-1], axis=-1)
        hits_mtp += (pred == x[0, 2:]).sum().item()
        n_mtp += len(ids) - 2
    return {"heldout_loss": nll / n, "heldout_ppl": math.exp(nll / n), "mtp_top1": hits_mtp / n_mtp}


def acceptance(model, tok, prompts: list[str], tokens: int) -> dict:
    out = {}
    for k in (1, 2, 3):
        spec = SpecOptions(draft_tokens=k, adaptive=False)
        rates = [generate(model, tok, p, max_tokens=tokens, speculation=spec, chat_template=False)
                 .speculation["acceptance_rate"] for p in prompts]
        out[f"K={k}"] = sum(rates) / len(rates)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", default=".demo-build/hf")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    spec = json.loads(HELDOUT_PROMPTS.read_text())["prompts"]
    prompts = [p["prompt"] for p in spec][: args.prompts]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, opts in VARIANTS.items():
            path = Path(args.hf) if not opts else convert(args.hf, f"{tmp}/{name}", dtype="float32", **opts)
            model, tok = load(path, dtype="float32")
            docs = heldout_ids(tok, sorted({p["path"] for p in spec}), 512)
            results[name] = teacher_forced(model, docs) | acceptance(model, tok, prompts, args.tokens)
            print(name, results[name], file=sys.stderr, flush=True)
    meta = {"command": " ".join(sys.argv), "device": str(mx.default_device()), "mlx": mx.__version__,
            "platform": platform.platform(), "heldout_docs": len(docs), "prompts": len(prompts),
            **provenance()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = ["| variant | held-out loss | ppl | MTP top-1 | acceptance K=1 | K=2 | K=3 |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {n} | {r['heldout_loss']:.3f} | {r['heldout_ppl']:.1f} | {r['mtp_top1']:.3f} | {r['K=1']:.3f} | "
              f"{r['K=2']:.3f} | {r['K=3']:.3f} |" for n, r in results.items()]
    (out / "summary.md").write_text(f"`{meta['command']}` at {meta['git']}, {meta['device']}\n\n" + "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
