"""Continuous batching: many sequences, one forward per step (docs/adr/0009-batch-cache-layout.md).

A sequence's prompt is prefilled on caches of its own, one chunk per step (decode.prefill_chunks: the chunks a single
generation's prefill runs), between the running batch's steps; after its last chunk its first token is sampled from
those logits and its caches are merged into the batch's: attention rows into left-padded batch caches (mlx-lm's
BatchKVCache: per-sequence RoPE offsets and a padding mask), GDN conv windows and recurrent states stacked on the
batch axis (the recurrence is per row: no padding ever enters a state). With LATTICE_BATCH_PREFILL, prompts waiting
together are prefilled in one forward instead, left-padded to the longest (`_padded`: the pad positions enter no
attention row and no GDN state), each row then joined as its own prefill's. A plain step feeds every running sequence's
last token, [B, 1], through the model once and samples each row with its own sampler (speculative/batched.py runs
MTP rounds instead). A sequence leaves between steps (its token budget, a stop token, a cancel) and its rows are
dropped from the caches; the others' are untouched.

Exactness: a sequence's prefill is its single generation's, and a step's rows do not mix (every op is per row but
the matmuls, whose rows are independent sums); in fp32 a sequence's greedy tokens equal its single generation's
(tests/test_batch.py). On a GPU in bf16 a row's logits may depend on its batch-mates: a batch's attention runs MLX's
masked SDPA where a single generation runs this project's kernel, and the 4-bit matmul changes kernels past 8 rows
(up to 8: this project's kernel, each row bitwise a one-row call; more: MLX's quantized matmul).

Shapes: B running sequences, one token each per step; the batch caches hold [B, Hkv, L, D] keys (left-padded to the
longest) and [B, K-1, C] / [B, Hv, Dv, Dk] GDN arrays.
"""

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from . import cache as caches
from . import settings, traces
from .decode import PREFILL_STEP, prefill_chunks, tracing_enabled
from .metal import cuda_gpu, kernel_policy
from .metal.q4_matmul import MAX_ROWS
from .models import compiled
from .models.layers import prepare_split_k
from .runtime import runtime_of
from .sample import Sampler, split_keys

DEFAULT_MAX_BATCH = 16


@dataclass(eq=False)
class Sequence:
    """One request in a batch: its prompt, budget and sampler, and what it has produced so far."""

    uid: int
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length", "stop" or "cancelled" once it has left
    cached: int = 0  # prompt tokens taken from a prompt cache (not prefilled)
    prefix: object = None  # with keep_prefix: the state after all but its prompt's last token (a PromptCache)
    key: mx.array | None = None  # its PRNG stream's next key [2] until it joins (then a row of the batch's keys)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _take(self, token: int) -> None:
        self.tokens.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"


