"""MTP speculative decoding: draft K tokens with the MTP head, verify them in one target pass, accept, roll back.

Indexing: y is the newest token (position p), not yet fed to the target; MTP slot j pairs embed(t_{j+1}) with the
target hidden h_j at RoPE position j. A round drafts slots p-1 .. p+K-2, verifies [y, d1..dK] at positions p..p+K,
keeps y, d1..dn, then trims the MTP cache to its true rows; the next round's first MTP call adds the n rows that
now have true hiddens (d1..dn with h_p..h_{p+n-1}) together with its own first draft slot.
"""

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx

from .. import cache as caches
from ..decode import resume
from ..metal.argmax import argmax
from ..sample import Sampler, accept_greedy, accept_sampled
from .drafters import HybridDrafter, MTPDrafter, make_drafter
from .options import SpecOptions, SpecStats
from .tuning import (
    ADAPTIVE_START_K,
    ADAPTIVE_WARMUP_ROUNDS,
    FIRST_OFF_TOKENS,
    MAX_OFF_TOKENS,
    PLAIN_TIMED_STEPS,
    PLAIN_WARMUP_STEPS,
    PROBE_ROUNDS,
    DepthTuner,
)

log = logging.getLogger("lattice_mlx")


@dataclass
class Round:
    """What the verifier decided: n drafts accepted, the next token, and the target hidden at positions p..p+n."""

    n: int
    token: int
    hidden: mx.array  # [n+1, H]
    drafts: list[int]  # the drafts as ids (a lazy draft array is read back with the verify)


def verify_batched(model, cache: list, y: int, drafts, q, sampler: Sampler) -> Round:
    """One target forward over [y, d1..dK]; GDN layers record per-step states so rollback is a pick.
    `drafts` may be a lazy array: the forward is built on it and both are evaluated together."""
    caches.begin(cache)
    lazy = isinstance(drafts, mx.array)
    tokens = mx.concatenate([mx.array([y]), drafts.astype(mx.int32)])[None] if lazy else mx.array([[y, *drafts]])
    logits, hidden = model(tokens, cache, return_hidden=True)
    logits, hidden = logits[0], hidden[0]  # [K+1, V], [K+1, H]
    if sampler.greedy:
        targets = argmax(logits)
        if lazy:
            mx.eval(targets, drafts)
            drafts = drafts.tolist()
        targets = targets.tolist()
        n = accept_greedy(targets, drafts)
        token = targets[n]
    else:
        probs = sampler.probs(logits)
        if lazy:
            mx.eval(probs, q, drafts)
            drafts = drafts.tolist()
        n, token = accept_sampled(probs, q, drafts)
    if getattr(model, "sharding_group", None) is not None:  # tensor parallel: rank 0's verdict on every rank
        n, token = model.agree(mx.array([n, token], dtype=mx.int32)).tolist()
    return Round(n, token, hidden[: n + 1], drafts)


def verify_sequential(model, cache: list, y: int, drafts, q, sampler: Sampler) -> Round:
    """One target step per token, stopping at the first rejection: the cache never holds a rejected token, so there
    is nothing to roll back and no per-step GDN states to record (no begin())."""
    drafts = drafts.tolist() if isinstance(drafts, mx.array) else drafts
    hs, tokens = [], [y, *drafts]
    for i, t in enumerate(tokens):
        logits, h = model(mx.array([[t]]), cache, return_hidden=True)
        hs.append(h[0, -1])
        if i == len(drafts):
            return Round(i, sampler(logits[0, -1]).item(), mx.stack(hs), drafts)
        if sampler.greedy:
            best = mx.argmax(logits[0, -1]).item()
            ok, token = best == drafts[i], best
        else:
            n, token = accept_sampled(sampler.probs(logits[0, -1:]), q[i : i + 1], [drafts[i]])
            ok = n == 1
        if not ok:
            return Round(i, token, mx.stack(hs), drafts)


VERIFIERS = {"batched": verify_batched, "sequential": verify_sequential}


def plain_steps(model, cache: list, y: int, sampler: Sampler, drafter, history: list[int], n: int,
                out: dict) -> Iterator[int]:
    """n plain steps pipelined as generate_step runs them (the next forward queued before a token is read back),
    each position's hidden handed to the drafter, so speculation can resume after them. Sets out["y"], the newest
    token (not yet fed), and out["step_s"], the mean time of a step."""
    tic = time.perf_counter()
    agree = getattr(model, "agree", lambda x: x)
    logits, h = model(mx.array([[y]]), cache, return_hidden=True)
    nxt = agree(sampler(logits[0, -1]))
    mx.async_eval(nxt, h)
    for i in range(n):
        cur, h_cur = nxt, h
        if i + 1 < n:
            logits, h = model(cur.reshape(1, 1), cache, return_hidden=True)
            nxt = agree(sampler(logits[0, -1]))
            mx.async_eval(nxt, h)
        token = cur.item()
        drafter.observe([token], h_cur[0])
        history.append(token)
        yield token
    out["y"], out["step_s"] = token, (time.perf_counter() - tic) / n


