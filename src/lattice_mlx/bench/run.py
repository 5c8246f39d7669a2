"""Decode benchmarks: mlx-lm stock vs lattice plain vs MTP (sequential / batched verifier, K = 1..4, adaptive), the
synthetic oracle-draft speedup curve, live MTP acceptance, and prefill; `python -m lattice_mlx.bench`.

Every timed run holds a file lock; legs run interleaved ABBA in one process; decode rate is the slope between two
generation lengths. This module runs the legs; report.py writes the JSON, markdown and PNG results to --out;
the terminal gets a table, then one JSON line."""

import copy
import dataclasses
import datetime
import fcntl
import importlib
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5 as mlx_lm_qwen3_5
from mlx_lm.models import qwen3_5_moe as mlx_lm_qwen3_5_moe
from mlx_lm.sample_utils import make_sampler

from .. import decode as decode_mod
from .. import settings
from ..cli import ArgumentParser
from ..decode import generate_step
from ..load import DTYPES, LoadError, demo_model, keep_round_builds, load_model, load_tokenizer, quantize, resolve_path
from ..models import compiled
from ..models.fuse import hf_parameters
from ..models.mtp import DraftVocab
from ..sample import Sampler
from ..speculative import SpecOptions, SpecStats, make_draft_model, speculate
from ..speculative import pipelined as rounds_mod
from . import stats as bs
from .oracles import DeviceOracle, OracleDrafter, OracleDraftModel
from .report import (
    SYNTHETIC,
    device_name,
    group_tables,
    headline,
    make_plots,
    peer_status,
    provenance,
    text_table,
    write_markdown,
)
from .synthetic import QWEN3_5_0_8B, QWEN3_5_4B, QWEN3_5_27B, QWEN3_5_35B_A3B, hub_config, random_model

DEFAULT_MODEL = "0.8b"
DEFAULT_OUT = "bench_out"
DEFAULT_LOCK = settings.raw("bench_lock")
DEFAULT_LOCK_TIMEOUT = 1800.0
DEFAULT_REPS = 5
DEFAULT_LENGTHS = "32,160"
DEFAULT_PREFILL_LENGTHS = "128,512,2048"
DEFAULT_ORACLE_P = "0,0.2,0.4,0.6,0.8,0.9,1.0"
DEFAULT_K = "1,2,3,4"
DEFAULT_PROMPT_TOKENS = 64
SHAPES = {
    "0.8b": QWEN3_5_0_8B,
    "4b": QWEN3_5_4B,
    "27b": QWEN3_5_27B,  # ~15 GB at Q4 (a GPU machine)
    "35b-a3b": QWEN3_5_35B_A3B,  # MoE, 256 experts top-8: ~18 GB at Q4 (a GPU machine)
    "tiny-moe": dict(num_experts=6, num_experts_per_tok=2),
    # Qwen3.5 structure at a size a 2-core CPU decodes at ~30 tok/s (the 0.8B shape runs ~1.5 tok/s there).
    "cpu-small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=8,
                      linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32768, tie_word_embeddings=True),
    "tiny": {},
}
PROSE_PROMPTS = [
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home at night.",
    "In the morning the market filled with voices, the smell of bread, and carts of early apples.",
    "She opened the old letter carefully, unsure whether she wanted to learn what it said.",
    "Rivers shape the land slowly, carving valleys over thousands of years of patient work.",
    "The committee met on Tuesday to discuss the budget, the new library, and the winter roads.",
]
JSON_PROMPTS = [
    '{"name": "widget", "price": 9.99, "tags": ["tools", "home"], "stock": {"warehouse": 12, "store": ',
    '[{"id": 1, "user": "ada", "active": true}, {"id": 2, "user": "linus", "active": false}, {"id": 3, ',
    '{"config": {"debug": false, "retries": 3, "endpoints": ["https://a.example", "https://b.example"]}, ',
    '{"type": "FeatureCollection", "features": [{"type": "Feature", "geometry": {"type": "Point", ',
    '{"model": "qwen3_5", "layers": 24, "hidden": 1024, "heads": {"q": 8, "kv": 2}, "vocab": ',
]
CODE_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_config(path):\n    with open(path) as f:\n",
    "for i, line in enumerate(lines):\n    if line.startswith('#'):\n",
]
HELDOUT_PROMPTS = files("lattice_mlx") / "assets" / "prompts" / "demo_heldout.json"


_T0 = time.perf_counter()


