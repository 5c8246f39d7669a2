"""Peer benchmark: mlx-vlm 0.7.10 decoding Qwen3.5 greedily, plain and with its own native-MTP drafter, on the same
random hub-layout checkpoint (`mtp.*` included) that lattice_mlx.bench.synthetic writes.

Measures, interleaved in one process (ABBA leg order, one warm-up run per leg first): decode tokens/s of mlx-vlm's
plain greedy `generate_step` and of its MTP greedy `generate_step(draft_model=..., draft_kind="mtp",
draft_block_size=K+1)` at each K, as the slope between two generation lengths (prefill cancels, as in lattice's
bench); mlx-vlm's own acceptance counters; and whether MTP's tokens equal plain's (mismatches recorded, not fatal).
The target is cast and quantized as `mlx_vlm.convert --dtype D -q --q-bits B --q-group-size G` would (in memory);
the drafter is the checkpoint's `mtp.*` split in memory by `load_drafter(path, kind="mtp")`, cast to D, unquantized.
Random weights: acceptance is near zero, so the MTP legs measure mlx-vlm's per-round cost, not a real speedup.

mlx-vlm is installed without its dependencies (`pip install --no-deps --target DIR mlx_vlm-0.7.10-*.whl`); modules
it imports at load time but never calls on this text-only path are replaced by stubs (only those in STUBBABLE),
and the JSON names each. Any failure writes {"ran": false, "reason": "<one line>"} and exits 0.

Usage:
  PYTHONPATH=/tmp/vlmsite:src python scripts/bench/peer_mlx_vlm.py --shape 0.8b --dir /tmp/peer_ckpt --k 2,3 --reps 10 \
      --out bench_out/peer_mlx_vlm.json
"""

import argparse
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import platform
import re
import shutil
import sys
import time
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

from lattice_mlx.bench import stats as bs
from lattice_mlx.bench.run import DEFAULT_LENGTHS, DEFAULT_PROMPT_TOKENS, SHAPES, timed_run
from lattice_mlx.bench.synthetic import hub_config, random_checkpoint
from lattice_mlx.decode import generate_step as lattice_generate_step
from lattice_mlx.load import load_model as lattice_load_model
from lattice_mlx.load import quantize as lattice_quantize
from lattice_mlx.models.fuse import fuse_projections
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import SpecOptions, SpecStats, speculate

NOTE = "acceptance on random weights; not comparable to oracle legs"
MISMATCH_NOTE = ("random weights give near-uniform logits: in bfloat16 the (K+1)-token verify and the one-token step "
                 "can round to a different argmax; rerun with --dtype float32 to tell numerics from a bug")
# Top-level modules mlx-vlm imports at load time that the text-only, token-id decode path never calls: image/audio/
# video I/O, the server, hub downloads, grammar constraints, and processors/tokenizers (we pass token ids). tqdm only
# draws the chunked-prefill progress bar (disabled unless verbose).
STUBBABLE = ("PIL", "cv2", "datasets", "miniaudio", "mlx_audio", "soundfile", "sounddevice", "fastapi", "uvicorn",
             "starlette", "multipart", "websockets", "cryptography", "llguidance", "requests", "huggingface_hub",
             "tqdm", "transformers")
TRANSFORMERS_MIN = (5, 14)  # mlx-vlm 0.7.10's METADATA: Requires-Dist transformers>=5.14.0


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub


class _Stub(metaclass=_StubMeta):
    """Whatever a stubbed module hands out: a class to subclass, call, decorate with or enter; it does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __iter__(self):
        return iter(())


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a _StubModule for each stubbed top-level name and everything under it."""

    def __init__(self):
        self.roots: dict[str, str] = {}  # name -> why it was stubbed

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass

    def stub(self, root: str, why: str) -> None:
        self.roots[root] = why
        for name in [n for n in sys.modules if n.split(".")[0] in (root, "mlx_vlm")]:
            del sys.modules[name]  # the real (or half-imported) module, and mlx-vlm's modules that bound it