class BatchDecoder:
    """The running batch of one model: `add` a sequence (it waits to be prefilled), `step` to advance, `cancel` to
    drop one. A step first prefills chunks of the waiting prompts in order (each a single generation's chunk of
    `prefill_step` tokens), `prefill_step` tokens in all at most (one chunk at least), so a long prompt joining
    delays the running sequences by a chunk per step, never by its whole prefill, and short prompts join several at
    a time; a prompt whose last chunk ran samples its first token and joins; then one forward advances every running
    sequence. Rows (running plus waiting) are at most `max_batch`. Not thread-safe: one caller drives it."""

    PROMPT_HIDDEN = False  # whether _join needs the prompt's hiddens (the MTP head's rows: speculative/batched.py)
    # A prompt group's padding (prompts of other lengths left-padded to the longest) is at most this share of the
    # group's forward: padded rows cost the forward's compute where a long prompt makes it the GPU's work
    MAX_PAD_SHARE = 0.25

    def __init__(self, model, *, max_batch: int = DEFAULT_MAX_BATCH, prefill_step: int = PREFILL_STEP):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model, self.max_batch, self.prefill_step = model, max_batch, prefill_step
        self.active: list[Sequence] = []  # row b of the batch caches is active[b]
        # [sequence, its own caches, its prefill's chunks, prompt tokens prefilled so far]
        self.waiting: list[list] = []
        self.cache: list | None = None
        self._last: list[int] = []  # each active sequence's last token: the next step's input
        self._ahead: mx.array | None = None  # a queued plain step's tokens [B], not read yet
        self._flushed: list[tuple[Sequence, int]] = []  # tokens read early (_flush), reported by the next step
        self._steps: BatchSteps | None = None  # the traced plain step of the batch's sampler structure
        self._route: tuple | None = None  # _traced_route() for the running batch (None: to decide)
        self._fingerprint: str | None = None  # the model's (prompt_cache.fingerprint), for kept prefixes
        self._keys: mx.array | None = None  # each active sequence's PRNG key [B, 2] (Sequence.key)
        self._uids = itertools.count()
        self._split_k(max_batch)

    def _split_k(self, rows: int) -> None:
        """On a CUDA device, where a forward may run more rows than the fused 4-bit kernel takes, the 4-bit weights
        of few outputs get their split-K layout (q4_matmul.SplitK: a second copy of those weights), before any step
        is traced."""
        if rows > MAX_ROWS and cuda_gpu():
            prepare_split_k(self.model)

    @property
    def full(self) -> bool:
        return len(self.active) + len(self.waiting) >= self.max_batch

    @property
    def busy(self) -> bool:
        """Whether a step has work: running sequences or prompts still to prefill."""
        return bool(self.active or self.waiting)

    def add(self, prompt: Iterable[int], *, max_tokens: int, sampler: Sampler | None = None,
            stop_ids: Iterable[int] = (), prefix=None, keep_prefix: bool = False, seed: int | None = None,
            key: mx.array | None = None) -> Sequence:
        """Queues `prompt` for its prefill; returns its sequence, whose `tokens` grow as steps run (the first once
        its prefill's last chunk has run). `prefix` (a PromptCache holding a proper prefix of the prompt): only the
        rest is prefilled. `keep_prefix`: the prefill stops before the prompt's last token to leave the state there
        in `Sequence.prefix` (what the next turn of a conversation extends). Neither applies to MTP rounds.
        `seed`: the sequence samples from a PRNG stream of its own (mx.random.key(seed)), one draw per token (per
        round with MTP), so what it samples does not depend on its batch-mates' draws; None: a stream keyed from
        MLX's global generator. `key` (a PRNG key [2], instead of `seed`): the stream from that key on (a stream
        begun elsewhere going on here)."""
        if seed is not None and key is not None:
            raise ValueError("give a sequence a seed or a key, not both")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if self.full:
            raise ValueError(f"the batch is full ({self.max_batch} sequences): step until one leaves")
        seq = Sequence(next(self._uids), prompt, max_tokens, sampler or Sampler(), frozenset(stop_ids),
                       key=key if key is not None else mx.random.key(seed) if seed is not None else _fresh_key())
        n = prefix.covers(prompt) if prefix is not None and not self.PROMPT_HIDDEN else 0
        if n:
            prefix.check(self.model)
            cache, _ = prefix.fork()
        else:
            cache = self.model.make_cache(trimmable=False)
        seq.cached = n
        keep = keep_prefix and not self.PROMPT_HIDDEN and len(prompt) - n >= 2
        chunks = self._kept(seq, cache, n) if keep else prefill_chunks(
            self.model, mx.array(prompt[n:]), cache, step=self.prefill_step, return_hidden=self.PROMPT_HIDDEN)
        # (the last: whether the prompt is one chunk from scratch, which a forward over several prompts may take)
        self.waiting.append([seq, cache, chunks, n, not n and not keep and len(prompt) <= self.prefill_step])
        return seq

    def _kept(self, seq: Sequence, cache: list, n: int):
        """prefill_chunks over the prompt past its first n tokens, with a copy of the state after all but its last
        token left in seq.prefix on the way."""
        from .prompt_cache import PromptCache, fingerprint

        for _ in prefill_chunks(self.model, mx.array(seq.prompt[n:-1]), cache, step=self.prefill_step):
            yield None
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.model)
        copy, _ = PromptCache(seq.prompt[:-1], cache, None, None, self._fingerprint).fork()
        seq.prefix = PromptCache(seq.prompt[:-1], copy, None, None, self._fingerprint)
        yield from prefill_chunks(self.model, mx.array(seq.prompt[-1:]), cache, step=self.prefill_step)

    def _prefill(self) -> list[tuple[Sequence, int]]:
        """Prefill chunks of the waiting prompts, in order, up to `prefill_step` tokens in all (at least one chunk):
        a prompt whose last chunk ran samples its first token and joins. With LATTICE_BATCH_PREFILL, prompts of one
        length at the front of the queue run in one forward (`_group`, `_prefill_group`)."""
        out, budget, ran = [], self.prefill_step, False
        while self.waiting:
            group = self._group(budget)
            if len(group) > 1:
                budget, ran = budget - sum(len(entry[0].prompt) for entry in group), True
                out += self._prefill_group(group)
                continue
            entry = self.waiting[0]
            seq, cache, chunks, done, _ = entry
            cost = min(self.prefill_step, len(seq.prompt) - done)
            if ran and cost > budget:
                break
            budget, ran, entry[3] = budget - cost, True, done + cost
            got = next(chunks)
            if got is None:
                continue
            self.waiting.pop(0)
            out.append(self._start(seq, got[0], cache, got[1]))
        return out

    def _start(self, seq: Sequence, logits: mx.array, cache: list, hidden: mx.array | None) -> tuple[Sequence, int]:
        """A prefilled sequence's first token, sampled from its prompt's last logits [V], and its join (unless that
        token ended it)."""
        seq.key, use = mx.random.split(seq.key)
        seq._take(int(seq.sampler(logits, key=use).item()))
        if not seq.done:
            self._join(seq, cache, hidden)
        return seq, seq.tokens[-1]

    def _group(self, budget: int) -> list[list]:
        """With LATTICE_BATCH_PREFILL: the waiting prompts at the front of the queue that one forward may prefill
        together (each one chunk from scratch, `budget` prompt tokens in all; left-padded to the longest, the
        padding at most MAX_PAD_SHARE of the forward; a single-process model); else, or where fewer than two
        qualify, the first alone."""
        if not settings.on("batch_prefill") or getattr(self.model, "sharding_group", None) is not None:
            return self.waiting[:1]
        group, longest, real = [], 0, 0
        for entry in self.waiting:
            seq, _, _, done, whole = entry
            n = len(seq.prompt)
            padded = (len(group) + 1) * max(longest, n)
            if not whole or done or real + n > budget or padded - real - n > self.MAX_PAD_SHARE * padded:
                break
            group.append(entry)
            longest, real = max(longest, n), real + n
        return group or self.waiting[:1]

    def _prefill_group(self, group: list[list]) -> list[tuple[Sequence, int]]:
        """One forward over the prompts of `group` [G, T] on caches of G rows (fresh, as each prompt's own would
        be), then each row as its own prefill's: its first token sampled from its logits, its caches' row joined.
        Each row is computed as a one-row forward computes it where the ops are per row (on the CPU in float32 the
        same bits: tests/test_batch.py); a GPU's 4-bit matmul over G x T rows may tile them otherwise.

        Prompts of other lengths are left-padded to the longest (`_padded`): a row's attention never reads its pad
        keys and starts its positions at its first real token, and its GDN layers zero the pad positions' inputs
        (nothing enters their state); its rows of the caches then start at its first real token. The same tokens as
        a forward each (in float32 on the CPU; its sums may differ in their last bits where the padding lengthens
        them)."""
        model = self.model
        lengths = [len(entry[0].prompt) for entry in group]
        T = max(lengths)
        pads = [T - n for n in lengths]
        cache = model.make_cache(trimmable=False)
        ids = mx.array([[0] * p + entry[0].prompt for p, entry in zip(pads, group)])
        mask = _padded(cache, pads, T) if any(pads) else None
        h = model.model(ids, cache, mask=mask)
        mx.eval(h, [c.state for c in cache])
        logits = model.lm_logits(h[:, -1:], norm=model.model.norm)[:, -1]  # (as a decode step computes them)
        hidden = model.head_input(h) if self.PROMPT_HIDDEN else None
        del self.waiting[: len(group)]  # (the group is the front of the queue, in its order: _group)
        out = []
        for b, (entry, p) in enumerate(zip(group, pads)):
            entry[2].close()  # (its own prefill never ran)
            out.append(self._start(entry[0], logits[b], row_of(cache, b, p), None if hidden is None else hidden[b, p:]))
        return out

    def _join(self, seq: Sequence, cache: list, hidden: mx.array | None) -> None:
        """The prefilled sequence's caches become its row of the batch's (`hidden`: its prompt's hiddens [T, H],
        with PROMPT_HIDDEN)."""
        self._flush()
        self.cache = join_rows(self.cache, cache)
        self._keys = seq.key[None] if self._keys is None else mx.concatenate([self._keys, seq.key[None]])
        mx.async_eval(self._keys)  # (greedy batches never read them: no graph left growing join by join)
        seq.key = None
        self._route = None
        self.active.append(seq)
        self._last.append(seq.tokens[-1])

    def step(self) -> list[tuple[Sequence, int]]:
        """Prefill chunks if prompts wait, then one forward over every running sequence: (sequence, new token) for
        each token produced; the sequences that ended leave the batch."""
        out = self._prefill() if self.waiting else []
        if self.active:
            out += self._advance()
        out, self._flushed = self._flushed + out, []
        self._drop([b for b, s in enumerate(self.active) if s.done])
        return out

    def _advance(self) -> list[tuple[Sequence, int]]:
        """One plain step of every running sequence, pipelined: the step after it is built and queued on its
        tokens before they are read (the host builds step t + 1 while the device runs step t), unless a sequence's
        budget ends with this token. A sequence a stop token ends is dropped from the queued step afterwards."""
        if self._ahead is None:
            self._ahead = self._dispatch(mx.array(self._last, dtype=mx.int32))
        ys = self._ahead
        ending = any(len(s.tokens) + 1 >= s.max_tokens for s in self.active)
        self._ahead = None if ending else self._dispatch(ys)
        return self._take([int(y) for y in ys.tolist()])

    def _dispatch(self, y: mx.array) -> mx.array:
        """Queues one plain step on tokens y [B] (a device array): the next tokens [B], not read. Replayed from a
        trace where one applies (BatchSteps), else built op by op."""
        if self._route is None:  # (decided again only when the batch changes: nothing added per step)
            self._route = self._traced_route()
        if self._route:
            ys, self._keys = self._steps.step(self.cache, y, self._route, self._keys)
        else:
            ys = self._pick(self.model(y[:, None], self.cache)[:, -1])
        mx.async_eval(ys)
        return ys

    def _traced_route(self) -> tuple[Sampler, ...]:
        """The running sequences' samplers when their steps replay a trace (BatchSteps: tracing on, one sampler
        structure), with self._steps set for it; () when steps are built op by op."""
        samplers = tuple(s.sampler for s in self.active)
        shape = samplers[0].structure() if type(samplers[0]) is Sampler else None
        if shape is None or not BatchSteps.applies(self.model, self.cache) or \
                not all(type(s) is Sampler and s.structure() == shape for s in samplers):
            return ()
        if self._steps is None or self._steps.sampler.structure() != shape:
            self._steps = BatchSteps(self.model, samplers[0])
        return samplers

    def _flush(self) -> None:
        """Reads a queued step before the batch changes (a sequence joins or is cancelled)."""
        if self._ahead is not None:
            ys, self._ahead = self._ahead, None
            self._flushed += self._take([int(y) for y in ys.tolist()])

    def _discard(self) -> None:
        """Drops the queued step unread."""
        self._ahead = None

    def _pick(self, logits: mx.array) -> mx.array:
        """Each running sequence's next token from its row of logits [B, V] (device), a sampled row drawing with
        its own key (the rows' keys advance once, unless every row is greedy)."""
        first = self.active[0].sampler
        if all(s.sampler.greedy for s in self.active):
            return first(logits)
        self._keys, use = split_keys(self._keys)
        if all(s.sampler == first for s in self.active):  # one sampler for all: its ops run row by row on [B, V]
            return first(logits, key=use)
        return mx.stack([s.sampler(logits[b], key=use[b]) for b, s in enumerate(self.active)])

    def _take(self, ys: list[int]) -> list[tuple[Sequence, int]]:
        out = []
        for s, y in zip(self.active, ys):
            if not s.done:  # (a sequence a stop token ended still has a row in a queued step)
                s._take(y)
                out.append((s, y))
        self._last = ys
        return out

    def _sample(self, logits: mx.array) -> list[tuple[Sequence, int]]:
        """Each running sequence's next token from its row of logits [B, V], read and taken."""
        return self._take([int(y) for y in self._pick(logits).tolist()])

    def cancel(self, seq: Sequence) -> None:
        """Drops a running or waiting sequence (finish reason "cancelled"); the others go on untouched."""
        if seq.done:
            return
        if seq in self.active:
            try:
                self._flush()
            except Exception:  # noqa: BLE001 (the queued step failed when read: its tokens are lost with it, and
                self._discard()  # a caller cancelling every sequence after a failed step empties the batch)
            if seq.done:
                return
            seq.finish_reason = "cancelled"
            self._drop([self.active.index(seq)])
            return
        seq.finish_reason = "cancelled"
        self.waiting = [w for w in self.waiting if w[0] is not seq]

    def _drop(self, rows: list[int]) -> list[int] | None:
        """Drops rows of the batch; returns the rows kept (None: nothing dropped)."""
        if not rows:
            return None
        keep = [b for b in range(len(self.active)) if b not in rows]
        self._route = None
        self.active = [self.active[b] for b in keep]
        self._last = [self._last[b] for b in keep]
        if not keep:
            self.cache, self._ahead, self._keys = None, None, None
            return keep
        filter_rows(self.cache, keep)
        self._keys = self._keys[mx.array(keep, dtype=mx.int32)]
        mx.async_eval(self._keys)
        if self._ahead is not None:  # the queued step's rows too
            self._ahead = self._ahead[mx.array(keep, dtype=mx.int32)]
        return keep