def log(msg: str) -> None:
    """One progress line on stderr, stamped with the seconds since the bench started (a run cut off by a time limit
    still shows where its time went)."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


class LockTimeout(Exception):
    """Another benchmark held the lock for longer than --lock-timeout."""


@contextmanager
def bench_lock(path: str | None, *, timeout: float | None = None, poll: float = 0.05):
    """Exclusive fcntl.flock on `path` for the duration of one timed run; yields the seconds spent waiting. No
    lock when `path` is None (the ranks of a multi-process bench other than rank 0, which waits for all of them)."""
    if path is None:
        yield 0.0
        return
    f = open(path, "a+")
    tic = time.monotonic()
    try:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if timeout is not None and time.monotonic() - tic >= timeout:
                    raise LockTimeout(f"benchmark lock {path} still held by another process after {timeout:g} s: "
                                      "wait for it or pass another --lock") from None
                time.sleep(poll)
        yield time.monotonic() - tic
    finally:
        f.close()  # closing the descriptor releases the lock


@dataclass(frozen=True)
class Leg:
    """One way of decoding. p: oracle per-position acceptance (synthetic drafts); None uses the real MTP head."""

    kind: str  # "stock" | "plain" | "plain-aa" (a second, identical plain leg: the A/A control) | "mtp"
    verify: str = "batched"
    k: int = 0
    adaptive: bool = False
    p: float | None = None
    compiled: bool | None = None  # --compile-ab: the compiled path forced on / off while the leg runs; None: as set
    draft_vocab: int | None = None  # --draft-vocab-ab: the MTP head drafts from ids 0..N-1 only; None: as loaded
    head_q4: bool = False  # --head-q4-ab: the MTP head's linears in 4 bits (as convert --quantize-mtp makes them)
    traced: bool | None = None  # --trace-ab: traced plain steps / pipelined rounds forced on / off; None: as set

    @property
    def name(self) -> str:
        if self.kind != "mtp":
            return self.kind + ("+untraced" if self.traced is False else "") + ("+compile" if self.compiled else "")
        name = f"{self.verify}-{'adaptive' if self.adaptive else f'K{self.k}'}"
        name += f"-oracle{self.p:g}" if self.p is not None else ""
        name += f"+dv{self.draft_vocab}" if self.draft_vocab else ""
        name += "+headq4" if self.head_q4 else ""
        name += "+untraced" if self.traced is False else ""
        return name + ("+compile" if self.compiled else "")


def with_compile_ab(legs: list[Leg], on: bool) -> list[Leg]:
    """With `on`, every lattice leg (plain and MTP) runs uncompiled and is followed by its compiled twin. Traced plain
    steps and traced pipelined rounds (the defaults) run their layers op by op inside the trace whatever the compile
    switch says, so for those legs the twins differ only in what is not traced (a generation's first steps and
    rounds); LATTICE_TRACE_STEPS=0 / LATTICE_TRACE_ROUNDS=0 make the comparison the per-layer compiled path's."""
    if not on:
        return legs
    out = []
    for leg in legs:
        if leg.kind == "stock":
            out.append(leg)
        else:
            out += [dataclasses.replace(leg, compiled=False), dataclasses.replace(leg, compiled=True)]
    return out


def _with_mtp_twins(legs: list[Leg], **change) -> list[Leg]:
    """Every MTP leg followed by its twin with `change` applied, paired in one run."""
    return [twin for leg in legs for twin in ([leg, dataclasses.replace(leg, **change)] if leg.kind == "mtp"
                                              else [leg])]


def with_draft_vocab_ab(legs: list[Leg], n: int | None) -> list[Leg]:
    """With n, every MTP leg is followed by its twin whose head drafts from the first n token ids only (the
    conversion's --draft-vocab without a corpus): the lm_head cost a draft vocabulary saves."""
    return _with_mtp_twins(legs, draft_vocab=n) if n else legs


def with_head_q4_ab(legs: list[Leg], on: bool) -> list[Leg]:
    """With `on`, every MTP leg is followed by its twin whose MTP head runs in 4 bits (the head's fused kernels
    instead of bf16 matmuls and separate norms): what quantizing the head saves per round."""
    return _with_mtp_twins(legs, head_q4=True) if on else legs


def with_trace_ab(legs: list[Leg], on: bool) -> list[Leg]:
    """With `on`, the plain leg and every pipelined leg are followed by their twins whose steps / rounds are built op
    by op in Python every time instead of replaying one trace (LATTICE_TRACE_STEPS=0, LATTICE_TRACE_ROUNDS=0): what
    tracing saves."""
    if not on:
        return legs

    def traced(leg: Leg) -> bool:
        return leg.kind == "plain" or (leg.kind == "mtp" and leg.verify == "pipelined")

    return [twin for leg in legs for twin in ([leg, dataclasses.replace(leg, traced=False)] if traced(leg) else [leg])]


def _tracing_during(on: bool, stream):
    """Runs `stream` with traced plain steps and rounds forced on or off."""
    with rounds_mod.tracing(on), decode_mod.tracing(on):
        yield from stream


def quantized_head(model, *, group_size: int):
    """A 4-bit copy of the model's MTP head (its linears; norms and the shared embedding as they are)."""
    traces = model.mtp.__dict__.pop("_compiled", None)  # compiled traces are not copied (the copy makes its own)
    try:
        head = copy.deepcopy(model.mtp)
    finally:
        if traces is not None:
            object.__setattr__(model.mtp, "_compiled", traces)
    quantize(head, bits=4, group_size=group_size, quantize_mtp=True)  # the conversion's own rule and routing
    mx.eval(head.parameters())
    return head


def _head_during(model, head, stream):
    """Runs `stream` with `head` as the model's MTP head, restoring its own after."""
    before = model.mtp
    model.mtp = head
    try:
        yield from stream
    finally:
        model.mtp = before


def _draft_vocab_during(model, vocab: DraftVocab, stream):
    """Runs `stream` with the head drafting from `vocab`, restoring the head's own setting after."""
    before = model.mtp.draft_vocab
    model.mtp.draft_vocab = vocab
    try:
        yield from stream
    finally:
        model.mtp.draft_vocab = before


