"""Retrain the demo model's MTP head on its own (trunk frozen) in MLX: by the corpus labels (t+2) or by
self-distillation (KL from the trunk's own distribution over t+2), then measure what a user gets: greedy MTP
acceptance per position through the real decode loop on held-out prompts.

    python scripts/demo/distill_demo_head.py --target distill --seconds 600 --out .demo-build/head_distill
    python scripts/demo/distill_demo_head.py --eval-only --out .demo-build/head_shipped
    python scripts/demo/distill_demo_head.py --install-from RUN/head.safetensors --out .demo-build/head_installed
    python scripts/demo/distill_demo_head.py --eval-only --head-q4 --out .demo-build/head_q4   # bf16 head vs its 4-bit twin
    python scripts/demo/distill_demo_head.py --eval-only --loss --heldout-text CORPUS/heldout.txt --out DIR  # + held-out loss
    python scripts/demo/distill_demo_head.py --model RUN/mlx --corpus CORPUS --target distill --out DIR  # another trunk

The trunk is the shipped 4-bit one (or --model's), so the head learns the distribution it drafts against at run time.
Training text: the CPython standard library's training split (the demo's own held-out rule, scripts/demo/train_demo.py),
or with --corpus the training split of scripts/demo/build_corpus.py's package-split corpus; held-out
evaluation: the demo's stdlib prompts (assets/prompts/demo_heldout.json) and the held-out-package prompts
(assets/prompts/demo_heldout_packages.json). Writes head.safetensors (the head's tensors under the checkpoint's
names, bf16) and result.json. `--install` writes the head into the embedded demo checkpoint.
"""

import argparse
import contextlib
import gzip
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

from lattice_mlx import load
from lattice_mlx.bench.run import quantized_head
from lattice_mlx.load import DEMO_MODEL, demo_model, resolve_path
from lattice_mlx.models.fuse import hf_parameters
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import SpecOptions, SpecStats, speculate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling build_corpus.py
from build_corpus import legacy_heldout, read_documents, sample_documents  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[2] / "src" / "lattice_mlx" / "assets" / "prompts"
MAX_FILE_BYTES = 400_000  # scripts/demo/train_demo.py's standard library files

# The first demo model's 14 held-out files on the H200 (train_demo.py's path rule over Ubuntu's Python 3.12 Lib/,
# which ships no test/ package); scripts/demo/build_corpus.py keeps them out of the next corpus's training split.
LEGACY_HELDOUT = ("ast.py", "encodings/cp1254.py", "encodings/cp437.py", "encodings/cp932.py", "encodings/cp949.py",
                  "encodings/iso8859_16.py", "encodings/mac_cyrillic.py", "encodings/mac_roman.py", "importlib/abc.py",
                  "locale.py", "unittest/__init__.py", "unittest/loader.py", "venv/__init__.py", "xml/sax/__init__.py")


def training_tokens(tok, limit: int, corpus: Path | None = None) -> list[int]:
    """The training split, tokenized file by file (EOS between files), up to `limit` tokens: the standard library's
    (train_demo.py's path rule), or the package-split corpus's train.txt."""
    if corpus is not None:
        out: list[int] = []
        docs = read_documents(corpus / "train.txt")
        random.Random(0).shuffle(docs)
        for text in docs:
            out += tok.encode(text) + [tok.eos_token_id]
            if len(out) >= limit:
                break
        return out
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and "__pycache__" not in p.parts and p.stat().st_size <= MAX_FILE_BYTES)
    random.Random(0).shuffle(rels)
    out: list[int] = []
    for rel in rels:
        if legacy_heldout(rel):
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out += tok.encode(text) + [tok.eos_token_id]
        if len(out) >= limit:
            break
    return out


def trunk(model, window: mx.array) -> tuple[mx.array, mx.array]:
    """The frozen trunk over window[:, :-1] (kernels allowed: nothing is differentiated through it)."""
    logits, hidden = model(window[:, :-1], return_hidden=True)
    return mx.stop_gradient(logits), mx.stop_gradient(hidden)


class DepthKeys:
    """The head's attention keys as the draft loop's cache holds them at draft depth d (a KVCache stand-in for one
    layer): depth 1's keys of every slot (the committed positions), then each deeper depth's. Keys of depth d sit
    at RoPE positions j + d - 1 (`offset`); `mask(d)` lets slot j at depth d see depth 1's slots 0..j and its own
    slot at depths 2..d, which is what the cache holds when the loop drafts its d-th token after position j."""

    def __init__(self):
        self.keys, self.values, self.offset = [], [], 0

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        self.keys.append(k)
        self.values.append(v)
        return mx.concatenate(self.keys, axis=2), mx.concatenate(self.values, axis=2)

    @staticmethod
    def mask(d: int, n: int, n1: int) -> mx.array:
        """[n, n1 + sum of the deeper depths' slot counts] for the n slots of depth d."""
        j = mx.arange(n)[:, None]
        parts = [mx.arange(n1)[None, :] <= j]
        for k in range(2, d + 1):
            parts.append(mx.arange(n1 - k + 1)[None, :] == j)
        return mx.concatenate(parts, axis=1)


