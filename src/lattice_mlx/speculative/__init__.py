"""Speculative decoding, one room with one entrance: `speculate` takes the options (options.py) to a loop.

- chain.py: host-side rounds: draft K, verify them in one batched forward (or one at a time), accept, roll back.
- pipelined.py: device-side rounds: every decision on the device, the next round dispatched before this one is read.
- tree.py: a tree of drafts verified in one forward.
- drafters.py: where drafts come from (the MTP head, n-grams, the model's own early layers, MTP + n-grams).
- tuning.py: adaptive depth (both tuners, their constants and memory).
- draft_model.py: the MTP head as mlx-lm's draft model (`make_draft_model`).
"""

from collections.abc import Iterator

import mlx.core as mx

from .. import settings
from ..sample import Sampler
from .chain import run_chain
from .draft_model import make_draft_model
from .options import DRAFT_SOURCES, MAX_DRAFT_TOKENS, VERIFIERS, SpecOptions, SpecStats, parse_tree
from .pipelined import run_pipelined
from .tree import run_tree

__all__ = ["DRAFT_SOURCES", "MAX_DRAFT_TOKENS", "VERIFIERS", "SpecOptions", "SpecStats", "auto_applies",
           "check_split_model", "make_draft_model", "parse_tree", "speculate"]


def auto_applies(model) -> bool:
    """Whether speculation='auto' (the API's and generate's default) speculates on `model`: it has an MTP head and
    LATTICE_MTP=1. Off by default for now: measured, the default speculation still lost to plain decoding where
    drafts are never accepted, and its first generation in a fresh process compiled for tens of seconds on a GPU
    (docs/adr/0008-mtp-on-by-default.md); on MLX's CPU backend no depth pays (docs/results/code_measurements.md,
    'Speculation on the CPU')."""
    return bool(getattr(model, "has_mtp", False)) and settings.on("mtp")


def check_split_model(model, options: SpecOptions | None) -> None:
    """A model split over processes (Model.shard / Model.pipeline) speculates with MTP or n-gram chains and the
    batched verifier: those take every decision from rank 0 (Model.agree). Trees, the sequential verifier and
    self-speculation would let ranks diverge and deadlock, so they are refused."""
    if getattr(model, "sharding_group", None) is None or options is None:
        return
    if options.tree or options.verify not in ("batched", "auto") or options.draft.startswith("self"):
        flag = "--tree" if options.tree else (f"--verify {options.verify}" if options.verify not in ("batched", "auto")
                                              else "--draft self")
        raise ValueError(f"a model split over processes speculates with MTP or n-gram chains and the batched "
                         f"verifier only: drop {flag}")


def speculate(model, ids: mx.array, *, sampler: Sampler, options: SpecOptions, stats: SpecStats, drafter=None,
              prompt_cache=None, max_tokens: int | None = None) -> Iterator[int]:
    """The token iterator of speculative decoding as `options` asks for it: the same distribution as plain decoding
    (identical tokens when greedy), `stats` filled as it goes. `drafter`: a draft source object instead of the one
    `options.draft` names (a benchmark's oracle: a host drafter with `propose`, or a pipelined draft override);
    `prompt_cache` (prompt_cache.PromptCache): its prefix of `ids` is not prefilled again (chains only).
    `max_tokens`: the most tokens the caller will take, if it knows (the adaptive pipelined loop weighs a process's
    first rounds against it: tuning.FIRST_ROUNDS_S). What the
    options and the model cannot do together is a ValueError here, before any token."""
    if options.needs_mtp and not model.has_mtp:
        flag = f"--tree {options.tree}" if options.tree else ("--mtp" if options.draft == "mtp" else
                                                              f"--draft {options.draft}")
        raise ValueError(f"{flag} needs MTP weights (mtp.*), and this checkpoint has none: drop {flag}")
    check_split_model(model, options)
    if options.tree:
        if prompt_cache is not None:
            raise ValueError("--tree does not take a prompt cache yet: use a chain (--draft-tokens)")
        shape = parse_tree(options.tree)
        vocab = model.mtp.draft_vocab
        if vocab is not None and max(shape) > vocab.size:
            raise ValueError(f"--tree {options.tree}: a node has more children than the head's draft vocabulary has "
                             f"ids ({vocab.size})")
        return run_tree(model, ids, sampler=sampler, shape=shape, stats=stats, drafter=drafter)
    options = options.resolved(split=getattr(model, "sharding_group", None) is not None,
                               host_drafter=hasattr(drafter, "propose"))
    stats.verify = options.verify
    if options.verify == "pipelined":  # every decision on the device; `drafter` is a draft override
        return run_pipelined(model, ids, sampler=sampler, options=options, stats=stats, override=drafter,
                             prompt_cache=prompt_cache, budget=max_tokens)
    return run_chain(model, ids, sampler=sampler, options=options, stats=stats, drafter=drafter,
                     prompt_cache=prompt_cache)