def import_mlx_vlm(finder: _StubFinder) -> types.SimpleNamespace:
    """The mlx-vlm functions this benchmark calls, stubbing STUBBABLE modules as their imports fail."""
    try:
        have = importlib.metadata.version("transformers")
        if tuple(int(x) for x in re.findall(r"\d+", have)[:2]) < TRANSFORMERS_MIN:
            finder.stub("transformers", f"installed {have} < required {'.'.join(map(str, TRANSFORMERS_MIN))}")
    except importlib.metadata.PackageNotFoundError:
        pass  # absent: stubbed below when mlx-vlm's import of it fails
    while True:
        try:
            from mlx_vlm.generate.ar import generate_step
            from mlx_vlm.quant_utils import quantize_model
            from mlx_vlm.speculative.drafters import load_drafter
            from mlx_vlm.speculative.utils import format_speculative_stats
            from mlx_vlm.utils import load_config, load_model, skip_multimodal_module
            from mlx_vlm.version import __version__
        except ImportError as e:
            root = (e.name or "").split(".")[0]
            if root not in STUBBABLE or root in finder.roots:
                raise
            finder.stub(root, f"{type(e).__name__}: {e}")
            continue
        return types.SimpleNamespace(generate_step=generate_step, quantize_model=quantize_model,
                                     load_drafter=load_drafter, format_speculative_stats=format_speculative_stats,
                                     load_config=load_config, load_model=load_model,
                                     skip_multimodal_module=skip_multimodal_module, __version__=__version__)


def build_checkpoint(root: Path, shape: str, seed: int) -> tuple[Path, bool]:
    """The random hub-layout checkpoint (written once; reused if its config.json matches)."""
    path = root / f"qwen3_5-{shape}-seed{seed}"
    config = hub_config(**SHAPES[shape])
    if (path / "model.safetensors").exists() and (path / "config.json").exists():
        if json.loads((path / "config.json").read_text()) != config:
            raise ValueError(f"{path}/config.json differs from hub_config(**SHAPES[{shape!r}]); remove the folder")
        return path, False
    partial = path.with_name(path.name + ".partial")  # renamed when complete: a killed write is never reused
    shutil.rmtree(partial, ignore_errors=True)
    random_checkpoint(partial, seed=seed, mtp=True, **SHAPES[shape])
    partial.rename(path)
    return path, True


def load_peer(vlm, path: Path, dtype: str, bits: int, group_size: int):
    """Target as mlx_vlm.convert casts and quantizes it (convert.py's set_dtype + quant_utils.quantize_model with
    convert's base predicate), and the MTP drafter split in memory from the same checkpoint by load_drafter."""
    model = vlm.load_model(path, lazy=True)
    config = vlm.load_config(path)
    cast, want = getattr(model, "cast_predicate", lambda _: True), getattr(mx, dtype)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(want) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))
    quantization = None
    if bits:
        own = getattr(model, "quant_predicate", None)

        def predicate(p, m):
            return not vlm.skip_multimodal_module(p) and (own(p, m) if own is not None else True)

        model, config = vlm.quantize_model(model, config, group_size, bits, mode="affine", quant_predicate=predicate)
        quantization = config["quantization"]
    mx.eval(model.parameters())
    draft, kind = vlm.load_drafter(str(path), kind="mtp")
    draft.set_dtype(want)
    mx.eval(draft.parameters())
    return model, draft, kind, quantization


def load_lattice(path: Path, dtype: str, bits: int, group_size: int):
    """This project's model on the same checkpoint, quantized as its bench's random models are (target Q4, the MTP
    head unquantized), then fused."""
    model, _ = lattice_load_model(path, dtype=dtype, fuse=False)
    if bits:
        lattice_quantize(model, bits=bits, group_size=group_size, quantize_mtp=False)
    fuse_projections(model)
    mx.eval(model.parameters())
    return model


def nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def bench(vlm, model, draft, kind, ours, args, save, mark) -> dict:
    """Runs the legs; `mark(stage)` after each warm-up and `save(legs)` after every repetition (a run cut short
    keeps how far it got and its finished repetitions)."""
    n1, n2 = args.tokens
    vocab = model.language_model.args.vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = [mx.array(rng.integers(1, vocab, (1, args.prompt_tokens)), dtype=mx.int32) for _ in range(args.prompts)]
    legs = [("plain", None)] + [(f"mtp_k{k}", k) for k in args.k]
    if ours is not None:  # this project's legs on the same weights: plain and its pipelined MTP rounds
        legs += [("lattice_plain", None)] + [(f"lattice_mtp_k{k}", k) for k in args.k]
    runs = {name: [] for name, _ in legs}

    def run_ours(k, prompt) -> dict:
        ids = prompt[0]
        if k is None:
            steps = lattice_generate_step(ours, ids, sampler=Sampler(temp=0.0))
        else:
            # a fixed K, as mlx-vlm's leg (adaptive, the default, ran K=2 throughout at acceptance 0 in run 22)
            options = SpecOptions(draft_tokens=k, verify="pipelined", adaptive=False)
            stats = SpecStats.of(options)
            steps = speculate(ours, ids, sampler=Sampler(temp=0.0), options=options, stats=stats)
        r = timed_run((int(t) for t in steps), (n1, n2))
        if k is not None:
            r.update(rounds=stats.rounds, accepted=int(sum(stats.accepted_at)), drafted=int(sum(stats.proposed_at)))
        return r

    def run(name, k, prompt) -> dict:
        if name.startswith("lattice"):
            return run_ours(k, prompt)
        extra = {} if k is None else dict(draft_model=draft, draft_kind=kind, draft_block_size=k + 1)
        steps = vlm.generate_step(prompt, model, None, None, max_tokens=n2, temperature=0.0, **extra)
        r = timed_run((int(t) for t, _ in steps), (n1, n2))
        if k is not None:  # mlx-vlm's own counters, reset by each MTP generation (speculative/mtp.py _mtp_rounds)
            r.update(rounds=len(draft.accept_lens), accepted=int(sum(draft.accept_lens)),
                     drafted=int(sum(draft.draft_lens)), mlx_vlm_stats=vlm.format_speculative_stats(draft))
        return r

    for name, k in legs:
        print(f"warm-up {name}", file=sys.stderr, flush=True)
        run(name, k, prompts[0])
        mark(f"warmed up {name}")
    for rep in range(args.reps):
        prompt = prompts[rep % len(prompts)]
        for name, k in bs.abba_order(legs, rep):
            runs[name].append(r := run(name, k, prompt))
            print(f"rep {rep + 1}/{args.reps} {name:<8} {r['tok_s']:9.1f} tok/s", file=sys.stderr, flush=True)
        save(summarize(legs, runs))
    return summarize(legs, runs)


def summarize(legs: list, runs: dict) -> dict:
    plain = runs["plain"]
    out = {}
    for name, k in legs:
        rs = runs[name]
        leg = {"tok_s": bs.summarize([r["tok_s"] for r in rs]), "ttft_s": bs.summarize([r["ttft_s"] for r in rs])}
        if name.startswith("lattice"):
            leg["vs_mlx_vlm"] = bs.paired_ratio([r["tok_s"] for r in rs],
                                                [p["tok_s"] for p in runs[name.replace("lattice_", "")]])
            leg["runs_unlike_mlx_vlm_plain"] = sum(r["_tokens"] != p["_tokens"] for r, p in zip(rs, plain))
            if k is not None:
                rounds, accepted, drafted = (sum(r[f] for r in rs) for f in ("rounds", "accepted", "drafted"))
                leg.update(vs_lattice_plain=bs.paired_ratio([r["tok_s"] for r in rs],
                                                            [p["tok_s"] for p in runs["lattice_plain"]]),
                           runs_unlike_lattice_plain=sum(r["_tokens"] != p["_tokens"]
                                                         for r, p in zip(rs, runs["lattice_plain"])),
                           acceptance={"rate": accepted / drafted if drafted else None, "rounds": rounds,
                                       "note": NOTE})
        elif k is not None:
            rounds, accepted, drafted = (sum(r[f] for r in rs) for f in ("rounds", "accepted", "drafted"))
            first_diff = [next((i for i, (a, b) in enumerate(zip(r["_tokens"], p["_tokens"])) if a != b), None)
                          for r, p in zip(rs, plain)]
            leg.update(
                draft_block_size=k + 1,
                vs_plain=bs.paired_ratio([r["tok_s"] for r in rs], [p["tok_s"] for p in plain]),
                acceptance={"rate": accepted / drafted if drafted else None, "accepted": accepted, "drafted": drafted,
                            "rounds": rounds, "tokens_per_round": (accepted + rounds) / rounds if rounds else None,
                            "mlx_vlm_last_run": rs[-1]["mlx_vlm_stats"], "note": NOTE},
                greedy_vs_plain={"runs": len(rs), "mismatched_runs": sum(d is not None for d in first_diff),
                                 "first_mismatch_index": first_diff, "note": MISMATCH_NOTE})
        leg["runs"] = [{k2: v for k2, v in r.items() if k2 not in ("_tokens", "mlx_vlm_stats")} for r in rs]
        out[name] = leg
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="0.8b", choices=sorted(SHAPES), help="lattice_mlx.bench.SHAPES name")
    p.add_argument("--dir", type=Path, default=Path("/tmp/peer_mlx_vlm"), help="work folder for the checkpoint")
    p.add_argument("--seed", type=int, default=0, help="checkpoint weights and prompt token ids")
    p.add_argument("--k", default="2,3", help="draft depths K (mlx-vlm draft_block_size = K+1)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tokens", default=DEFAULT_LENGTHS, help="N1,N2: tok/s is the slope between these lengths")
    p.add_argument("--prompts", type=int, default=5, help="random prompts, used in turn by the repetitions")
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--bits", type=int, default=4, help="0: no quantization")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--lattice", action="store_true", help="also time this project's plain and MTP legs on the "
                   "same checkpoint, interleaved with mlx-vlm's")
    p.add_argument("--out", type=Path, default=Path("bench_out/peer_mlx_vlm.json"))
    args = p.parse_args(argv)
    args.k = [int(x) for x in args.k.split(",")]
    args.tokens = tuple(int(x) for x in args.tokens.split(","))
    if len(args.tokens) != 2 or not 1 < args.tokens[0] < args.tokens[1]:
        p.error("--tokens takes N1,N2 with 1 < N1 < N2")
    if min(args.k) < 1 or args.reps < 1 or args.prompts < 1:
        p.error("--k, --reps and --prompts must be positive")
    return args


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(out)  # whole or absent: a kill mid-write leaves the previous save


