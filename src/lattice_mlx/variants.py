"""The kernel variants a model asks for, found by asking it: the model's own forwards (prefill, decode, verify with
and without per-step states, pipelined picks, trees, the MTP head, the draft vocabulary, greedy picks) run under
`_dialect.recording` on placeholder weights of the checkpoint's shapes, so every kernel call the dispatchers make is
collected with its template, inputs and launch geometry, and nothing is computed. What the Metal source check
(tests/metal/test_metal_sources.py) compiles and what `python -m lattice_mlx.doctor` runs come from here, not from
a list of variants kept by hand.
"""

import sys
import time
from collections.abc import Iterable

import mlx.core as mx
from mlx.utils import tree_map

from .load import quantize
from .metal import _dialect
from .metal.argmax import argmax
from .models import compiled
from .models.fuse import fuse_projections
from .models.mtp import DraftVocab, MTPHead
from .models.qwen3_5 import Model, ModelArgs
from .models.tree import Tree

WIDTHS = tuple(range(1, 17))  # decode (1), verifies of K + 1 up to 8 drafts, trees and short prompt chunks
PROMPT = 300  # a prompt chunk past every kernel's row limit, leaving the attention cache past one key split
TREES = ((-1, 0, 0), (-1, 0, 0, 1, 1, 2), (-1, 0, 1, 2, 0, 4, 5, 0))  # shapes 2 / 2-2 / three chains of 3
DRAFT_VOCABS = (4096, 16384)  # a small and a large draft vocabulary (from 8k ids on, the variants are the same) (models/mtp.py DraftVocab)
# A small shape every kernel takes (K a multiple of 1024 for the gated-norm prologue: value heads x Dv = 1024): what
# the doctor's "small" rows run, over the model's own layer pattern, dtype and quantization.
SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
             linear_num_key_heads=2, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=128,
             vocab_size=1024, moe_intermediate_size=128, shared_expert_intermediate_size=128)


def placeholder_model(args: ModelArgs, *, dtype: mx.Dtype, bits: int | None, group_size: int) -> Model:
    """The model (MTP head included where the config has one) with every weight a zero-stride view of one zero: the
    real shapes and dtypes, next to no memory (nothing is evaluated). Quantized, routed and fused as load() does."""
    model = Model(args)
    if args.mtp_num_hidden_layers:
        model.mtp = MTPHead(args)
    model.set_dtype(dtype)
    if bits:
        quantize(model, bits=bits, group_size=group_size, quantize_mtp=False)
    model.update(tree_map(lambda p: mx.broadcast_to(mx.zeros((), dtype=p.dtype), p.shape), model.parameters()))
    model.eval()
    return fuse_projections(model, evaluate=False)


def reduced(args: dict) -> dict:
    """A text config with one layer of each kind, the order the model's own pattern starts with (the variants a
    layer asks for do not depend on how many layers there are)."""
    kinds = ModelArgs.from_dict(args).layer_types
    order = list(dict.fromkeys(kinds))
    return {**args, "num_hidden_layers": len(order), "layer_types": order}


def _tokens(model: Model, T: int) -> mx.array:
    """T distinct token ids [1, T] (a recorded call keeps them: the doctor reruns it with them)."""
    return (mx.arange(T, dtype=mx.int32) % model.args.vocab_size)[None]


def _target_forwards(model: Model, widths: Iterable[int]) -> None:
    """Every forward shape the decode loops run on the target: after no prompt and after PROMPT tokens, each width
    plain, recording per-step states (verify), and continuing from a picked step of a recorded verify (pipelined
    rounds); the greedy pick over the logits; then the token trees."""
    for prompt in (0, PROMPT):
        for T in widths:
            for gdn in ("plain", "record", "pick"):
                cache = model.make_cache(trimmable=False)
                if prompt:
                    model(_tokens(model, prompt), cache)
                linear = [c for c, layer in zip(cache, model.layers) if layer.is_linear]
                if gdn != "plain":
                    for c in linear:
                        c.begin()
                if gdn == "pick":
                    model(_tokens(model, T), cache)
                    for c in linear:
                        c.pick(mx.array([1, 0], dtype=mx.int32))
                logits = model(_tokens(model, T), cache)
                argmax(logits)
    for parents in TREES:
        cache = model.make_cache(trimmable=False)
        argmax(model(_tokens(model, len(parents)), cache, tree=Tree(parents)))