@dataclass
class Target:
    label: str
    model: object
    config: dict
    tokenizer: object | None
    synthetic: bool  # random weights: only oracle acceptance means anything
    stock: object | None = None
    stock_note: str = ""
    stock_max_logit_diff: float | None = None
    draft_vocabs: dict = field(default_factory=dict)  # --draft-vocab-ab: one DraftVocab per size, rows gathered once
    head_q4: object | None = None  # --head-q4-ab: the 4-bit copy of the MTP head, made once

    @property
    def vocab(self) -> int:
        return self.model.args.vocab_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes a plain decode step must read: target weights (tied embedding once) and the GDN state in and out."""
        a = self.model.args
        active = a.num_experts_per_tok / a.num_experts if a.num_experts else 1.0  # MoE: the experts a token uses
        weights = sum(v.nbytes * (active if ".switch_mlp." in k else 1.0)
                      for k, v in tree_flatten(self.model.parameters()) if not k.startswith("mtp."))
        gdn = sum(t == "linear_attention" for t in a.layer_types) * a.linear_num_value_heads * \
            a.linear_value_head_dim * a.linear_key_head_dim * 4
        return weights + 2 * gdn


# --- models -------------------------------------------------------------------------------------------------------

def load_target(name: str, *, bits: int, group_size: int, dtype: str | None, seed: int, stock: bool) -> Target:
    """A random in-memory model of a named shape, 'demo', or a checkpoint directory, plus mlx-lm's own model on the
    same weight arrays for the stock leg."""
    if name in SHAPES:
        mx.random.seed(seed)
        # float32 everywhere by default: in bf16 on a GPU, the near-uniform logits of random weights let the batched
        # verify and the recorded plain run disagree on argmax (docs/results/code_measurements.md, 'Random weights').
        dtype = dtype or "float32"
        config = hub_config(**SHAPES[name])
        config["quantization"] = {"group_size": group_size, "bits": bits} if bits else None
        model = random_model(**SHAPES[name], bits=bits or None, group_size=group_size, dtype=DTYPES[dtype])
        target = Target(f"random {name} Q{bits or 16} {dtype}", model, config, None, synthetic=True)
        keep_round_builds(model)  # (once per machine, on CUDA: the legs speculate)
    else:
        path = resolve_path(demo_model() if name == "demo" else name)
        model, config = load_model(path, dtype=dtype)
        target = Target(f"{name} ({path})", model, config, load_tokenizer(path, config), synthetic=False)
        keep_round_builds(model)
    if stock:
        try:
            log("built; building mlx-lm's model on the same weights (the stock leg)")
            target.stock, target.stock_max_logit_diff = build_stock(model, target.config)
            target.stock_note = (f"{type(target.stock).__module__}.Model on the same weight arrays, "
                                 "mlx_lm.generate.generate_step")
        except Exception as e:  # recorded, not fatal: the other legs still run
            target.stock_note = f"stock leg unavailable: {type(e).__name__}: {e}"
    return target


def build_stock(model, config: dict):
    """mlx-lm's own Qwen3.5 model sharing our parameter arrays (names model.X -> language_model.model.X), quantized
    the same way; returns it and the max |logit difference| against ours on a short prompt."""
    family = mlx_lm_qwen3_5_moe if model.args.num_experts else mlx_lm_qwen3_5
    stock = family.Model(family.ModelArgs.from_dict({**config, "model_type": family.__name__.rsplit(".", 1)[1]}))
    theirs = ["linear_attention" if layer.is_linear else "full_attention" for layer in stock.language_model.layers]
    if theirs != model.args.layer_types:
        raise ValueError("mlx-lm derives the layer pattern from full_attention_interval; this config's layer_types "
                         "differ from it")
    weights = {"language_model." + k: v for k, v in hf_parameters(model).items() if not k.startswith("mtp.")}
    # each layer as ours is quantized (MoE routers at 8 bits); fused projections take their parts' setting
    own = {f"language_model.{p}": {"group_size": m.group_size, "bits": m.bits} for p, m in model.named_modules()
           if hasattr(m, "group_size") and hasattr(m, "bits")}
    if own:
        common = max(own.values(), key=list(own.values()).count)
        nn.quantize(stock, class_predicate=lambda p, m: f"{p}.scales" in weights and own.get(p, common))
    stock.load_weights(list(weights.items()), strict=True)
    stock.eval()
    ids = mx.array([[1, 5, 9, 2, 7, 3, 4, 8]]) % model.args.vocab_size
    diff = mx.abs(stock(ids).astype(mx.float32) - model(ids).astype(mx.float32)).max().item()
    return stock, diff


# --- prompts ------------------------------------------------------------------------------------------------------

def text_prompts(workload: str) -> list[str]:
    if workload == "prose":
        return PROSE_PROMPTS
    if workload == "json":
        return JSON_PROMPTS
    if workload == "code":
        if HELDOUT_PROMPTS.exists():
            return [p["prompt"] for p in json.loads(HELDOUT_PROMPTS.read_text())["prompts"]]
        return CODE_PROMPTS
    raise ValueError(f"unknown workload {workload!r}: choose prose, code, json (random for random models)")


def workload_prompts(target: Target, workload: str, n: int, *, tokens: int, seed: int) -> list[list[int]]:
    """n prompts as token ids: random ids for random-weight models, else real text of the workload."""
    if target.tokenizer is None:
        rng = np.random.default_rng(seed)
        return [rng.integers(1, target.vocab, size=tokens).tolist() for _ in range(n)]
    texts = text_prompts(workload)
    return [list(target.tokenizer.encode(texts[i % len(texts)])) for i in range(n)]


# --- one timed run ------------------------------------------------------------------------------------------------

def token_stream(target: Target, leg: Leg, ids: list[int], temp: float, *, n_max: int, reference: list[int] | None,
                 seed: int):
    """(iterator of token ids, SpecStats or None) for one leg."""
    sampler = Sampler(temp=temp)
    if leg.kind == "stock":
        mlx_lm_generate = importlib.import_module("mlx_lm.generate")  # the package re-exports a function of that name
        steps = mlx_lm_generate.generate_step(mx.array(ids), target.stock, max_tokens=n_max,
                                              sampler=make_sampler(temp=temp))
        return (token for token, _ in steps), None
    if leg.kind in ("plain", "plain-aa"):
        stream = generate_step(target.model, mx.array(ids), sampler=sampler)
        return (_tracing_during(leg.traced, stream) if leg.traced is not None else stream), None
    if leg.verify == "mlx-lm":  # mlx-lm's own speculative loop, the MTP head as its draft model
        return mlx_lm_spec_stream(target, leg, ids, temp, n_max=n_max, reference=reference, seed=seed)
    options = SpecOptions(draft_tokens=leg.k, verify=leg.verify, adaptive=leg.adaptive)
    stats = SpecStats.of(options)
    drafter = None
    if leg.p is not None:  # the pipelined loop takes its synthetic drafts on the device
        drafter = DeviceOracle(reference, leg.p, target.model.args.vocab_size, leg.k, seed=seed) \
            if leg.verify == "pipelined" else OracleDrafter(target.model, sampler, reference, leg.p, seed=seed)
    stream = speculate(target.model, mx.array(ids), sampler=sampler, options=options, stats=stats,
                              drafter=drafter, max_tokens=n_max)
    if leg.draft_vocab:
        vocab = target.draft_vocabs.setdefault(leg.draft_vocab, DraftVocab(range(leg.draft_vocab)))
        stream = _draft_vocab_during(target.model, vocab, stream)
    if leg.head_q4:
        stream = _head_during(target.model, target.head_q4, stream)
    if leg.traced is not None:
        stream = _tracing_during(leg.traced, stream)
    return stream, stats


def mlx_lm_spec_stream(target: Target, leg: Leg, ids: list[int], temp: float, *, n_max: int,
                       reference: list[int] | None, seed: int):
    """mlx-lm's speculative_generate_step with `make_draft_model(model)` (or, with leg.p, SYNTHETIC drafts: the
    head runs for its cost, then OracleDraftModel proposes the recorded continuation with probability p). Its
    rounds are read back from mlx-lm's from_draft flags into SpecStats."""
    mlx_lm_generate = importlib.import_module("mlx_lm.generate")
    draft = make_draft_model(target.model) if leg.p is None else \
        OracleDraftModel(target.model, reference, leg.p, len(ids), seed=seed)
    stats = SpecStats(draft="mtp", verify="mlx-lm", draft_tokens=leg.k)
    steps = mlx_lm_generate.speculative_generate_step(mx.array(ids), target.model, draft, num_draft_tokens=leg.k,
                                                      max_tokens=n_max, sampler=make_sampler(temp=temp))

    def tokens():
        run = 0
        try:
            for token, _, from_draft in steps:  # a round: its accepted drafts, then the target's own token
                if from_draft:
                    run += 1
                else:
                    stats.record(leg.k, run)
                    run = 0
                yield token
        finally:
            steps.close()
            draft.close()
    return tokens(), stats


