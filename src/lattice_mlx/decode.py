"""The decode floor every loop builds on: chunked prefill and plain one-token-per-forward decoding."""

import contextlib
from collections.abc import Iterator

import mlx.core as mx

from . import cache as caches
from . import settings, traces
from .metal import kernel_policy
from .models import compiled
from .runtime import runtime_of
from .sample import Sampler

PREFILL_STEP = 512

# Traced plain steps: a decode step (forward, sampling, cache writes) is one mx.compile trace, replayed every step.
# Building a step's graph in Python is a large part of a step on a fast GPU even with the per-layer traces of
# models/compiled.py, and the GPU then idles (docs/results/code_measurements.md, 'Host-bound decoding, and traces').
# LATTICE_TRACE_STEPS=0 builds every step in Python (layer by layer, or per-layer traces).


def tracing_enabled() -> bool:
    """Traced plain steps unless LATTICE_TRACE_STEPS=0 or `tracing(False)`."""
    return settings.on("trace_steps")


def tracing(on: bool | None):
    """Traced plain steps on / off inside a block (A/B legs, tests; None: as the environment says)."""
    return settings.override(trace_steps=on)


def prefill(model, ids: mx.array, cache: list, *, step: int = PREFILL_STEP, return_hidden: bool = False):
    """Runs the prompt [T] through the model in chunks; returns the last position's logits [V] and, with
    `return_hidden`, the hidden the MTP head reads at every prompt position [T, H] (else None)."""
    for out in prefill_chunks(model, ids, cache, step=step, return_hidden=return_hidden):
        pass
    return out


def prefill_chunks(model, ids: mx.array, cache: list, *, step: int = PREFILL_STEP, return_hidden: bool = False):
    """`prefill` one chunk per `next()` (continuous batching interleaves them with decode steps): None after each
    chunk but the last, then what `prefill` returns."""
    hs = []
    for start in range(0, ids.size, step):
        h = model.model(ids[None, start : start + step], cache)
        mx.eval(h, [c.state for c in cache])  # h too: a pipeline stage's send is in h's graph, not in its cache's
        if return_hidden:
            hs.append(model.head_input(h))
        if start + step < ids.size:
            yield None
    logits = model.lm_logits(h[:, -1:], norm=model.model.norm)[0, -1]  # as a decode step computes them
    yield logits, (mx.concatenate(hs, axis=1)[0] if return_hidden else None)


def resume(model, ids: mx.array, prompt_cache, *, return_hidden: bool = False):
    """(target caches, MTP head caches or None, logits [V], hiddens [T, H] or None, tokens covered): the prefill of
    `ids` on copies of `prompt_cache` when it holds a proper prefix of them, else from scratch. With a prompt cache
    the hiddens start at its last position (the head pairs it with the first new token)."""
    n = prompt_cache.covers(ids.tolist()) if prompt_cache is not None else 0
    if n:
        prompt_cache.check(model)
        cache, mtp = prompt_cache.fork()
    else:
        cache, mtp = model.make_cache(trimmable=False), None
    logits, hidden = prefill(model, ids[n:], cache, return_hidden=return_hidden)
    if n and return_hidden and prompt_cache.hidden is not None:
        hidden = mx.concatenate([prompt_cache.hidden, hidden])
    return cache, mtp, logits, hidden, n


