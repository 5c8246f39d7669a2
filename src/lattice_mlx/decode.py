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


def generate_step(model, ids: mx.array, *, sampler: Sampler, cache: list | None = None,
                  prompt_cache=None, logits_processors: list | None = None,
                  max_kv_size: int | None = None) -> Iterator[int]:
    """Plain decoding: one target forward per token; the next step is queued before the current token is yielded.
    `prompt_cache` (prompt_cache.PromptCache): its prefix of `ids` is not prefilled again. `logits_processors`:
    mlx-lm's callables (tokens so far [N], logits [1, V]) -> logits, applied in order before sampling.
    `max_kv_size`: attention layers keep at most that many keys (a sliding window past it)."""
    agree = getattr(model, "agree", lambda x: x)  # tensor parallel: every rank feeds rank 0's token
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
    while True:
        next_y = pick(model(y.reshape(1, 1), cache)[0, -1])
        mx.async_eval(next_y)
        yield y.item()
        y = next_y