def timed_run(stream, lengths: tuple[int, int], *, compiled_path: bool | None = None) -> dict:
    """Consumes tokens up to the second length; stamps the first token and both lengths. `compiled_path` forces the
    compiled decode path on / off for the run (None: as LATTICE_COMPILE says)."""
    n1, n2 = lengths
    stamps, tokens, tic = {}, [], time.perf_counter()
    try:
        with compiled.forced(compiled_path):
            for n, token in enumerate(stream, start=1):
                tokens.append(token)
                if n in (1, n1, n2):
                    stamps[n] = time.perf_counter() - tic
                if n >= n2:
                    break
    finally:
        if hasattr(stream, "close"):
            stream.close()
    return {"ttft_s": stamps[1], "t1_s": stamps[n1], "t2_s": stamps[n2],
            "tok_s": bs.slope_rate(n1, stamps[n1], n2, stamps[n2]),
            # from the first token on: an adaptive leg's warm-up, decisions and plain stretches all count
            "tok_s_whole": bs.slope_rate(1, stamps[1], n2, stamps[n2]), "_tokens": tokens}


@dataclass
class LegRecord:
    leg: Leg
    runs: list[dict] = field(default_factory=list)
    peak_memory: int = 0
    spec: SpecStats | None = None  # summed over runs
    profile: dict | None = None  # GPU kernels per token (--profile)
    tokens: dict = field(default_factory=dict)  # greedy runs: prompt -> the tokens of its last run
    identical: list[bool] = field(default_factory=list)  # greedy MTP runs: tokens equal to plain's on that prompt
    # mlx-lm legs: whether this project's plain loop and mlx-lm's own plain loop agree, prompt by prompt
    plain_is_mlx_lm_plain: list[bool] = field(default_factory=list)

    def add(self, run: dict, stats: SpecStats | None, peak: int) -> None:
        self.runs.append(run)
        self.peak_memory = max(self.peak_memory, peak)
        if stats is not None:
            self.spec = stats if self.spec is None else self.spec + stats


def profile_leg(profiler, target: Target, leg: Leg, ids: list[int], temp: float, *, n: int,
                reference: list[int] | None, seed: int) -> dict:
    """GPU kernels per generated token (and per round for MTP) over n tokens after the first, from `profiler` (the
    CUPTI context manager of ../shared/device/gpu_kernels.py); one untimed run of its own."""
    stream, stats = token_stream(target, leg, ids, temp, n_max=n + 8, reference=reference, seed=seed)
    with compiled.forced(leg.compiled):
        return profile_stream(profiler, stream, stats, n)