def main(argv=None) -> None:
    args = parse_args(argv)
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    result = {"ran": False, "what": "mlx-vlm 0.7.10 plain vs native-MTP greedy decode, random Qwen3.5 weights",
              "note": NOTE, "stubbed": finder.roots,
              "env": {"python": platform.python_version(), "platform": platform.platform(), "mlx": mx.__version__,
                      "mlx_path": str(Path(mx.__file__).parent), "device": str(mx.default_device())},
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    tic = time.perf_counter()

    def mark(done: str) -> None:  # seconds since start at the end of each stage, saved at once
        result.setdefault("progress_s", {})[done] = round(time.perf_counter() - tic, 1)
        write(args.out, result)

    stage = "checkpoint"
    try:
        path, written = build_checkpoint(args.dir, args.shape, args.seed)
        result["checkpoint"] = {
            "path": str(path), "shape": args.shape, "seed": args.seed, "written_now": written,
            "source": "lattice_mlx.bench.synthetic.random_checkpoint (hub layout, fp32, mtp.* included)",
            "config_changes": "none: mlx-vlm loads the hub config.json as is (model_type qwen3_5, a VLM whose "
                              "vision_tower it drops for want of weights)"}
        mark("checkpoint")
        stage = "import mlx_vlm"
        vlm = import_mlx_vlm(finder)
        result["env"].update(mlx_vlm=vlm.__version__, mlx_vlm_path=str(Path(sys.modules["mlx_vlm"].__file__).parent),
                             transformers="stubbed" if "transformers" in finder.roots else
                             importlib.metadata.version("transformers"))
        mark("import mlx_vlm")
        stage = "load"
        model, draft, kind, quantization = load_peer(vlm, path, args.dtype, args.bits, args.group_size)
        result["target"] = {
            "class": f"{type(model).__module__}.{type(model).__name__}", "dtype": args.dtype,
            "quantization": quantization, "bytes": nbytes(model),
            "how": "mlx_vlm.utils.load_model(path); cast as convert.py (cast_predicate: A_log stays fp32); "
                   "mlx_vlm.quant_utils.quantize_model with convert.py's base predicate (in memory)"}
        result["drafter"] = {
            "class": f"{type(draft).__module__}.{type(draft).__name__}", "draft_kind": kind, "dtype": args.dtype,
            "configured_block_size": draft.config.block_size, "bytes": nbytes(draft), "quantized": False,
            "how": "mlx_vlm.speculative.drafters.load_drafter(path, kind='mtp'): Qwen3_5MTPSplitter splits mtp.* "
                   "in memory; embeddings and LM head are the target's (bind)"}
        mark("load mlx-vlm")
        ours = None
        if args.lattice:
            stage = "load lattice_mlx"
            ours = load_lattice(path, args.dtype, args.bits, args.group_size)
            result["lattice"] = {"bytes": nbytes(ours), "how": "lattice_mlx.load.load_model(fuse=False), quantize "
                                 "(target only, as the bench's random models), fuse_projections; greedy; MTP legs "
                                 "are its pipelined rounds at the head's own (near-zero) acceptance"}
            mark("load lattice_mlx")
        stage = "benchmark"

        def save(legs):
            result["legs"] = legs
            write(args.out, result)

        result["legs"] = bench(vlm, model, draft, kind, ours, args, save, mark)
        result["peak_memory_bytes"] = mx.get_peak_memory()
        result["ran"] = True
    except Exception as e:  # the reason is the result
        result["reason"] = f"{stage}: {type(e).__name__}: {e}".splitlines()[0][:500]
    write(args.out, result)
    print(f"{'ran' if result['ran'] else 'did not run: ' + result['reason']}; wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
