"""Acceptance lost vs draft cost for the MTP head's draft vocabulary (models/mtp.py DraftVocab), on the demo model.

The ids are ranked by token counts over the demo's training side of the CPython standard library (files the held-out
rule keeps out of training; the held-out prompts come from the others), as `convert --draft-vocab N --draft-corpus`
ranks them. For each size: greedy MTP on the held-out prompts, acceptance per draft position, the share of generated
tokens inside the subset, and the draft lm_head's time on this machine; then the lm_head of the Qwen3.5-0.8B shape
(248,320 rows, Q4) against a 32,768-row subset, timed the same way (a CPU figure: the GPU's is for the H200 bench).

Usage: python scripts/demo/eval_draft_vocab.py [--sizes 8192,4096,2048,1024,512] [--k 3] [--tokens 64] [--prompts 16]
       [--corpus-mb 8] [--out DIR]
"""

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from lattice_mlx import SpecOptions, generate, load
from lattice_mlx.bench.report import provenance
from lattice_mlx.models.mtp import DraftVocab

HELDOUT = Path(__file__).resolve().parents[2] / "src/lattice_mlx/assets/prompts/demo_heldout.json"


def held_out(rel: str) -> bool:
    """The demo's held-out rule (demo_heldout.json): sha256(relative path)[:8] as int % 100 < 3."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < 3


def corpus_counts(tok, vocab: int, limit_bytes: int) -> tuple[np.ndarray, int]:
    root = Path(sysconfig.get_paths()["stdlib"])
    counts, used = np.zeros(vocab, dtype=np.int64), 0
    for f in sorted(root.rglob("*.py")):
        rel = str(f.relative_to(root))
        if held_out(rel) or "site-packages" in rel or "/test" in rel:
            continue
        text = f.read_text(encoding="utf-8", errors="ignore")
        ids = np.asarray(tok.encode(text, add_special_tokens=False), dtype=np.int64)
        counts += np.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab)
        used += len(text)
        if used >= limit_bytes:
            break
    return counts, used


def lm_head_ms(model, vocab: DraftVocab | None, reps: int = 20) -> float:
    h = mx.random.normal((1, 1, model.args.hidden_size), key=mx.random.key(1)).astype(model.model.norm.weight.dtype)
    fn = (lambda: vocab.lm_logits(model, h)) if vocab is not None else (lambda: model.lm_logits(h))
    mx.eval(fn())
    tic = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return 1e3 * (time.perf_counter() - tic) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8192,4096,2048,1024,512")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--corpus-mb", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model, tok = load()
    vocab = model.args.vocab_size
    counts, used = corpus_counts(tok, vocab, int(args.corpus_mb * 2**20))
    order = np.lexsort((np.arange(vocab), -counts))
    prompts = [p["prompt"] for p in json.loads(HELDOUT.read_text())["prompts"]][: args.prompts]
    spec = SpecOptions(draft_tokens=args.k, adaptive=False)
    rows = []
    for size in map(int, args.sizes.split(",")):
        ids = sorted(set(order[:size].tolist()) | set(tok.eos_token_ids)) if size < vocab else None
        model.mtp.draft_vocab = DraftVocab(ids) if ids is not None else None
        inside = set(ids) if ids is not None else None
        proposed, accepted_at, rounds, generated, in_subset = 0, np.zeros(args.k), 0, 0, 0
        for p in prompts:
            s = (r := generate(model, tok, p, max_tokens=args.tokens, speculation=spec)).speculation
            proposed += sum(s["proposed_at"])
            accepted_at[: len(s["accepted_at"])] += s["accepted_at"]
            rounds += s["rounds"]
            generated += len(r.tokens)
            in_subset += len(r.tokens) if inside is None else sum(t in inside for t in r.tokens)
        row = {"size": size if ids is not None else vocab, "full": ids is None,
               "corpus_coverage": float(counts[order[:size]].sum() / counts.sum()),
               "generated_in_subset": in_subset / generated,
               "acceptance_per_position": (accepted_at / max(rounds, 1)).round(4).tolist(),
               "acceptance_rate": float(accepted_at.sum() / max(proposed, 1)),
               "mean_accepted": float(accepted_at.sum() / max(rounds, 1)),
               "lm_head_ms_cpu": lm_head_ms(model, model.mtp.draft_vocab)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    model.mtp.draft_vocab = None
    from lattice_mlx.bench.synthetic import QWEN3_5_0_8B, random_model

    big = random_model(**{**QWEN3_5_0_8B, "num_hidden_layers": 1}, mtp=False, bits=4)
    shape_08b = {"rows_full": big.args.vocab_size, "ms_full_cpu": lm_head_ms(big, None),
                 "rows_subset": 32768, "ms_subset_cpu": lm_head_ms(big, DraftVocab(range(32768)))}
    print(json.dumps(shape_08b), flush=True)
    out = {"script": "scripts/demo/eval_draft_vocab.py", "argv": sys.argv[1:], **provenance(),
           "device": str(mx.default_device()), "model": "embedded demo (fp32)", "k": args.k,
           "tokens": args.tokens, "prompts": len(prompts), "corpus": f"CPython stdlib, training side, {used} chars",
           "rows": rows, "lm_head_0.8b_shape": shape_08b}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "draft_vocab.json").write_text(json.dumps(out, indent=1))
        lines = ["| draft vocab | corpus coverage | generated tokens in it | acceptance per position | mean accepted "
                 "/ round | draft lm_head ms (CPU) |", "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['size']}{' (full)' if r['full'] else ''} | {r['corpus_coverage']:.4f} | "
                         f"{r['generated_in_subset']:.4f} | {' '.join(f'{a:.2f}' for a in r['acceptance_per_position'])}"
                         f" | {r['mean_accepted']:.2f} | {r['lm_head_ms_cpu']:.3f} |")
        lines.append(f"\nQwen3.5-0.8B lm_head shape, Q4, CPU: {shape_08b['rows_full']} rows "
                     f"{shape_08b['ms_full_cpu']:.2f} ms, {shape_08b['rows_subset']} rows "
                     f"{shape_08b['ms_subset_cpu']:.2f} ms per call")
        (Path(args.out) / "draft_vocab.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