def head_loss(model, window: mx.array, logits: mx.array, hidden: mx.array, target: str,
              weights: tuple[float, ...] = (1.0,)) -> mx.array:
    """window [B, T+1+D] for D = len(weights) draft depths, `logits`/`hidden` the trunk's over window[:, :-1].
    Depth d (1-based) runs the head as the draft loop does at its d-th step: slot j pairs embed(window[j+d]) with
    the hidden the step before produced (the trunk's hidden j at d = 1, else the head's own output of slot j at
    depth d-1), attends to what the loop's cache would hold then (`DepthKeys`), and predicts window[j+d+1].
    labels: cross-entropy to it; distill: KL from the trunk's own distribution over that token (its logits at j+d).
    The depths' losses are summed with `weights`. Depths > 1 are the recursion the draft loop runs for drafts 2..K,
    which one-step training never shows the head."""
    head = model.mtp
    h = head.from_target(hidden)
    n1 = hidden.shape[1] - 1
    keys = [DepthKeys() for _ in head.layers]
    total = mx.array(0.0)
    for d, w in enumerate(weights, start=1):
        n = hidden.shape[1] - d
        for c in keys:
            c.offset = d - 1
        x = head(model.model.embed_tokens(window[:, d : d + n]), h[:, :n], keys, DepthKeys.mask(d, n, n1))
        post = head.norm(x)
        out = model.lm_logits(head.to_target(post)).astype(mx.float32)  # [B, n, V]
        logp = out - mx.logsumexp(out, axis=-1, keepdims=True)
        if target == "labels":
            loss = -mx.take_along_axis(logp, window[:, d + 1 : d + 1 + n, None], axis=-1).mean()
        else:
            teacher = logits[:, d : d + n].astype(mx.float32)
            teacher = teacher - mx.logsumexp(teacher, axis=-1, keepdims=True)
            loss = (mx.exp(teacher) * (teacher - logp)).sum(-1).mean()
        total = total + w * loss
        h = post if head.input_hidden == "post" else x
    return total


@contextlib.contextmanager
def reference_ops():
    """The head's forward in plain ops while it is differentiated: MLX's custom kernels have no vjp (on a GPU the
    dispatchers would pick them)."""
    before = os.environ.get("LATTICE_KERNELS")
    os.environ["LATTICE_KERNELS"] = "ref"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LATTICE_KERNELS"]
        else:
            os.environ["LATTICE_KERNELS"] = before


def repeated_ngrams(ids: list[int], n: int = 4) -> float:
    """Share of the n-grams of `ids` seen before in it: ~0 for ordinary code, near 1 for a greedy loop."""
    seen, repeated = set(), 0
    for i in range(n, len(ids) + 1):
        gram = tuple(ids[i - n : i])
        repeated += gram in seen
        seen.add(gram)
    return repeated / max(1, len(ids) - n + 1)


def acceptance(model, tok, prompts: list[str], k: int, tokens: int, temp: float = 0.0) -> dict:
    """MTP through the real loop (fixed K), greedy or sampled at `temp` (seeded): per-position acceptance pooled
    over the prompts; and, since a draft head predicts a loop perfectly, how much of each continuation repeats itself
    (share of repeated 4-grams) and the acceptance pooled over the prompts whose continuation does not loop (at most
    half of its 4-grams repeated)."""
    total = ordinary = None
    repeats = []
    mx.random.seed(0)
    for text in prompts:
        options = SpecOptions(draft_tokens=k, adaptive=False)
        stats = SpecStats.of(options)
        gen = speculate(model, mx.array(tok.encode(text)), sampler=Sampler(temp=temp), options=options,
                               stats=stats)
        ids = [int(t) for _, t in zip(range(tokens), gen)]
        gen.close()
        repeats.append(repeated_ngrams(ids))
        total = stats if total is None else total + stats
        if repeats[-1] <= 0.5:
            ordinary = stats if ordinary is None else ordinary + stats
    return {"rounds": total.rounds, "per_position": [round(a, 4) for a in total.accepted_per_position()],
            "repeated_4grams_mean": round(sum(repeats) / len(repeats), 4),
            "looping_prompts": sum(r > 0.5 for r in repeats), "prompts": len(prompts),
            "per_position_not_looping": [round(a, 4) for a in ordinary.accepted_per_position()] if ordinary else None}