def _fresh_key() -> mx.array:
    """A PRNG key [2] drawn from MLX's global generator (a key is two uint32 words)."""
    return mx.random.randint(0, 2**31 - 1, shape=(2,)).astype(mx.uint32)


def filter_rows(cache: list, keep: list[int]) -> None:
    """Keeps rows `keep` of batch caches (attention: BatchKVCache.filter; GDN: its arrays indexed)."""
    idx = mx.array(keep, dtype=mx.int32)
    for c in cache:
        if isinstance(c, BatchKVCache):
            c.filter(idx)
        else:
            c.conv, c.ssm = c.conv[idx], c.ssm[idx]


def join_rows(batch: list | None, cache: list) -> list:
    """One sequence's caches (a layer each) added as the last row of the batch caches `batch` (None: the first)."""
    rows = [batch_layer(c) for c in cache]
    if batch is None:
        return rows
    for mine, new in zip(batch, rows):
        extend(mine, new)
    return batch


def _padded(cache: list, pads: list[int], T: int) -> mx.array:
    """Fresh caches `cache` (one per layer) made ready for a forward of T positions over prompts left-padded by
    `pads`: attention layers get mlx-lm's BatchKVCache (each row's positions start at its first real token), GDN
    layers the valid positions. Returns the attention mask [G, 1, T, T]: causal, no real position reading a pad key;
    a pad position reads itself alone, so that no row of scores is wholly masked (its softmax stays finite, and the
    pad keys and values that real rows weigh by zero are numbers)."""
    t = mx.arange(T)
    valid = t[None] >= mx.array(pads)[:, None]  # [G, T]
    for i, c in enumerate(cache):
        if type(c) is caches.KVCache:
            cache[i] = BatchKVCache(pads)
        elif isinstance(c, caches.GDNCache):
            c.valid = valid
    return (t[:, None] >= t[None]) & (valid[:, None, None, :] | (t[:, None] == t[None]))


