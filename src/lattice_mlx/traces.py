"""Whole-step traces: a decode step (decode.TracedSteps) or a pipelined MTP round (rounds.PipelinedRounds) as one
`mx.compile` trace, replayed every step, so Python builds its graph once instead of every step.

The owner of a trace keeps its device state (caches' arrays, the newest token, ...) as a list of arrays that goes
into the trace and comes out of it (`_state()` / `_set_state()`); the model's arrays and the PRNG key are captured
inputs, read at every call (weights changed in place are what the next step computes with). A trace that raises
returns placeholders instead (MLX puts its captured inputs back only when the traced function returns), is marked
failed for good, dropped, and its error re-raised once the owner's arrays are as before the call.
"""

from collections.abc import Callable, Iterator

import mlx.core as mx

from .cache import FixedKVCache
from .runtime import runtime_of

MAX_TRACES = 16  # traces kept per model and kind (oldest dropped first): one per K, sampler, draft vocabulary, ...


class Slot:
    """The owner a cached trace builds on when MLX (re)traces it (set only while a call is in progress), and the
    exception a trace raised."""

    owner = None
    error: BaseException | None = None
    failed = False  # a trace that raised holds a placeholder graph: never replayed, whatever happens after


def kv_arrays(kv: list[FixedKVCache]) -> list[mx.array]:
    """Fixed KV caches that advance together as trace state: their one shared offset array, then their buffers."""
    return ([kv[0].offset] if kv else []) + [a for c in kv for a in (c.keys, c.values)]


def set_kv_arrays(kv: list[FixedKVCache], it: Iterator[mx.array]) -> None:
    """Takes what kv_arrays gave from `it`."""
    if kv:
        offset = next(it)
        for c in kv:
            c.offset = offset
    for c in kv:
        c.keys, c.values = next(it), next(it)


def compile_traced(body: Callable, fallback: Callable, captured: list) -> tuple[Callable, Slot]:
    """(the function MLX traces, its slot). body(owner, state, extras) -> the outputs, state first; `fallback(state,
    extras)` the same structure of placeholders, returned when body raised; `captured`: the arrays read at every
    call besides the arguments (the PRNG key is also an output)."""
    slot = Slot()

    def fn(state: list, extras: list):
        try:
            return body(slot.owner, state, extras)
        except BaseException as e:  # noqa: BLE001 (re-raised by call() once MLX has restored its inputs)
            slot.error, slot.failed = e, True
            return fallback(state, extras)

    return mx.compile(fn, inputs=captured, outputs=mx.random.state), slot


def cached(model, kind: str, key: tuple, make: Callable[[], tuple[Callable, Slot]]) -> tuple[dict, tuple]:
    """The model's traces of `kind` (`model.runtime.traces`) and the one for `key`, made when missing."""
    traces = runtime_of(model).traces.setdefault(kind, {})
    if key in traces and traces[key][1].failed:
        del traces[key]
    if key not in traces:
        while len(traces) >= MAX_TRACES:
            traces.pop(next(iter(traces)))
        traces[key] = make()
    return traces, traces[key]


def call(traces: dict, key: tuple, owner, kv: list[FixedKVCache], extras: list) -> list:
    """Runs the trace `traces[key]` on the owner's state; the owner takes the state that comes out. Returns the
    other outputs. `kv`: the owner's fixed KV caches (their per-forward memo is reset after the call)."""
    fn, slot = traces[key]
    before = owner._state()
    slot.owner, slot.error = owner, None
    try:
        state, *rest = fn(before, extras)
    finally:
        slot.owner = None
        FixedKVCache._memo = None
        for c in kv:
            c.length = None
        if slot.failed:
            traces.pop(key, None)
    if slot.error is not None:  # the trace failed: the owner's arrays as before the call, and raise
        error, slot.error = slot.error, None
        owner._set_state(before)
        raise error
    owner._set_state(state)
    return rest
