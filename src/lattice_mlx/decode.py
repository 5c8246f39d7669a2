"""The decode floor every loop builds on: chunked prefill and plain one-token-per-forward decoding."""

from collections.abc import Iterator

import mlx.core as mx

from .sample import Sampler

PREFILL_STEP = 512


def prefill(model, ids: mx.array, cache: list, *, step: int = PREFILL_STEP, return_hidden: bool = False):
    """Runs the prompt [T] through the model in chunks; returns the last position's logits [V] and, with
    `return_hidden`, the hidden the MTP head reads at every prompt position [T, H] (else None)."""
    hs = []
    for start in range(0, ids.size, step):
        h = model.model(ids[None, start : start + step], cache)
        mx.eval(h, [c.state for c in cache])  # h too: a pipeline stage's send is in h's graph, not in its cache's
        if return_hidden:
            hs.append(model.head_input(h))
    logits = model.lm_logits(h[:, -1:], norm=model.model.norm)[0, -1]  # as a decode step computes them
    return logits, (mx.concatenate(hs, axis=1)[0] if return_hidden else None)


def generate_step(model, ids: mx.array, *, sampler: Sampler, cache: list | None = None) -> Iterator[int]:
    """Plain decoding: one target forward per token; the next step is queued before the current token is yielded."""
    cache = cache if cache is not None else model.make_cache(trimmable=False)
    agree = getattr(model, "agree", lambda x: x)  # tensor parallel: every rank feeds rank 0's token
    logits, _ = prefill(model, ids, cache)
    y = agree(sampler(logits))
    mx.async_eval(y)
    while True:
        next_y = agree(sampler(model(y.reshape(1, 1), cache)[0, -1]))
        mx.async_eval(next_y)
        yield y.item()
        y = next_y