def heldout_loss(model, tok, texts: list[str], window: int = 512) -> dict:
    """The trunk's teacher-forced loss over `texts` (each followed by EOS, concatenated, non-overlapping windows of
    `window` + 1 tokens, as train_demo.py evaluates): nats per token and per byte of text. Per byte compares models
    with different tokenizers."""
    ids = []
    for t in texts:
        ids += tok.encode(t) + [tok.eos_token_id]
    n_bytes = sum(len(t.encode()) for t in texts)
    span = window + 1
    nll, n = 0.0, 0
    for s in range(0, len(ids) - span + 1, span):
        w = mx.array(ids[s : s + span])[None]
        logits = model(w[:, :-1]).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll += -mx.take_along_axis(logp, w[:, 1:, None], axis=-1).sum().item()
        n += window
    per_token = nll / n
    return {"tokens": n, "bytes_per_token": n_bytes / len(ids), "loss": round(per_token, 4),
            "ppl": round(math.exp(per_token), 2), "nats_per_byte": round(per_token * len(ids) / n_bytes, 4)}


def evaluate_loss(model, tok, args) -> dict:
    """Held-out loss on the first demo's 14 held-out standard-library files (this interpreter's text) and on a
    seeded sample of held-out packages' documents (--heldout-text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sets = {"legacy_heldout_stdlib": [(root / r).read_text(encoding="utf-8") for r in LEGACY_HELDOUT
                                      if (root / r).is_file()]}
    if args.heldout_text:
        sets["heldout_packages_sample"] = sample_documents(read_documents(Path(args.heldout_text)), 400_000, seed=1)
    out = {}
    for name, texts in sets.items():
        out[name] = {"files": len(texts), **heldout_loss(model, tok, texts)}
        print(name, out[name], flush=True)
    return out


def evaluate(model, tok, args) -> dict:
    sets = {"stdlib_heldout": "demo_heldout.json", "heldout_packages": "demo_heldout_packages.json"}
    out = {}
    for name, fname in sets.items():
        prompts = [p["prompt"] for p in json.loads((PROMPTS / fname).read_text())["prompts"]][: args.eval_prompts]
        tic = time.perf_counter()
        out[name] = acceptance(model, tok, prompts, args.k, args.eval_tokens, args.temp)
        out[name]["seconds"] = round(time.perf_counter() - tic, 1)
        print(name, out[name], flush=True)
    return out


def train(model, tok, args) -> dict:
    data = mx.array(training_tokens(tok, args.max_tokens, Path(args.corpus) if args.corpus else None))
    model.freeze()
    model.mtp.unfreeze()
    opt = optim.AdamW(learning_rate=args.lr, weight_decay=0.0)
    weights = tuple(float(w) for w in args.depth_weights.split(","))
    loss_and_grad = nn.value_and_grad(model, lambda w, lg, h: head_loss(model, w, lg, h, args.target, weights))
    rng = random.Random(args.seed)
    span = args.seq_len + 1 + len(weights)

    def batch() -> mx.array:
        starts = [rng.randrange(0, data.size - span) for _ in range(args.batch)]
        return mx.stack([data[s : s + span] for s in starts])

    # one untimed pass first: a first call's compiling (run 9's labels run spent ~60 s in its first step on the
    # H200, its distill run 3 s) must not eat one target's budget and shift its learning-rate schedule
    window = batch()
    with reference_ops():
        mx.eval(loss_and_grad(window, *trunk(model, window)))
    t0, step, curve = time.time(), 0, []
    while time.time() - t0 < args.seconds:
        progress = (time.time() - t0) / args.seconds
        opt.learning_rate = args.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        window = batch()
        logits, hidden = trunk(model, window)
        with reference_ops():
            loss, grads = loss_and_grad(window, logits, hidden)
        opt.update(model, grads)
        mx.eval(model.mtp.parameters(), opt.state, loss)
        step += 1
        if step % 20 == 1:
            curve.append({"step": step, "elapsed_s": round(time.time() - t0, 1), "loss": round(loss.item(), 4)})
            print(json.dumps(curve[-1]), flush=True)
    return {"steps": step, "tokens_seen": step * args.batch * args.seq_len, "seconds": round(time.time() - t0, 1),
            "training_tokens": int(data.size), "loss_curve": curve}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=["labels", "distill"], default="distill")
    p.add_argument("--out", required=True)
    p.add_argument("--eval-only", action="store_true", help="measure the shipped head")
    p.add_argument("--model", default=None, help="the trunk and head to start from (default: the embedded demo)")
    p.add_argument("--corpus", default=None,
                   help="scripts/demo/build_corpus.py's output folder: train on its train.txt (default: the standard library)")
    p.add_argument("--loss", action="store_true", help="also measure the trunk's held-out loss (nats per token and byte)")
    p.add_argument("--heldout-text", default=None, help="with --loss: a held-out split file of build_corpus.py")
    p.add_argument("--install", action="store_true", help="write the trained head into the embedded demo checkpoint")
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-tokens", type=int, default=4_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--depth-weights", default="1",
                   help="loss weight per draft depth, e.g. 1,0.7,0.5: train drafts 2..K through the head's own "
                   "recursion too (default 1: the first draft only)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--eval-prompts", type=int, default=32, help="prompts per held-out set (0: no acceptance)")
    p.add_argument("--eval-tokens", type=int, default=48)
    p.add_argument("--temp", type=float, default=0.0, help="measure acceptance sampling at this temperature")
    p.add_argument("--install-from", default=None, metavar="HEAD",
                   help="write a head.safetensors of an earlier run into the embedded demo checkpoint, then measure")
    p.add_argument("--head-q4", action="store_true",
                   help="also measure the head quantized to 4 bits (g64, the rule of convert -q --quantize-mtp)")
    args = p.parse_args()
    try:
        weights = [float(w) for w in args.depth_weights.split(",")]
    except ValueError:
        weights = []
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or not any(weights):
        p.error(f"--depth-weights: comma-separated weights >= 0, not all 0, got {args.depth_weights!r}")
    if not math.isfinite(args.temp) or args.temp < 0:
        p.error(f"--temp must be a finite number >= 0, got {args.temp}")
    if args.install_from:
        install(mx.load(args.install_from), args.model)
        args.eval_only = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load(args.model, dtype="float32")
    result = {"args": vars(args)}
    if args.loss:
        result["heldout_loss"] = evaluate_loss(model, tok, args)
    if not args.eval_only:
        result["train"] = train(model, tok, args)
        model.eval()
        head = {k: v.astype(mx.bfloat16) for k, v in hf_parameters(model).items() if k.startswith("mtp.")}
        mx.save_safetensors(str(out / "head.safetensors"), head)
    # the embedded checkpoint holds the head in bf16: every head is measured rounded to it, as it ships
    model.mtp.update(tree_map(lambda a: a.astype(mx.bfloat16).astype(mx.float32), model.mtp.parameters()))
    if args.eval_prompts:
        result["acceptance"] = evaluate(model, tok, args)
    if args.head_q4 and args.eval_prompts:  # the 4-bit twin: fewer launches and bytes per draft step (run 8: 1.27x vs 1.17x on the H200)
        bf16_head = model.mtp
        model.mtp = quantized_head(model, group_size=64)
        result["acceptance_head_q4_g64"] = evaluate(model, tok, args)
        model.mtp = bf16_head
    (out / "result.json").write_text(json.dumps(result, indent=1))
    if args.install and not args.eval_only:
        install(head, args.model)


def install(head: dict[str, mx.array], model: str | None = None) -> None:
    """Writes the head's tensors into the embedded demo checkpoint (its packaged model.safetensors.gz, whose cache
    folder load.demo_model() then makes afresh: the cache is keyed by the package's files), or into `model`'s
    model.safetensors (the rest of it unchanged), atomically."""
    packed = DEMO_MODEL / "model.safetensors.gz"
    source = resolve_path(model) if model else demo_model()
    weights, metadata = mx.load(str(source / "model.safetensors"), return_metadata=True)
    own = {k: v for k, v in weights.items() if k.startswith("mtp.")}
    wrong = sorted(set(head) ^ set(own)) + [k for k in head if k in own and
                                             (head[k].shape != own[k].shape or head[k].dtype != own[k].dtype)]
    if wrong:
        raise SystemExit(f"the head does not fit the embedded checkpoint (names, shapes or dtypes): {wrong[:4]}")
    weights.update(head)
    if model or not packed.exists():
        path = source / "model.safetensors"
        tmp = path.with_suffix(".tmp.safetensors")
        mx.save_safetensors(str(tmp), weights, metadata=metadata)
        tmp.replace(path)
    else:  # the package's own copy, gzipped deterministically (no name, no time); the cache is left as it is
        path = packed
        with tempfile.TemporaryDirectory() as scratch:
            plain = Path(scratch) / "model.safetensors"
            mx.save_safetensors(str(plain), weights, metadata=metadata)
            tmp = packed.with_suffix(".tmp")
            with open(plain, "rb") as src, open(tmp, "wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            tmp.replace(packed)
    print(f"installed the head into {path}")


if __name__ == "__main__":
    main()