def profile_stream(profiler, stream, stats: SpecStats | None, n: int) -> dict:
    """`profile_leg`'s figures for a token stream (closed here) and its SpecStats (None: plain decoding): n tokens
    after the first under `profiler`."""
    try:
        next(stream)  # prefill and the first token stay outside the profile
        rounds0 = stats.rounds if stats is not None else 0
        with profiler(steps=n) as prof:
            for _ in zip(range(n), stream):
                pass
    finally:
        stream.close()
    s = prof.summary(top=5)
    out = {k: s[k] for k in ("kernels_per_step", "kernel_us_per_step", "busy_us_per_step", "span_us_per_step")}
    out["steps_are"] = "generated tokens"
    per = n
    if stats is not None and stats.rounds > rounds0:
        out["rounds"] = per = stats.rounds - rounds0
        out["kernels_per_round"] = s["kernels_per_step"] * n / out["rounds"]
    # which kernels, by launches per round (per token for plain legs): where a round's launches go
    names: dict[str, int] = {}
    us: dict[str, float] = {}
    for e in prof.events:
        if e.get("cat") == "kernel":
            names[e["name"][:90]] = names.get(e["name"][:90], 0) + 1
            us[e["name"][:90]] = us.get(e["name"][:90], 0.0) + e["dur"]
    # collectives (NCCL's all-reduce / send-recv kernels of a multi-GPU model), per generated token
    comm = [e["dur"] for e in prof.events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    if comm:
        out["collective_launches_per_step"] = len(comm) / n
        out["collective_us_per_step"] = sum(comm) / n
    out["launches_by_kernel"] = {k: round(c / per, 2) for k, c in sorted(names.items(), key=lambda kv: -kv[1])[:40]}
    out["us_by_kernel"] = {k: round(t / per, 1) for k, t in sorted(us.items(), key=lambda kv: -kv[1])[:25]}
    return out


def run_group(target: Target, legs: list[Leg], prompts: list[list[int]], *, temp: float, reps: int,
              lengths: tuple[int, int], lock: dict, seed: int, label: str, profiler=None,
              on_timed=None) -> dict[str, LegRecord]:
    """Warms every leg up once, then `reps` repetitions in ABBA order; repetition r uses prompt r mod len(prompts).
    With `profiler`, one more run per leg measures its GPU kernels per token; `on_timed(records)` runs before that
    (a run stopped by a time limit while profiling keeps its timings)."""
    n_max = lengths[1] + 8
    references, mlx_lm_references = {}, {}
    mlx_lm_legs = any(leg.kind == "mtp" and leg.verify == "mlx-lm" for leg in legs)
    if any(leg.p is not None for leg in legs) or (mlx_lm_legs and temp == 0):
        log(f"[{label}] recording the greedy references of {len(prompts[:reps])} prompts")
        for i, ids in enumerate(prompts[:reps]):
            stream = generate_step(target.model, mx.array(ids), sampler=Sampler())
            references[i] = [t for t, _ in zip(stream, range(n_max + 8))]
            if mlx_lm_legs:  # mlx-lm's loop is held to mlx-lm's own plain loop (its prefill is chunked its way: on
                # random bf16 weights' near-tied logits that alone can change a greedy token)
                steps = importlib.import_module("mlx_lm.generate").generate_step(mx.array(ids), target.model,
                                                                                 max_tokens=n_max + 8)
                mlx_lm_references[i] = [t for t, _ in steps]

    def reference(leg: Leg, i: int) -> list[int] | None:
        return (mlx_lm_references if leg.verify == "mlx-lm" else references).get(i)

    for leg in legs:  # compiles kernels for every shape the leg uses, outside the timed runs
        log(f"[{label}] warming up {leg.name}")
        # an adaptive leg may reach any depth up to its K inside a timed run, and a verify shape's first use compiles
        # it (seconds under CUDA: docs/results/code_measurements.md, 'First use'): every depth is run once first
        warm = [dataclasses.replace(leg, adaptive=False, k=k) for k in range(1, leg.k + 1)] if leg.adaptive else []
        for w in [*warm, leg]:
            stream, _ = token_stream(target, w, prompts[0], temp, n_max=n_max, reference=reference(w, 0), seed=seed)
            # the adaptive leg itself over a whole generation: its tuner's switches (plain stretches and back) and
            # the shapes they use come only after its first decisions
            end = lengths[1] if w.adaptive else max(lengths[0], 8) + 1
            timed_run(stream, (min(lengths[0], 8), end), compiled_path=w.compiled)
    records = {leg.name: LegRecord(leg) for leg in legs}
    for rep in range(reps):
        i = rep % len(prompts)
        for leg in bs.abba_order(legs, rep):
            mx.random.seed(seed * 1000 + rep)
            stream, stats = token_stream(target, leg, prompts[i], temp, n_max=n_max, reference=reference(leg, i),
                                         seed=seed * 1000 + rep)
            mx.reset_peak_memory()
            with bench_lock(lock["path"], timeout=lock["timeout"]) as waited:
                run = timed_run(stream, lengths, compiled_path=leg.compiled)
            lock["waited_s"] += waited
            run["prompt"] = i
            tokens = run.pop("_tokens")
            if temp == 0:
                records[leg.name].tokens[i] = tokens
            records[leg.name].add(run, stats, mx.get_peak_memory())
            acc = f" alpha {bs.acceptance_estimates(stats.accepted_at, stats.rounds, leg.k)['alpha']:.2f}" \
                if stats is not None and stats.rounds and not leg.adaptive else ""
            log(f"[{label}] rep {rep + 1}/{reps} {leg.name:<24} {run['tok_s']:8.1f} tok/s{acc}")
    plain = records.get("plain")
    for rec in records.values():  # greedy MTP must give plain's tokens exactly (checked on every prompt run)
        if temp == 0 and rec.leg.kind == "mtp" and rec.leg.verify == "mlx-lm":  # mlx-lm's own plain loop's tokens
            rec.identical = [mlx_lm_references[i][: len(t)] == t for i, t in rec.tokens.items()]
            rec.plain_is_mlx_lm_plain = [references[i] == mlx_lm_references[i] for i in sorted(mlx_lm_references)]
        elif temp == 0 and rec.leg.kind == "mtp" and plain is not None:
            rec.identical = [plain.tokens.get(i) == t for i, t in rec.tokens.items()]
            if not all(rec.identical):
                log(f"[{label}] {rec.leg.name}: tokens DIFFER from plain's on {rec.identical.count(False)} of "
                    f"{len(rec.identical)} prompts")
    if on_timed is not None:
        on_timed(records)
    if profiler is not None:
        for leg in legs:
            log(f"[{label}] profiling {leg.name}")
            records[leg.name].profile = profile_leg(profiler, target, leg, prompts[0], temp, n=lengths[1],
                                                    reference=reference(leg, 0), seed=seed)
    return records


def plain_baseline(rec: LegRecord, records: dict[str, LegRecord]) -> str:
    """The plain leg a leg is measured against: with --compile-ab a compiled twin against compiled plain (so its
    `x plain` and costs compare like with like; plain+compile itself against plain: the compile gain)."""
    if rec.leg.compiled and rec.leg.name != "plain+compile" and "plain+compile" in records:
        return "plain+compile"
    return "plain"


def leg_summary(rec: LegRecord, records: dict[str, LegRecord], target: Target) -> dict:
    """Rates, ratios against plain and stock (paired by repetition), acceptance, time split, costs, break-even."""
    # adaptive legs (and the plain and stock legs they are compared with) over the whole generation
    rate = "tok_s_whole" if rec.leg.adaptive else "tok_s"
    rates = [r[rate] for r in rec.runs]
    out = {"leg": rec.leg.name, "kind": rec.leg.kind, "verify": rec.leg.verify if rec.leg.kind == "mtp" else None,
           "k": rec.leg.k or None, "adaptive": rec.leg.adaptive,
           "drafts": None if rec.leg.kind != "mtp" else (SYNTHETIC + f" p={rec.leg.p:g}" if rec.leg.p is not None
                                                        else "real MTP head"),
           "tok_s": bs.summarize(rates), "ttft_s": bs.summarize([r["ttft_s"] for r in rec.runs]), "runs": rec.runs,
           "peak_memory_gb": rec.peak_memory / 1e9,
           "effective_gb_s": target.bytes_per_token * bs.summarize(rates)["median"] / 1e9}
    if rec.profile is not None:
        out["gpu_profile"] = rec.profile
    if rec.identical:
        out["identical_to_plain"] = f"{sum(rec.identical)}/{len(rec.identical)} prompts"
    if rec.leg.verify == "mlx-lm" and rec.identical:
        out["identical_to"] = "mlx-lm's own plain loop (mlx_lm.generate.generate_step)"
        out["plain_is_mlx_lm_plain"] = f"{sum(rec.plain_is_mlx_lm_plain)}/{len(rec.plain_is_mlx_lm_plain)} prompts"
    plain_name = plain_baseline(rec, records)
    for key, base in (("plain", plain_name), ("stock", "stock")):
        if base in records and base != rec.leg.name and records[base].runs:
            out[f"vs_{key}"] = bs.paired_ratio(rates, [r[rate] for r in records[base].runs])
    base = records.get(plain_name)
    if base is not None and base is not rec and base.runs and all("tok_s_whole" in r for r in rec.runs + base.runs):
        # every leg over the whole generation too: the measure adaptive legs are compared on (report.py)
        out["vs_plain_whole"] = bs.paired_ratio([r["tok_s_whole"] for r in rec.runs],
                                                [r["tok_s_whole"] for r in base.runs])
    if rec.spec is None:
        return out
    s = rec.spec.to_dict()
    total = s["draft_time_s"] + s["verify_time_s"] + s["rollback_time_s"]
    out.update({
        "speculation": s,
        "time_split": {k: s[f"{k}_time_s"] / total if total else 0.0 for k in ("draft", "verify", "rollback")},
        **{k: s[k] for k in ("rounds", "acceptance_rate", "accepted_per_position", "mean_accepted_length")},
    })
    if rec.leg.adaptive:
        return out
    out.update(bs.acceptance_estimates(s["accepted_at"], s["rounds"], rec.leg.k))
    plain = records.get(plain_name)
    if plain and plain.runs:
        step_s = 1.0 / bs.summarize([r["tok_s"] for r in plain.runs])["median"]
        costs = bs.measured_costs(s, step_s)
        out["costs_in_plain_steps"] = costs
        out["break_even_alpha"] = bs.break_even(rec.leg.k, costs) if costs else None
        out["predicted_speedup"] = bs.model_speedup(out["alpha"], rec.leg.k, costs) if costs else None
    return out


# --- experiments --------------------------------------------------------------------------------------------------

def mtp_legs(verifies: list[str], ks: list[str], *, p: float | None) -> list[Leg]:
    legs = []
    for verify in verifies:
        for k in ks:
            adaptive = k == "adaptive"
            legs.append(Leg("mtp", verify, 4 if adaptive else int(k), adaptive, p))
    return legs


def experiment_decode(target: Target, args, lock: dict) -> dict:
    workloads = ["random"] if target.synthetic else args.workloads.split(",")
    oracle = args.drafts == "oracle" or (args.drafts == "auto" and target.synthetic)
    profiler = load_profiler(args.profile)
    groups = []
    partial = Path(args.out) / "decode.partial.json"  # (run() made the folder)
    partial.unlink(missing_ok=True)  # an earlier run's, in a reused folder, must not pass for this one's
    for workload in workloads:
        prompts = workload_prompts(target, workload, args.prompts or 5, tokens=args.prompt_tokens, seed=args.seed)
        for temp in parse_floats(args.temps):
            p = args.oracle_p if oracle and temp == 0 else None  # oracle drafts follow the greedy path only
            legs = []
            for name in args.legs.split(","):
                if name in ("stock", "plain", "plain-aa"):
                    legs += [Leg(name)] if (name != "stock" or target.stock is not None) else []
                else:
                    legs += mtp_legs([name], args.k.split(","), p=p)
            legs = with_trace_ab(with_head_q4_ab(with_draft_vocab_ab(with_compile_ab(legs, args.compile_ab),
                                                                     args.draft_vocab_ab), args.head_q4_ab),
                                 args.trace_ab)
            label = f"decode {workload} temp={temp:g}"
            group = {"workload": workload, "temp": temp, "oracle_p": p}

            def save_timings(records, group=group):  # replaced by decode.json once the experiment is complete
                done = {**group, "legs": [leg_summary(r, records, target) for r in records.values()]}
                partial.write_text(json.dumps({"partial": "timings only: the run stopped before it finished",
                                               "groups": groups + [done]}, indent=1, default=str))
            records = run_group(target, legs, prompts, temp=temp, reps=args.reps, lengths=args.lengths, lock=lock,
                                seed=args.seed, label=label, profiler=profiler, on_timed=save_timings)
            groups.append({**group, "legs": [leg_summary(r, records, target) for r in records.values()]})
    partial.unlink(missing_ok=True)
    return {"groups": groups}


def experiment_oracle(target: Target, args, lock: dict) -> dict:
    """Speedup over plain decode against forced per-position acceptance: SYNTHETIC drafts, greedy."""
    ps = parse_floats(args.oracle_ps)
    ks = [k for k in args.k.split(",") if k != "adaptive"]
    legs = [Leg("plain")]
    for p in ps:
        legs += mtp_legs(args.verify.split(","), ks, p=p)
    legs = with_compile_ab(legs, args.compile_ab)
    workload = "random" if target.synthetic else args.workloads.split(",")[0]
    prompts = workload_prompts(target, workload, args.prompts or 5, tokens=args.prompt_tokens, seed=args.seed)
    records = run_group(target, legs, prompts, temp=0.0, reps=args.reps, lengths=args.lengths, lock=lock,
                        seed=args.seed, label="oracle (synthetic)")
    summaries = [leg_summary(r, records, target) for r in records.values()]
    curves = {}
    for s in summaries:
        leg = records[s["leg"]].leg
        if leg.kind != "mtp":
            continue
        curves.setdefault(f"{s['verify']}-K{s['k']}" + ("+compile" if leg.compiled else ""), []).append({
            "p": records[s["leg"]].leg.p, "alpha": s["alpha"], "speedup": s["vs_plain"], "tok_s": s["tok_s"],
            "predicted_speedup": s.get("predicted_speedup"), "break_even_alpha": s.get("break_even_alpha"),
            "costs_in_plain_steps": s.get("costs_in_plain_steps")})
    return {"label": SYNTHETIC, "workload": workload, "groups": [{"workload": workload, "temp": 0.0,
                                                                 "legs": summaries}], "curves": curves}


def experiment_acceptance(target: Target, args, lock: dict) -> dict:
    """Live (unforced) acceptance of the real MTP head, K = 1..4, per temperature, with plain vs MTP tok/s; one
    repetition per prompt."""
    workloads = args.workloads.split(",") if args.workloads != "prose,code,json" else ["code"]
    groups = []
    for workload in workloads:
        prompts = workload_prompts(target, workload, args.prompts or 20, tokens=args.prompt_tokens, seed=args.seed)
        for temp in parse_floats(args.temps):
            legs = [Leg("plain")] + mtp_legs(args.verify.split(",")[:1],
                                             [k for k in args.k.split(",") if k != "adaptive"], p=None)
            records = run_group(target, legs, prompts, temp=temp, reps=max(args.reps, len(prompts)),
                                lengths=args.lengths, lock=lock, seed=args.seed,
                                label=f"acceptance {workload} temp={temp:g}")
            groups.append({"workload": workload, "temp": temp, "n_prompts": len(prompts),
                           "legs": [leg_summary(r, records, target) for r in records.values()]})
    note = "random weights: acceptance is meaningless here" if target.synthetic else "real MTP head, unforced"
    return {"note": note, "groups": groups}


def experiment_prefill(target: Target, args, lock: dict) -> dict:
    legs = [Leg("stock")] * (target.stock is not None) + [Leg("plain")]
    rows = []
    for length in parse_ints(args.prefill_lengths):
        ids = np.random.default_rng(args.seed + length).integers(1, target.vocab, size=length).tolist()
        rates = {leg.name: [] for leg in legs}
        for leg in legs:  # warm-up at this length
            timed_run(token_stream(target, leg, ids, 0.0, n_max=4, reference=None, seed=0)[0], (1, 2))
        for rep in range(args.reps):
            for leg in bs.abba_order(legs, rep):
                stream, _ = token_stream(target, leg, ids, 0.0, n_max=4, reference=None, seed=0)
                with bench_lock(lock["path"], timeout=lock["timeout"]) as waited:
                    run = timed_run(stream, (1, 2))
                lock["waited_s"] += waited
                rates[leg.name].append(length / run["ttft_s"])
                log(f"[prefill {length}] rep {rep + 1}/{args.reps} {leg.name:<6} {rates[leg.name][-1]:9.1f} tok/s")
        for name, r in rates.items():
            row = {"leg": name, "prompt_tokens": length, "tok_s": bs.summarize(r), "runs": r}
            if name != "plain" and rates.get("plain"):
                row["vs_plain"] = bs.paired_ratio(r, rates["plain"])
            rows.append(row)
    return {"note": "time to first token (prefill + one sampled token)", "rows": rows}


EXPERIMENTS = {"decode": experiment_decode, "oracle": experiment_oracle, "acceptance": experiment_acceptance,
               "prefill": experiment_prefill}


def run_meta(argv: list[str], target: Target, lock: dict) -> dict:
    return {
        "command": shlex.join(["python", "-m", "lattice_mlx.bench", *argv]), **provenance(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": str(mx.default_device()), "metal_available": mx.metal.is_available(),
        "cuda_available": mx.cuda.is_available(), "mlx_version": mx.__version__, "mlx_lm_version": mlx_lm.__version__,
        "device": device_name(), "platform": platform.platform(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "model": target.label, "synthetic_weights": target.synthetic,
        "bytes_per_token": target.bytes_per_token, "stock": target.stock_note,
        "stock_max_logit_diff": target.stock_max_logit_diff, "peers": peer_status(), "lock": lock["path"],
    }




# --- CLI ----------------------------------------------------------------------------------------------------------

def load_profiler(folder: str | None):
    """kernel_profile from folder/gpu_kernels.py, or None."""
    if folder is None:
        return None
    path = Path(folder) / "gpu_kernels.py"
    if not path.exists():
        raise ValueError(f"--profile {folder}: no gpu_kernels.py there")
    spec = importlib.util.spec_from_file_location("gpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel_profile


def profile_calls(kernel_profile, fn, calls: int, top: int = 3) -> dict:
    """The CUPTI summary (kernel_profile: `load_profiler`'s) of `calls` evaluations of fn(), each its own launch,
    after three untimed ones (builds, warm-up)."""
    for _ in range(3):
        mx.eval(fn())
    with kernel_profile(steps=calls) as prof:
        for _ in range(calls):
            mx.eval(fn())
    return prof.summary(top=top)


def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def setup_arg_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m lattice_mlx.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"random in-memory shape ({', '.join(SHAPES)}), 'demo', or a checkpoint directory")
    p.add_argument("--bits", type=int, default=4, help="random models: quantization bits (0 = none)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="default: float32 for random models; the checkpoint's own otherwise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=DEFAULT_REPS, help="timed repetitions per leg (>= 5 for evidence)")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="two generation lengths n1,n2 for the slope")
    p.add_argument("--legs", default="stock,plain,plain-aa,sequential,batched",
                   help="plain-aa: a second plain leg whose ratio to plain is the noise floor of every paired ratio")
    p.add_argument("--k", default=DEFAULT_K + ",adaptive", help="draft depths, 'adaptive' for tuned K (max 4)")
    p.add_argument("--verify", default="batched", help="oracle / acceptance: verifiers, comma-separated")
    p.add_argument("--workloads", default="prose,code,json", help="real-text models; random models use random ids")
    p.add_argument("--prompts", type=int, help="prompts per workload (default 5; 20 for acceptance)")
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, help="random-id prompt length")
    p.add_argument("--temps", default="0,0.7")
    p.add_argument("--drafts", choices=["auto", "real", "oracle"], default="auto",
                   help="decode MTP drafts: auto = oracle on random weights, real MTP head on checkpoints")
    p.add_argument("--oracle-p", type=float, default=0.8, help="decode: oracle per-position acceptance")
    p.add_argument("--oracle-ps", default=DEFAULT_ORACLE_P, help="oracle: acceptance grid")
    p.add_argument("--prefill-lengths", default=DEFAULT_PREFILL_LENGTHS)
    p.add_argument("--no-stock", action="store_true", help="skip the mlx-lm stock leg")
    p.add_argument("--compile-ab", action="store_true",
                   help="decode / oracle: every lattice leg layer by layer and as its compiled twin (traced plain "
                        "steps and rounds run layer by layer inside their trace either way: set "
                        "LATTICE_TRACE_STEPS=0 LATTICE_TRACE_ROUNDS=0 to compare the per-layer compiled path)")
    p.add_argument("--draft-vocab-ab", type=int, metavar="N",
                   help="decode: every MTP leg also as a twin whose head drafts from token ids 0..N-1 only")
    p.add_argument("--head-q4-ab", action="store_true",
                   help="decode: every MTP leg also as a twin whose MTP head runs in 4 bits (convert --quantize-mtp)")
    p.add_argument("--trace-ab", action="store_true",
                   help="decode: the plain leg and every pipelined leg also as a twin whose steps / rounds are "
                        "built op by op (not traced)")
    p.add_argument("--profile", metavar="DIR", help="decode: also profile each leg's GPU kernels per token with "
                   "DIR/gpu_kernels.py (CUPTI through torch; a CUDA machine)")
    p.add_argument("--out", default=DEFAULT_OUT, help="directory for JSON, markdown and PNG results")
    p.add_argument("--lock", default=DEFAULT_LOCK, help="lock file held around every timed run (LATTICE_BENCH_LOCK)")
    p.add_argument("--lock-timeout", type=float, default=DEFAULT_LOCK_TIMEOUT, help="seconds to wait for the lock")
    return p


def check_args(args) -> None:
    lengths = parse_ints(args.lengths)
    if len(lengths) != 2 or not 1 <= lengths[0] < lengths[1]:
        raise ValueError(f"--lengths needs two increasing lengths n1,n2, got {args.lengths!r}")
    args.lengths = tuple(lengths)
    if args.reps < 1:
        raise ValueError("--reps must be at least 1")
    for k in args.k.split(","):
        if k != "adaptive" and not (k.isdigit() and 1 <= int(k) <= 8):
            raise ValueError(f"--k entries are 1..8 or 'adaptive', got {k!r}")
    if not all(0.0 <= p <= 1.0 for p in [args.oracle_p, *parse_floats(args.oracle_ps)]):
        raise ValueError("oracle acceptance values must lie in [0, 1]")
    if args.draft_vocab_ab is not None and args.draft_vocab_ab < 1:
        raise ValueError(f"--draft-vocab-ab needs a number of token ids >= 1, got {args.draft_vocab_ab}")


def run(args, argv: list[str]) -> dict:
    check_args(args)
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    log(f"loading {args.model} on {mx.default_device()} ...")
    target = load_target(args.model, bits=args.bits, group_size=args.group_size, dtype=args.dtype, seed=args.seed,
                         stock=not args.no_stock)
    if args.experiment == "all" and target.synthetic:
        names.remove("acceptance")  # random weights accept ~0%: only the oracle curve says anything
    if args.draft_vocab_ab and (args.draft_vocab_ab >= target.model.args.vocab_size or not target.model.has_mtp):
        raise ValueError(f"--draft-vocab-ab {args.draft_vocab_ab}: needs an MTP head and fewer ids than the "
                         f"vocabulary ({target.model.args.vocab_size})")
    if args.head_q4_ab:
        if not target.model.has_mtp or isinstance(target.model.mtp.fc, nn.QuantizedLinear):
            raise ValueError("--head-q4-ab needs an MTP head that is not quantized already")
        target.head_q4 = quantized_head(target.model, group_size=args.group_size)
    log(f"model: {target.label}; stock: {target.stock_note}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lock = {"path": args.lock, "timeout": args.lock_timeout, "waited_s": 0.0}
    lines = {}
    for name in names:
        tic = time.perf_counter()
        result = EXPERIMENTS[name](target, args, lock)
        meta = run_meta(argv, target, lock)
        meta.update(experiment=name, elapsed_s=round(time.perf_counter() - tic, 1), lock_waited_s=lock["waited_s"])
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, **result}, indent=1, default=str))
        plots, note = make_plots(out, name, result)
        write_markdown(out, name, result, meta, plots, note, list(EXPERIMENTS))
        print("\n\n".join(group_tables(name, result, text_table)) + "\n")
        lines[name] = headline(name, result)
    return {"out": str(out), "model": target.label, "backend": str(mx.default_device()), "results": lines}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = setup_arg_parser().parse_args(argv)
    try:
        line = run(args, argv)
    except (LoadError, ValueError, LockTimeout, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