def row_of(cache: list, b: int, pad: int = 0) -> list:
    """Row b of caches that a forward over several sequences filled, as that sequence's own caches (`pad`: its left
    padding, left out)."""
    rows = []
    for c in cache:
        if isinstance(c, caches.GDNCache):
            row = caches.GDNCache()
            row.conv, row.ssm, row.offset = c.conv[b : b + 1], c.ssm[b : b + 1], c.offset - pad
        elif type(c) is caches.KVCache:
            row = caches.KVCache()
            row.keys, row.values, row.offset = c.keys[b : b + 1], c.values[b : b + 1], c.offset
        elif type(c) is BatchKVCache:  # (a padded group's: its keys from the row's first real token)
            row = caches.KVCache()
            row.keys, row.values = c.keys[b : b + 1, :, pad : c._idx], c.values[b : b + 1, :, pad : c._idx]
            row.offset = c._idx - pad
        else:
            raise ValueError(f"batched decoding takes plain KV and GDN caches, not {type(c).__name__}")
        rows.append(row)
    return rows


def batch_layer(c):
    """A single sequence's prefilled cache of one layer as a batch cache of one row."""
    if isinstance(c, caches.GDNCache):
        out = caches.GDNCache()
        out.conv, out.ssm = c.conv, c.ssm
        return out
    if type(c) is caches.KVCache:
        return BatchKVCache.merge([c])
    raise ValueError(f"batched decoding takes plain KV and GDN caches, not {type(c).__name__}")