BATCHES = (2, 5)  # a batch's rows in each of the fused matmul's two capacities (2-4, 5-8)


def _batch_forwards(model: Model, widths: Iterable[int]) -> None:
    """A continuous batch's forwards (batch.py): B sequences joined into batch caches after a short prompt each, a
    step of one token per sequence and a verify of two, where B x T fits the widths (per-row positions and the
    batch's attention layout take variants of their own)."""
    from .batch import join_rows

    for B in BATCHES:
        for T in (1, 2):
            if B * T > max(widths):
                continue
            cache = None
            for _ in range(B):
                one = model.make_cache(trimmable=False)
                model(_tokens(model, 3), one)
                cache = join_rows(cache, one)
            argmax(model(mx.broadcast_to(_tokens(model, T), (B, T)), cache))


def _head_forwards(model: Model, widths: Iterable[int], vocabs: list[DraftVocab]) -> None:
    """The MTP head as the drafters run it: fed T verified positions, a draft step from its own output (the hidden's
    norm fused into its input), the logits of its output over the whole vocabulary and over draft vocabularies."""
    head, H = model.mtp, model.args.hidden_size
    for T in widths:
        cache = head.make_cache()
        embeds = model.model.embed_tokens(_tokens(model, T))
        hidden = mx.zeros((1, T, H), dtype=embeds.dtype)
        u = head(embeds, hidden, cache)
        x = head(embeds, u, cache, hidden_norm=head.norm)
        argmax(model.lm_logits(x, norm=head.norm))
        argmax(model.lm_logits(head.norm(u)))
        for vocab in vocabs:
            argmax(vocab.lm_logits(model, x, norm=head.norm))


def model_calls(args: dict, *, dtype: mx.Dtype, bits: int | None, group_size: int,
                widths: Iterable[int] = WIDTHS) -> list[_dialect.Call]:
    """The kernel calls a model of text config `args` makes (reduced to one layer of each kind) with weights of
    `dtype` quantized to `bits` (None: unquantized) in groups of `group_size`: once with every kernel there, and
    once with every kernel failing, so that the calls a reference makes in its place (the fused GDN form's reference
    runs the plain recurrence kernel) are listed too."""
    widths = tuple(widths)
    model = placeholder_model(ModelArgs.from_dict(reduced(args)), dtype=dtype, bits=bits, group_size=group_size)
    found = []
    # made once: a draft vocabulary gathers its lm_head rows on first use (the one thing here that is evaluated)
    vocabs = [DraftVocab(range(n)) for n in DRAFT_VOCABS if n < model.args.vocab_size] if model.has_mtp else []
    for spy in (False, True):
        # layer by layer: a compiled layer calls the same kernels, but its recorded arguments would be trace
        # placeholders
        with compiled.forced(False), _dialect.recording(spy=spy) as calls:
            _target_forwards(model, widths)
            _batch_forwards(model, widths)
            if model.has_mtp:
                _head_forwards(model, widths, vocabs)
        found += calls
    return found


def distinct(calls: Iterable[_dialect.Call]) -> dict[tuple, _dialect.Call]:
    """One call per variant (`Call.variant`: what the compiled source and the launch depend on)."""
    out = {}
    for call in calls:
        out.setdefault(call.variant(), call)
    return out


PREBUILD_WIDTHS = tuple(range(1, 9))  # decode, verifies of up to 7 drafts, batches of up to 8 rows, short chunks


def prebuild(args: dict, *, dtype: mx.Dtype, bits: int | None, group_size: int) -> int:
    """The CUDA modules of the variants a model of text config `args` asks for (widths up to 8), built in parallel
    into MLX's PTX cache where it lacks them (metal/cuda_cache.py: once per machine); one line on stderr says what
    that cost. Variants not listed here are kept as they are first launched. Returns how many were built."""
    from .metal import cuda_cache

    calls = model_calls(args, dtype=dtype, bits=bits, group_size=group_size, widths=PREBUILD_WIDTHS)
    tic = time.perf_counter()
    built = cuda_cache.prebuild(calls)
    if built:
        print(f"lattice_mlx: built {built} GPU kernels for this machine in {time.perf_counter() - tic:.1f} s (once: "
              f"kept in {cuda_cache.cache_dir()})", file=sys.stderr, flush=True)
    return built