class TracedSteps:
    """Plain decoding's state between steps and the trace of one step. The attention caches become fixed-capacity
    buffers read whole and masked on the device (cache.FixedKVCache: a step's shapes stay the same from step to
    step, and as pipelined MTP rounds read them); the GDN caches are read and written as they are.

    The pipelined MTP loop's plain stretches (speculation off) run these same steps on its caches: `hidden=True`
    also returns the hidden the MTP head pairs with the next token (`hidden="pre"`: that hidden before the
    head's input norm, Model's return_hidden="pre"), and `traced=False` builds each step op by op
    (where tracing does not pay: the CPU backend). A step whose GDN caches still hold a verify's picked state
    (cache.GDNCache.pick: the first step after a round) is built op by op; the steps after it replay the trace."""

    def __init__(self, model, sampler: Sampler, cache: list, *, hidden: bool | str = False, traced: bool = True):
        self.model, self.sampler, self.values = model, sampler, sampler.values()
        self.hidden, self.traced = hidden, traced
        # the trace's key, once per generation (not per token): a Sampler's structure (its numbers are an input; a
        # subclass samples its own way, with a trace of its own), whether it returns the hidden, the kernels switch
        self.key = (sampler.structure() if type(sampler) is Sampler else sampler, hidden, kernel_policy())
        self.cache = [caches.FixedKVCache.from_kv(c) if type(c) is caches.KVCache else c for c in cache]
        self.kv = [c for c in self.cache if isinstance(c, caches.FixedKVCache)]
        self.gdn = [c for c in self.cache if isinstance(c, caches.GDNCache)]
        self.bound = self.kv[0].bound if self.kv else 0  # positions written: an upper bound (exact in plain decoding)
        for c in self.kv:
            c.offset, c.whole = self.kv[0].offset, True  # one offset array for every attention layer

    @staticmethod
    def applies(model, cache: list) -> bool:
        """Whether a step over `cache` can be traced: every cache a plain KV or GDN cache (not a rotating window,
        a pipeline stage's NullCache), every one written by the prefill, no rank agreement (tensor parallel) and no
        hidden tap (make_draft_model's)."""
        return (tracing_enabled() and getattr(model, "sharding_group", None) is None
                and runtime_of(model).hidden_tap is None
                and all(type(c) in (caches.KVCache, caches.GDNCache) for c in cache)
                and all(c.keys is not None if type(c) is caches.KVCache else c.ssm is not None for c in cache))

    def _state(self) -> list[mx.array]:
        out = traces.kv_arrays(self.kv)
        for c in self.gdn:
            out += [c.conv, c.ssm]
        return out

    def _set_state(self, arrays: list) -> None:
        it = iter(arrays)
        traces.set_kv_arrays(self.kv, it)
        for c in self.gdn:
            c.conv, c.ssm = next(it), next(it)

    def _body(self, state: list, extras: list):
        """One step: (state arrays, [y, the sampler's numbers]) -> (state arrays, the next token[, the hidden])."""
        y, values = extras
        self._set_state(state)
        out = self.model(y.reshape(1, 1), self.cache, return_hidden=self.hidden)
        logits, hidden = out if self.hidden else (out, None)
        logits = logits[0, -1]
        # a Sampler's numbers are an input: one trace serves every temperature, top-p and min-p (a subclass samples
        # its own way, with a trace of its own)
        y = self.sampler(logits, values) if type(self.sampler) is Sampler else self.sampler(logits)
        if self.kv:  # one array for all layers: the length the step's positions kernel computed (offset + 1)
            offset = self.kv[0].length
            for c in self.kv:
                c.offset = offset
        return (self._state(), y, hidden[0]) if self.hidden else (self._state(), y)

    def _traced(self):
        def body(steps: "TracedSteps", state: list, extras: list):
            with compiled.forced(False):  # the per-layer traces would add nothing inside this one
                return steps._body(state, extras)

        def fallback(state: list, extras: list):
            y = mx.zeros_like(extras[0])
            return (list(state), y, mx.zeros((1, self.model.args.hidden_size))) if self.hidden else (list(state), y)

        return traces.compile_traced(body, fallback, [mx.random.state, self.model.state])

    def step(self, y: mx.array):
        """The next token after y (a scalar array) from one replay of the trace (and with `hidden`, the hidden
        [1, H] the MTP head pairs with it); the caches advance one row."""
        for c in self.kv:
            c.bound = self.bound
            c.reserve(1)
        # one input shape and dtype for every caller (a scalar, the samplers' uint32): another is a new trace
        if y.ndim or y.dtype != mx.uint32:  # (plain decoding's own token already is: nothing added per step)
            y = y.reshape(()).astype(mx.uint32)
        offsets = [c.offset for c in self.gdn]  # (host counts: a replay does not run the layers' Python)
        if self.traced and all(c.window_pick is None for c in self.gdn):
            cached, _ = traces.cached(self.model, "steps", self.key, self._traced)
            out = traces.call(cached, self.key, self, self.kv, [y, self.values])
        else:  # (a one-off between replays is built layer by layer: no per-layer traces compiled for it alone)
            with compiled.forced(False) if self.traced else contextlib.nullcontext():
                state, *out = self._body(self._state(), [y, self.values])
            caches.FixedKVCache._memo = None
            for c in self.kv:
                c.length = None
            self._set_state(state)
            for c in self.gdn:
                c.window_pick = None
        self.bound += 1
        for c, offset in zip(self.gdn, offsets):
            c.offset = offset + 1
        return tuple(out) if self.hidden else out[0]


def generate_step(model, ids: mx.array, *, sampler: Sampler, cache: list | None = None,
                  prompt_cache=None, logits_processors: list | None = None,
                  max_kv_size: int | None = None) -> Iterator[int]:
    """Plain decoding: one target forward per token; the next step is queued before the current token is yielded.
    `prompt_cache` (prompt_cache.PromptCache): its prefix of `ids` is not prefilled again. `logits_processors`:
    mlx-lm's callables (tokens so far [N], logits [1, V]) -> logits, applied in order before sampling.
    `max_kv_size`: attention layers keep at most that many keys (a sliding window past it)."""
    agree = getattr(model, "agree", lambda x: x)  # tensor parallel: every rank feeds rank 0's token
    own = cache is None
    if cache is None and max_kv_size:
        if prompt_cache is not None:
            raise ValueError("--max-kv-size does not take a prompt cache: drop one of them")
        cache = model.make_cache(trimmable=False, max_kv_size=max_kv_size)
    if cache is None:
        cache, _, logits, _, _ = resume(model, ids, prompt_cache)
    else:
        logits, _ = prefill(model, ids, cache)
    history = ids

    def pick(logits: mx.array) -> mx.array:
        nonlocal history
        if logits_processors:
            logits = logits[None]
            for proc in logits_processors:
                logits = proc(history, logits)
            logits = logits[0]
        y = agree(sampler(logits))
        if logits_processors:
            history = mx.concatenate([history, y.reshape(1).astype(history.dtype)])
        return y

    y = pick(logits)
    mx.async_eval(y)
    # a cache the caller passed is updated in place, so only this loop's own caches go into a trace
    steps = TracedSteps(model, sampler, cache) if own and not logits_processors and \
        TracedSteps.applies(model, cache) else None
    if steps is not None:
        cache = None  # the prefill's attention caches: their rows are in the traced step's buffers now (memory)
    while True:
        next_y = steps.step(y) if steps is not None else pick(model(y.reshape(1, 1), cache)[0, -1])
        mx.async_eval(next_y)
        yield y.item()
        y = next_y