def extend(mine, new) -> None:
    if isinstance(mine, BatchKVCache):
        mine.extend(new)
    else:
        mine.conv = mx.concatenate([mine.conv, new.conv.astype(mine.conv.dtype)])
        mine.ssm = mx.concatenate([mine.ssm, new.ssm])


class BatchSteps:
    """A plain step of the whole batch as one mx.compile trace, replayed every step (decode.TracedSteps for a
    batch): the attention caches become BatchFixedKVCache (the write column on the device, read whole through the
    rows' masks), so a step's shapes change only when the batch does (a sequence joins or leaves: a trace per batch
    size and buffer capacity, kept) or a buffer grows. The samplers' numbers are an input, a row each: one trace
    serves every batch of samplers of one structure (`Sampler.structure`: sequences at other temperatures, top-p
    and min-p share it). Off where tracing is (LATTICE_TRACE_STEPS: on a GPU by default)."""

    def __init__(self, model, sampler: Sampler):
        self.model, self.sampler = model, sampler  # (its structure; the numbers come per row)
        self.key = ("batch", sampler.structure(), kernel_policy())
        self._values: tuple[tuple, mx.array] | None = None  # (the samplers, their numbers [3, B, 1])
        self.cache: list = []  # the batch's caches while a step runs (_bind)
        self.kv: list[caches.BatchFixedKVCache] = []
        self.gdn: list[caches.GDNCache] = []

    @staticmethod
    def applies(model, cache: list) -> bool:
        """Tracing on, one process (no tensor parallel), no hidden tap, batch KV and GDN caches with no verify pick
        pending."""
        return (tracing_enabled() and getattr(model, "sharding_group", None) is None
                and runtime_of(model).hidden_tap is None
                and all(isinstance(c, BatchKVCache) and c.keys is not None or
                        type(c) is caches.GDNCache and c.window_pick is None for c in cache))

    def _bind(self, cache: list) -> None:
        """The batch's caches as this step reads them: attention layers as BatchFixedKVCache sharing layer 0's
        position, lengths and padding arrays (equal in every layer: they join and leave together)."""
        for i, c in enumerate(cache):
            if type(c) is BatchKVCache:
                cache[i] = caches.BatchFixedKVCache.of(c)
        self.cache = cache
        self.kv = [c for c in cache if isinstance(c, caches.BatchFixedKVCache)]
        self.gdn = [c for c in cache if isinstance(c, caches.GDNCache)]
        for c in self.kv[1:]:
            c.pos, c.offset, c.left_padding = self.kv[0].pos, self.kv[0].offset, self.kv[0].left_padding

    def _state(self) -> list[mx.array]:
        out = [self.kv[0].pos, self.kv[0].offset, self.kv[0].left_padding] if self.kv else []
        out += [a for c in self.kv for a in (c.keys, c.values)]
        return out + [a for c in self.gdn for a in (c.conv, c.ssm)]

    def _set_state(self, arrays: list) -> None:
        it = iter(arrays)
        if self.kv:
            pos, offset, left = next(it), next(it), next(it)
            for c in self.kv:
                c.pos, c.offset, c.left_padding = pos, offset, left
        for c in self.kv:
            c.keys, c.values = next(it), next(it)
        for c in self.gdn:
            c.conv, c.ssm = next(it), next(it)

    def _body(self, state: list, extras: list):
        y, values, *keys = extras
        self._set_state(state)
        logits = self.model(y[:, None], self.cache)[:, -1]
        for c in self.kv[1:]:  # (each layer advanced its own copies: one set goes out)
            c.pos, c.offset = self.kv[0].pos, self.kv[0].offset
        if not keys:  # (greedy)
            return self._state(), self.sampler(logits, values)
        keys, use = split_keys(keys[0])
        return self._state(), self.sampler(logits, values, key=use), keys

    def _traced(self):
        def body(steps: "BatchSteps", state: list, extras: list):
            with compiled.forced(False):  # the per-layer traces would add nothing inside this one
                return steps._body(state, extras)

        def fallback(state: list, extras: list):
            return list(state), mx.zeros_like(extras[0]), *extras[2:]

        return traces.compile_traced(body, fallback, [mx.random.state, self.model.state])

    def _numbers(self, samplers: tuple[Sampler, ...]) -> mx.array:
        """[temp, top_p, min_p] of every row, [3, B, 1] (Sampler.probs broadcasts them over [B, V]); made again
        only when the batch's samplers change."""
        if self._values is None or self._values[0] is not samplers:  # (the batch's tuple: new when it changes)
            self._values = (samplers, mx.stack([s.values() for s in samplers], axis=1)[..., None])
        return self._values[1]

    def step(self, cache: list, y: mx.array, samplers: tuple[Sampler, ...],
             keys: mx.array) -> tuple[mx.array, mx.array]:
        """(the next tokens [B] after y [B] (a device array) from one replay, row b sampled by samplers[b] (all of
        this step's structure) with keys[b]; the keys after); the caches advance one column."""
        values = self._numbers(samplers)
        self._bind(cache)
        for c in self.kv:
            c.reserve(1)
        if y.dtype != mx.uint32:  # one input dtype for every call (the samplers' uint32): another is a new trace
            y = y.astype(mx.uint32)
        idx = [c._idx for c in self.kv]
        offsets = [c.offset for c in self.gdn]  # (host counts: a replay does not run the layers' Python)
        cached, _ = traces.cached(self.model, "batch_steps", self.key, self._traced)
        try:
            ys, *after = traces.call(cached, self.key, self, [], [y, values] + ([] if self.sampler.greedy else [keys]))
            advance = 1
        except BaseException:  # (a failed trace: its arrays are as before the call, the host counts too)
            advance = 0
            raise
        finally:
            for c, i in zip(self.kv, idx):
                c._idx = i + advance
            for c, offset in zip(self.gdn, offsets):
                c.offset = offset + advance
            self.cache, self.kv, self.gdn = [], [], []  # (bound again every step: no buffer held past it)
        return ys, (after[0] if after else keys)