def one_hot_q(drafts: list[int], vocab: int) -> mx.array:
    """A deterministic draft's distribution: all mass on the proposed token."""
    return (mx.arange(vocab)[None, :] == mx.array(drafts)[:, None]).astype(mx.float32)


def run_chain(model, ids: mx.array, *, sampler: Sampler, options: SpecOptions, stats: SpecStats, drafter=None,
              prompt_cache=None) -> Iterator[int]:
    """Host-side rounds (`options` resolved, verify "batched" or "sequential"; `speculate` is the entrance): yields
    tokens with the same distribution as plain decoding (identical tokens when greedy), filling `stats`. The draft
    source is `drafter` if given (e.g. a synthetic oracle), else the one `options.draft` names. `prompt_cache`
    (prompt_cache.PromptCache): its prefix of `ids` is not prefilled again (target and MTP head)."""
    drafter = drafter or make_drafter(options.draft, model, sampler)
    verifier, k = VERIFIERS[options.verify], options.draft_tokens
    cache, head_cache, logits, hidden, n = resume(model, ids, prompt_cache, return_hidden=True)
    agree = getattr(model, "agree", lambda x: x)
    y = agree(sampler(logits)).item()
    history = [*ids.tolist(), y]
    head = drafter.mtp if isinstance(drafter, HybridDrafter) else drafter
    if n and isinstance(head, MTPDrafter) and head_cache is not None:
        head.cache = head_cache  # the head's rows of the cached prefix; the rest pairs ids[n:] with hiddens
    # (with a prompt cache `hidden` starts at the cached prefix's last position, so the head's work starts there)
    drafter.start(history[max(n - 1, 0) : -1], y, hidden, cache)  # the head's share of the prompt work
    yield y
    tuner, seen_k, next_check, off_tokens = None, set(), ADAPTIVE_WARMUP_ROUNDS, FIRST_OFF_TOKENS
    if options.adaptive:
        run = {}
        yield from plain_steps(model, cache, y, sampler, drafter, history, PLAIN_WARMUP_STEPS, run)  # untimed
        yield from plain_steps(model, cache, run["y"], sampler, drafter, history, PLAIN_TIMED_STEPS, run)
        y = run["y"]
        tuner = DepthTuner(k, run["step_s"])
        k = min(k, ADAPTIVE_START_K)
    while True:
        tic = time.perf_counter()
        drafts, q = drafter.propose(history, k)
        if isinstance(drafts, mx.array):
            drafts = agree(drafts)  # tensor parallel: every rank verifies rank 0's (sampled) drafts
            mx.async_eval(drafts)  # the GPU drafts while the verify graph is built on top of it
        elif q is None and drafts and not sampler.greedy:
            q = one_hot_q(drafts, model.args.vocab_size)
        t_draft = time.perf_counter() - tic  # with lazy drafts: graph building only; their GPU time lands in verify
        r = verifier(model, cache, y, drafts, q, sampler)
        drafts = r.drafts
        mx.eval(r.hidden)
        t_verify = time.perf_counter() - tic - t_draft
        tic = time.perf_counter()
        if options.verify == "batched":
            caches.rollback(cache, len(drafts) - r.n)
        caches.commit(cache)
        drafter.rollback()
        stats.rollback_time_s += time.perf_counter() - tic
        stats.draft_time_s, stats.verify_time_s = stats.draft_time_s + t_draft, stats.verify_time_s + t_verify
        stats.record(len(drafts), r.n)
        accepted = [*drafts[: r.n], r.token]
        drafter.observe(accepted, r.hidden)
        history += accepted
        y = r.token
        yield from accepted
        if tuner is None or not drafts:
            continue
        if len(drafts) in seen_k:  # a verify shape's first round pays its one-off costs (compiling a new shape)
            tuner.observe(len(drafts), t_draft, t_verify)
        seen_k.add(len(drafts))
        if stats.rounds < next_check:
            continue
        k, gain = tuner.best(stats.accepted_per_position())
        if getattr(model, "sharding_group", None) is not None:
            # the tuner reads this rank's clock: rank 0's choice on every rank, or ranks would run different rounds
            k, on = model.agree(mx.array([k, int(gain >= 1.0)], dtype=mx.int32)).tolist()
            gain = 1.0 if on else min(gain, 0.99)
        if gain >= 1.0:
            next_check = stats.rounds + 1
            continue
        # Not paying now: plain steps for a while (timing the baseline afresh), then speculation is probed again.
        stats.decisions.append(f"speculation off for {off_tokens} tokens after {stats.rounds} rounds: predicted "
                               f"speedup {gain:.2f}")
        log.info(stats.decisions[-1])
        run = {}
        yield from plain_steps(model, cache, y, sampler, drafter, history, off_tokens, run)
        y, tuner.t1 = run["y"], run["step_s"]
        off_tokens, next_check = min(2 * off_tokens, MAX_OFF_TOKENS), stats.rounds + PROBE_ROUNDS
