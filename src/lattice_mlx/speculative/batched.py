"""MTP rounds over a continuous batch: every running sequence drafts K tokens with the checkpoint's MTP head, one
target forward verifies all of them ([B, K + 1] rows), and each sequence keeps its own accepted count n_b, its bonus
token and its own rollback.

A round, for B sequences at depth K (shapes: B rows, P pending head slots, V vocabulary), built with array ops only:
- head: each sequence's pending slots (embed(t_{j+1}) paired with the target hidden h_j: the tokens verified in its
  last round, its first n_b + 1 of P valid) in one forward [B, P]; the invalid ones are marked dead in the head's
  cache (cache.RoundKVCache.keep); then K - 1 more head steps [B, 1] on its own hiddens, trimmed afterwards;
- verify: [y_b, d_1 .. d_K] through the target, the GDN layers recording every step's state;
- accept: greedy, the leading drafts equal to the target's argmax; sampled, min(1, p/q) per draft with the residual
  resample (sample.accept_sampled_arrays), per sequence;
- rollback per sequence, on the device: attention columns past n_b + 1 marked dead (RoundKVCache.keep: no copy), the
  GDN layers' caches keep the verify's whole conv input and per-step states with each sequence's [n_b + 1, n_b]
  (`gpick` [B, 2], every layer's `window_pick`), and the next round's GDN kernel reads each sequence's window and
  state there in place (metal/gated_delta.py `picked`): no gather of the states (the third dearest kernel of a
  16-sequence round: docs/adr/0009). A plain step gathers them first (`_settle`); a
  joining sequence's caches are padded to that form (its window at row 0, its state at step 0) and a leave takes
  the remaining rows' picks along; the next round's pending slots are this round's K + 1 tokens and hiddens with
  n_b + 1 valid, and its newest token the bonus.
Nothing in a round is read back: round r + 1 is dispatched on round r's device arrays before the host reads round r's
tokens (the host builds one round while the device runs the other), so a sequence that ends inside round r (its
budget, a stop token) still has a row in round r + 1, whose tokens for it are discarded, and the others' are exact.
A join or a cancel reads the queued round first.

Greedy output equals each sequence's plain greedy decoding (fp32; tests/speculative/test_batched.py); sampled output
keeps the plain distribution per sequence. With `adaptive`, the pipelined tuner (tuning.PipelinedTuner: a pass's
cost is the time between two reads, paired against plain steps; acceptance read two passes after a dispatch) picks
K or plain steps for the batch as a whole, with its costs kept per batch size (a power-of-two bucket); before plain
steps the pending head slots go into the head's cache, and the plain steps' own slots wait for the next round.
"""

import contextlib
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from .. import cache as caches
from .. import traces
from ..batch import BatchDecoder, Sequence, filter_rows, join_rows
from ..decode import tracing_enabled as decode_tracing_enabled
from ..metal import iota, kernel_policy
from ..metal.argmax import argmax
from ..metal.gated_delta import picked
from ..models import compiled
from ..runtime import runtime_of
from ..sample import Sampler, accept_sampled_arrays, sample_from, split_keys
from .drafters import feed_head
from .options import SpecStats
from .pipelined import tracing_enabled
from .tuning import OFF_HOPE, PipelinedTuner, tuner_rates


def _rounds_layout(cache: list) -> list:
    """Batch caches with their attention layers as RoundKVCache (the others as they are)."""
    return [caches.RoundKVCache.of(c) if type(c) is BatchKVCache else c for c in cache]


class _PlainOwner:
    """The owner of a traced plain step of BatchRounds (traces.call reads and sets its state): the engine's caches,
    newest tokens and keys, not the head's slots."""

    def __init__(self, engine: "BatchRounds"):
        self.engine = engine

    def _state(self) -> list:
        return self.engine._plain_state()

    def _set_state(self, arrays: list) -> None:
        self.engine._set_plain_state(arrays)


class BatchRounds(BatchDecoder):
    """A BatchDecoder whose steps are MTP rounds of depth `k` (every step advances each running sequence by 1 to
    k + 1 tokens), queued one ahead."""

    PROMPT_HIDDEN = True

    def __init__(self, model, *, k: int, adaptive: bool = False, **kwargs):
        if not getattr(model, "has_mtp", False):
            raise ValueError("batched MTP rounds need a checkpoint with an MTP head")
        if model.mtp.draft_vocab is not None:
            raise ValueError("batched MTP rounds draft over the whole vocabulary: this head has a draft vocabulary")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        super().__init__(model, **kwargs)
        self._split_k(self.max_batch * (k + 1))  # (a verify's rows: K + 1 per sequence)
        self.k = self.k_max = k
        self.adaptive = adaptive
        # adaptive: one tuner's costs per batch size bucket (a round's extra rows cost more in a larger batch), kept
        # on the model as a single generation's tuner keeps its costs (tuning.tuner_memory), so the engines of later
        # batch_generate calls start from them; acceptance is the batch's, over every round since this engine started
        self.memories: dict[int, dict] = runtime_of(model).tuner.setdefault("batch", {})
        self.tuner, self.bucket = None, 0
        self.stats = SpecStats(draft_tokens=k)
        self.head_cache: list | None = None
        # device state of the running rows: the newest token y [B] (not fed yet); the head's pending slots, tokens
        # [B, P] and target hiddens [B, P, H], of which each row's first `pn` [B] are valid; the generated count
        # `gen` [B] (y's index among the sequence's tokens, + 1)
        self.y = self.ptok = self.phid = self.pn = self.gen = None
        self.holes = False  # whether some row has fewer than P valid pending slots (after a round or a join)
        self.tail: list[tuple[mx.array, mx.array]] = []  # plain steps' slots not yet in ptok / phid (_pending)
        # after a round: each row's [n + 1, n] [B, 2], where the GDN layers' next forward reads its conv window and
        # state in their caches (the verify's whole conv input and per-step states: every layer's `window_pick`)
        self.gpick: mx.array | None = None
        self._queued: tuple | None = None  # the dispatched pass not read yet: (k, n [B], tokens [B, k + 1])
        # (the K of the last pass dispatched, when, the batch size), for the tuner; whether that pass replayed a trace
        self._tic: tuple[int, float, int] | None = None
        self._replayed = False
        self._outside = 0.0  # seconds spent prefilling since that dispatch (not the passes' cost)
        self._values: mx.array | None = None  # the rows' sampler numbers [B, 3] inside a traced round
        self._numbers: tuple | None = None  # (the samplers, their numbers [B, 3]) of the last traced round
        self._shape: tuple | None | bool = False  # _structure() of the running batch (False: to work out)
        self._no_drafts: mx.array | None = None  # a plain pass's accepted counts [B] (zeros, kept per batch size)
        self.rounds = self.drafted = self.accepted = 0

    # --- joins and leaves -----------------------------------------------------------------------------------------

    def _join(self, seq: Sequence, cache: list, hidden: mx.array) -> None:
        if self.gpick is not None:  # the newcomer's GDN caches in the running rows' form: its window rows 0 .., step 0
            for mine, new in zip(self.cache, cache):
                if isinstance(new, caches.GDNCache):
                    new.conv = mx.pad(new.conv, [(0, 0), (0, mine.conv.shape[1] - new.conv.shape[1]), (0, 0)])
                    new.ssm = mx.pad(new.ssm[:, None], [(0, 0), (0, mine.ssm.shape[1] - 1)] + [(0, 0)] * 3)
        super()._join(seq, cache, hidden)  # (reads the queued pass first)
        if self.gpick is not None:
            self._set_gpick(mx.concatenate([self.gpick, mx.zeros((1, 2), mx.int32)]))
        self._shape = False
        self.cache = _rounds_layout(self.cache)
        # the prompt's slots: embed(t_{j+1}) with h_j; all but the last go in now, the last with the first round
        head = self.model.mtp.make_cache()
        tokens = [*seq.prompt[1:], seq.tokens[-1]]
        if len(tokens) > 1:
            feed_head(self.model, tokens[:-1], hidden[:-1], head)
        self.head_cache = _rounds_layout(join_rows(self.head_cache, head))
        tok = mx.array([[tokens[-1]]], dtype=mx.int32)
        hid = hidden[-1:][None].astype(self.phid.dtype if self.phid is not None else hidden.dtype)
        y = mx.array([seq.tokens[-1]], dtype=mx.int32)
        gen = mx.array([len(seq.tokens)], dtype=mx.int32)
        if self.y is None:
            self.y, self.ptok, self.phid, self.pn, self.gen = y, tok, hid, mx.ones((1,), mx.int32), gen
        else:  # its one slot padded to the others' P (a slot at least: between passes P is never 0)
            self._pending()
            P = self.ptok.shape[1]
            self.ptok = mx.concatenate([self.ptok, mx.pad(tok, [(0, 0), (0, P - 1)])])
            self.phid = mx.concatenate([self.phid, mx.pad(hid, [(0, 0), (0, P - 1), (0, 0)])])
            self.pn = mx.concatenate([self.pn, mx.ones((1,), mx.int32)])
            self.y, self.gen = mx.concatenate([self.y, y]), mx.concatenate([self.gen, gen])
            self.holes = self.holes or P > 1
        self._joined(seq)

    def _joined(self, seq: Sequence) -> None:
        """A hook for subclasses: `seq` is the newest row."""

    def _drop(self, rows: list[int]) -> list[int] | None:
        keep = super()._drop(rows)
        if keep is None:
            return None
        self._shape = False
        if not keep:
            self.head_cache = self.y = self.ptok = self.phid = self.pn = self.gen = self.gpick = None
            self._queued, self.holes, self.tail, self._tic, self._outside = None, False, [], None, 0.0
            return keep
        idx = mx.array(keep, dtype=mx.int32)
        filter_rows(self.head_cache, keep)
        if self.gpick is not None:  # (filter_rows took the GDN caches' rows)
            self._set_gpick(self.gpick[idx])
        self._pending()
        self.y, self.ptok, self.phid, self.pn, self.gen = (a[idx] for a in (self.y, self.ptok, self.phid, self.pn,
                                                                             self.gen))
        if self._queued is not None:  # the queued pass's rows too
            k, n, tokens = self._queued
            self._queued = (k, n[idx], tokens[idx])
        return keep

    def _flush(self) -> None:
        """Reads the queued pass before the batch changes (a sequence joins or is cancelled)."""
        if self._queued is not None:
            self._flushed += self._read(*self._queued)
            self._queued, self._tic = None, None

    def _discard(self) -> None:
        self._queued, self._tic = None, None

    def _prefill(self):
        tic = time.perf_counter()
        try:
            return super()._prefill()
        finally:
            self._outside += time.perf_counter() - tic

    # --- a pass ---------------------------------------------------------------------------------------------------

    def _advance(self) -> list[tuple[Sequence, int]]:
        """Dispatches the next pass (a round at the depth chosen, 0: a plain step) on the device state the queued
        one leaves, then reads the queued one; with none queued, dispatches one and reads it."""
        if self._queued is None:
            self._queued = self._dispatch_pass(self._choose_k() if self.adaptive else self.k_max)
            self._tic = None  # (the next pass is dispatched at once: the time between the two is not a pass's cost)
        queued = self._queued
        # no pass ahead where the queued one may end every sequence (it gives each 1 to k + 1 tokens): the pass
        # ahead would likely be thrown away, where not queuing it costs one pass without overlap
        ending = all(len(s.tokens) + queued[0] + 1 >= s.max_tokens for s in self.active)
        self._queued = None if ending else self._dispatch_pass(self._choose_k() if self.adaptive else self.k_max)
        return self._read(*queued)

    def _choose_k(self) -> int:
        """The depth of the next pass from the tuner of this batch size's bucket (a power of two), after timing the
        pass dispatched before (the time since its dispatch, less any prefill: in the steady state one pass lasts
        what a pass costs, host or device)."""
        tic = time.perf_counter()
        bucket = 1 << (len(self.active) - 1).bit_length()
        if bucket != self.bucket:
            self.bucket, self._tic = bucket, None
            self.tuner = PipelinedTuner(self.k_max, self.memories.setdefault(bucket, {}), self.has_trace, lag=2)
        if self._tic is not None:
            k, start, size = self._tic
            self.tuner.observe(k, tic - start - self._outside)
            if k and self._replayed:  # (that pass replayed the trace at this bucket)
                runtime_of(self.model).batch_sizes.add(self._trace_size_key(k, size))
        k = self.tuner.next_k(tuner_rates(self.stats), lambda: tuner_rates(self.stats, OFF_HOPE))
        self._tic, self._outside = (k, tic, len(self.active)), 0.0
        return k

    def has_trace(self, k: int) -> bool:
        """Whether a round of depth k replayed a trace at this batch-size bucket in this process before (k = 0, or
        rounds that are not traced: no compile either way). MLX traces a round again for each batch size, and a
        depth's first passes (built op by op, the trace compiled, the first replays) are not its cost: the tuner,
        one per bucket, leaves FIRST_TRACE_SKIP more of them untimed after a change to a depth without a trace
        (tuning.py; a single generation's depth the same, docs/adr/0008, 'Run H'). Kept per bucket, as the tuner's
        costs are: a new exact size inside a bucket retraces with its passes timed, as before."""
        if not k or not tracing_enabled() or not self._replayable():
            return True
        return self._trace_size_key(k, len(self.active)) in runtime_of(self.model).batch_sizes

    def _trace_size_key(self, k: int, size: int) -> tuple:
        """What a traced round of depth k at `size` rows is known by (Runtime.batch_sizes): as the trace's own key,
        with the batch-size bucket."""
        return type(self), k, self._structure(), kernel_policy(), 1 << (size - 1).bit_length()

    def _dispatch_pass(self, k: int) -> tuple[int, mx.array, mx.array]:
        if k:
            self._pending()
        self._replayed = bool(k) and self._traceable(k)
        out = (self._replay(k) if self._replayed else self._round(k)) if k else self._plain()
        mx.async_eval(out[1], out[2])
        return out

    # --- traced rounds --------------------------------------------------------------------------------------------
    # A steady-state round (the rows' samplers of one structure, their K + 1 pending slots from a round of the same
    # K) is one mx.compile trace replayed every round, as a single generation's rounds are (pipelined.py): the
    # caches' arrays (RoundKVCache with `whole`: the write column on the device), the newest tokens, the pending slots
    # and the rows' PRNG keys go in and out as arguments, the rows' sampler numbers (temperature, top-p, min-p) in.
    # Each batch size and buffer capacity is a trace of its own (MLX traces again for new shapes).

    def _structure(self) -> tuple | None:
        """The rows' one sampler structure (Sampler.structure), None where they have several or a subclass's; worked
        out again only when the batch changes (asked several times a pass)."""
        if self._shape is False:
            samplers = [s.sampler for s in self.active]
            shapes = {x.structure() for x in samplers} if all(type(x) is Sampler for x in samplers) else set()
            self._shape = shapes.pop() if len(shapes) == 1 else None
        return self._shape

    def _replayable(self) -> bool:
        """What a traced round and a traced plain step both need: one sampler structure, one process, no hidden
        tap."""
        return (self._structure() is not None and getattr(self.model, "sharding_group", None) is None
                and runtime_of(self.model).hidden_tap is None)

    def _traceable(self, K: int) -> bool:
        """The steady state: K + 1 pending slots and the GDN caches a round of depth K left (`gpick`)."""
        return (tracing_enabled() and self.ptok.shape[1] == K + 1 and self._replayable()
                and self.gpick is not None and all(c.ssm.shape[1] == K + 1 for c in self._gdn())
                and all(c.keys is not None for c in self.head_cache))

    def _gdn(self) -> list:
        return [c for c in self.cache if isinstance(c, caches.GDNCache)]

    def _set_gpick(self, pick: mx.array | None) -> None:
        self.gpick = pick
        for c in self._gdn():
            c.window_pick = pick

    def _settle(self) -> None:
        """The GDN caches as plain windows and states (each row's picked ones gathered), before a plain step."""
        if self.gpick is None:
            return
        for c in self._gdn():  # (the verify's conv input holds the window, then its K + 1 rows)
            c.conv, c.ssm = picked(c.conv, c.ssm, self.gpick, c.conv.shape[1] - c.ssm.shape[1])
        self._set_gpick(None)

    def _model_kv(self) -> list:
        return [c for c in self.cache if isinstance(c, caches.RoundKVCache)]

    def _round_kv(self) -> list:
        return self._model_kv() + list(self.head_cache)

    def _cache_state(self, kv: list) -> list[mx.array]:
        """The arrays of the round caches `kv` and of the GDN layers, as a trace carries them."""
        out = [a for c in kv for a in (c.keys, c.values, c.live, c.offset, c.pos)]
        out += [a for c in self._gdn() for a in (c.conv, c.ssm)]
        return out + ([self.gpick] if self.gpick is not None else [])

    def _set_cache_state(self, kv: list, it) -> None:
        """Takes what _cache_state(kv) gave from `it`."""
        for c in kv:
            c.keys, c.values, c.live, c.offset, c.pos = (next(it) for _ in range(5))
        for c in self._gdn():
            c.conv, c.ssm = next(it), next(it)
        if self.gpick is not None:
            self._set_gpick(next(it))

    def _state(self) -> list[mx.array]:
        out = [self.y, self.ptok, self.phid, self.pn, self.gen, self._keys]
        return out + self._cache_state(self._round_kv()) + self._more_state()

    def _set_state(self, arrays: list) -> None:
        it = iter(arrays)
        self.y, self.ptok, self.phid, self.pn, self.gen, self._keys = (next(it) for _ in range(6))
        self._set_cache_state(self._round_kv(), it)
        self._set_more_state(it)

    def _more_state(self) -> list[mx.array]:
        """A subclass's own arrays a round reads and writes (traced rounds carry them)."""
        return []

    def _set_more_state(self, it) -> None:
        """Takes what _more_state gave from `it`."""

    def _trace(self, K: int):
        def body(rounds: "BatchRounds", state: list, extras: list):
            rounds._set_state(state)
            rounds._values = extras[0] if extras else None  # (sampled: the rows' numbers, an input)
            try:
                with compiled.forced(False):  # the per-layer traces would add nothing inside this one
                    _, n, tokens = rounds._round(K)
            finally:
                rounds._values = None
            return rounds._state(), n, tokens

        def fallback(state: list, extras: list):
            B = state[0].shape[0]
            return list(state), mx.zeros((B,), mx.int32), mx.zeros((B, K + 1), mx.int32)

        return traces.compile_traced(body, fallback, [mx.random.state, self.model.state])

    def _sampler_numbers(self) -> mx.array:
        """[temp, top_p, min_p] of every row, [B, 3]; made again only when the rows' samplers change."""
        samplers = tuple(s.sampler for s in self.active)
        if self._numbers is None or len(self._numbers[0]) != len(samplers) or \
                any(a is not b for a, b in zip(self._numbers[0], samplers)):
            self._numbers = (samplers, mx.stack([x.values() for x in samplers]))
        return self._numbers[1]

    def _plain_traceable(self) -> bool:
        return decode_tracing_enabled() and self._replayable()

    def _plain_state(self) -> list[mx.array]:
        return [self.y, self._keys, self.pn, self.gen] + self._cache_state(self._model_kv())

    def _set_plain_state(self, arrays: list) -> None:
        it = iter(arrays)
        self.y, self._keys, self.pn, self.gen = (next(it) for _ in range(4))
        self._set_cache_state(self._model_kv(), it)

    def _replay_plain(self) -> tuple[mx.array, mx.array]:
        """A plain step from its trace (made on first use): (the next tokens [B], the hiddens [B, 1, H])."""

        def make():  # (kept with the model: the engine it runs is the owner of the call, not this one)
            def body(owner: _PlainOwner, state: list, extras: list):
                engine = owner.engine
                engine._set_plain_state(state)
                engine._values = extras[0] if extras else None
                try:
                    with compiled.forced(False):
                        y, hidden = engine._plain_body()
                finally:
                    engine._values = None
                return engine._plain_state(), y, hidden

            def fallback(state: list, extras: list):
                B, H = state[0].shape[0], self.model.args.hidden_size
                return list(state), mx.zeros((B,), mx.int32), mx.zeros((B, 1, H))

            return traces.compile_traced(body, fallback, [mx.random.state, self.model.state])

        structure = self._structure()
        key = (type(self), 0, structure, kernel_policy())
        cached, _ = traces.cached(self.model, "batch_rounds", key, make)
        extras = [] if structure[0] else [self._sampler_numbers()]
        with self._columns_on_device(self._model_kv(), 1):
            return traces.call(cached, key, _PlainOwner(self), [], extras)

    @contextlib.contextmanager
    def _columns_on_device(self, kv: list, advance: int):
        """Around a replay: the round caches `kv` write at their device-side column (`whole`, `pos` from _idx); after
        it, the host counts a replay does not run the Python of (the caches' _idx, the GDN layers' offsets) advance
        by `advance` columns, by none where the replay raised."""
        gdn = [c for c in self.cache if isinstance(c, caches.GDNCache)]
        for c in kv:
            c.pos, c.whole = mx.array(c._idx, dtype=mx.int32), True
        idx, offsets = [c._idx for c in kv], [c.offset for c in gdn]
        ran = 0
        try:
            yield
            ran = advance
        finally:
            for c, i in zip(kv, idx):
                c._idx, c.whole = i + ran, False
            for c, offset in zip(gdn, offsets):
                c.offset = offset + ran

    def _replay(self, K: int) -> tuple[int, mx.array, mx.array]:
        """A round of depth K from its trace (made on first use): (K, n [B], tokens [B, K + 1])."""
        for c in self.cache:
            if isinstance(c, caches.RoundKVCache):
                c.reserve(K + 1)
        for c in self.head_cache:  # its K + 1 slots, then draft rows (as _feed_head reserves)
            c.reserve(K + 1 + self.k_max)
        self.holes = True  # (the trace marks the invalid pending slots dead whatever: pn says which they are)
        structure = self._structure()
        extras = [] if structure[0] else [self._sampler_numbers()]
        key = (type(self), K, structure, kernel_policy())
        cached, _ = traces.cached(self.model, "batch_rounds", key, lambda: self._trace(K))
        with self._columns_on_device(self._round_kv(), K + 1):  # (the head's columns advance K + 1 too)
            n, tokens = traces.call(cached, key, self, [], extras)
        self.k, self.holes = K, True
        return K, n, tokens

    def _read(self, k: int, n: mx.array, tokens: mx.array) -> list[tuple[Sequence, int]]:
        """A dispatched pass's tokens, taken by their sequences (a sequence that ended takes none)."""
        ns, rows = n.tolist(), tokens.tolist()
        out = []
        for s, m, row in zip(self.active, ns, rows):
            if s.done:
                continue
            for t in row[: m + 1]:
                s._take(t)
                out.append((s, t))
                if s.done:
                    break
            if k:
                self.stats.record(k, m)
        if k:
            self.rounds += 1
            self.drafted += len(ns) * k
            self.accepted += sum(ns)
        self._last = [row[m] for row, m in zip(rows, ns)]
        return out

    def _pending(self) -> None:
        """The plain steps' slots (`tail`) appended to the pending ones, once, where a round or a change of the
        batch needs them as arrays (a plain step appends nothing: the copy per step would grow with the stretch)."""
        if self.tail:
            toks, hids = zip(*self.tail)
            self.ptok = mx.concatenate([self.ptok, *toks], axis=1)
            self.phid = mx.concatenate([self.phid, *(h.astype(self.phid.dtype) for h in hids)], axis=1)
            self.tail = []

    def _feed_head(self) -> mx.array:
        """The pending slots through the head [B, P] (the invalid ones marked dead in its cache); returns its
        output [B, P, H]. Nothing is pending afterwards."""
        self._pending()
        head, model = self.model.mtp, self.model
        for c in self.head_cache:
            c.reserve(self.ptok.shape[1] + self.k_max)
        x = head(model.model.embed_tokens(self.ptok), head.from_target(self.phid), self.head_cache)
        if self.holes:
            for c in self.head_cache:
                c.keep(self.pn)
        self.ptok, self.phid, self.holes = self.ptok[:, :0], self.phid[:, :0], False
        self.pn = mx.zeros_like(self.pn)
        return x

    def _draft(self, K: int, keys: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """drafts [B, K] and, where any sequence samples, the head's distributions q [B, K, V]; `keys` [B, K + 1, 2]:
        each sequence's keys for the round (its K drafts' draws, then the acceptance's), where any samples."""
        model, head = self.model, self.model.mtp
        B, pn = len(self.active), self.pn
        x = self._feed_head()
        x = x[iota(B), pn - 1][:, None]  # each row's last valid slot [B, 1, H]
        sampled = keys is not None
        drafts, qs, h = [], [], None
        for step in range(K):
            if step:  # the next slot: the last draft with the head's own hidden
                x = head(model.model.embed_tokens(drafts[-1][:, None]), h, self.head_cache)
            post = head.norm(x)
            logits = model.lm_logits(head.to_target(post))[:, -1]  # [B, V]
            h = post if head.input_hidden == "post" else x
            if sampled and self._one_sampled():  # every row sampled, one structure: [B, V] at once
                q = self._probs_rows(logits)
                d = sample_from(q, keys[:, step])
                qs.append(q)
            elif sampled:
                # q [B, V]: a greedy sequence's row is never read (its drafts are checked against the argmax)
                q = mx.stack([self._probs(b, logits[b]) if not s.sampler.greedy else logits[b]
                              for b, s in enumerate(self.active)])
                d = mx.stack([sample_from(q[b], keys[b, step]) if not s.sampler.greedy else
                              argmax(logits[b]) for b, s in enumerate(self.active)])
                qs.append(q)
            else:
                d = argmax(logits)  # (one kernel per row on a GPU, as a plain step's greedy pick: metal/argmax.py)
            drafts.append(d.astype(mx.int32))
        for c in self.head_cache:  # the K - 1 rows built on the head's own hiddens
            c.trim(K - 1)
        return mx.stack(drafts, axis=1), (mx.stack(qs, axis=1) if qs else None)

    def _plain(self) -> tuple[int, mx.array, mx.array]:
        """One plain step of every running sequence; its token and hidden join the sequence's pending head slots
        (the slots a round left go into the head's cache first). Replayed from a trace where steps are traced
        (LATTICE_TRACE_STEPS) and the rows' samplers have one structure, as a plain batch's steps are."""
        if self.holes:
            self._feed_head()
        self._settle()
        for c in self.cache:
            if isinstance(c, caches.RoundKVCache):
                c.reserve(1)
        if self._plain_traceable():
            y, hidden = self._replay_plain()
        else:
            y, hidden = self._plain_body()
        self.tail.append((y[:, None], hidden))
        if self._no_drafts is None or self._no_drafts.shape != y.shape:
            self._no_drafts = mx.zeros(y.shape, mx.int32)
        return 0, self._no_drafts, y[:, None]

    def _plain_body(self) -> tuple[mx.array, mx.array]:
        """The step's forward and tokens: (the next tokens [B], the hiddens [B, 1, H]); y, the keys and the pending
        and generated counts advance."""
        logits, hidden = self.model(self.y[:, None], self.cache, return_hidden=True)
        logits = logits[:, -1]
        if self._values is not None and not self._structure()[0]:  # (traced, sampled: the rows' numbers an input)
            self._keys, use = split_keys(self._keys)
            y = sample_from(self._probs_rows(logits), use)
        else:
            y = self._pick(logits)
        self.y, self.pn, self.gen = y.astype(mx.int32), self.pn + 1, self.gen + 1
        return self.y, hidden

    def _round(self, K: int) -> tuple[int, mx.array, mx.array]:
        """One round of depth K for every running sequence, on the device: (K, n [B], tokens [B, K + 1])."""
        self.k = K
        model, B = self.model, len(self.active)
        keys = None
        if not all(s.sampler.greedy for s in self.active):  # one split of each row's key per round
            self._keys, use = split_keys(self._keys)
            keys = mx.vmap(lambda k: mx.random.split(k, K + 1))(use)  # [B, K + 1, 2]
        drafts, q = self._draft(K, keys)
        kv = [c for c in self.cache if isinstance(c, caches.RoundKVCache)]
        gdn = self._gdn()
        for c in kv:
            c.reserve(K + 1)
        for c in gdn:
            c.begin()
        x = mx.concatenate([self.y[:, None], drafts], axis=1)  # [B, K + 1]
        logits, hidden = model(x, self.cache, return_hidden=True)  # [B, K + 1, V], [B, K + 1, H]
        n, tokens = self._accept(logits, drafts, q, keys)
        for c in kv:  # rollback, row by row: keep n_b + 1 of the K + 1 positions
            c.keep(n + 1)
        rows = iota(B)
        for c in gdn:  # the next forward reads row b's window from row n_b + 1, its state at step n_b, in place
            (conv_in,), (states,) = c._conv_in, c._states  # [B, W + K + 1, C], [B, K + 1, Hv, Dv, Dk]
            c.commit()
            c.conv, c.ssm = conv_in, states
        self._set_gpick(mx.stack([n + 1, n], axis=1))
        self.ptok, self.phid, self.pn, self.holes = tokens, hidden, n + 1, True
        self.y, self.gen = tokens[rows, n], self.gen + n + 1
        return K, n, tokens

    def _one_sampled(self) -> bool:
        """Every row samples, and with samplers of one structure: the rows' distributions are one op over the batch."""
        structure = self._structure()
        return structure is not None and not structure[0]

    def _probs_rows(self, logits: mx.array) -> mx.array:
        """Every row's sampling distribution of logits [B, .., V] (_one_sampled), each with its own numbers."""
        values = self._values if self._values is not None else self._sampler_numbers()  # [B, 3]
        values = values.T.reshape(3, -1, *([1] * (logits.ndim - 1)))  # [3, B, 1, ..]: broadcast over the rows
        return self.active[0].sampler.probs(logits, values)

    def _probs(self, b: int, logits: mx.array) -> mx.array:
        """Row b's sampling distribution of logits [.., V]: its sampler's, with its numbers from the traced round's
        input where one runs (`_values` [B, 3])."""
        sampler = self.active[b].sampler
        return sampler.probs(logits) if self._values is None else sampler.probs(logits, self._values[b])

    def _accept(self, logits: mx.array, drafts: mx.array, q: mx.array | None,
                keys: mx.array | None) -> tuple[mx.array, mx.array]:
        """Per sequence, on the device: drafts accepted n [B] and the round's tokens [B, K + 1] (the first n_b + 1:
        the kept drafts, then the next token)."""
        K = drafts.shape[1]
        target = argmax(logits).astype(mx.int32)  # [B, K + 1]
        greedy = mx.cumprod((drafts == target[:, :K]).astype(mx.int32), axis=1).sum(axis=1)
        if q is None:  # every sequence greedy: the kept drafts equal the targets at their rows
            return greedy, target
        if self._one_sampled():  # each row's rule at once (vmap: the same draws as row by row)
            n, _, tokens = mx.vmap(accept_sampled_arrays)(self._probs_rows(logits), q, drafts, keys[:, K])
            return n.astype(mx.int32), tokens.astype(mx.int32)
        ns, rows = [], []
        for b, s in enumerate(self.active):
            if s.sampler.greedy:  # a greedy sequence beside sampled ones: its drafts against the argmax
                ns.append(greedy[b])
                rows.append(target[b])
                continue
            m, _, toks = accept_sampled_arrays(self._probs(b, logits[b]), q[b], drafts[b], keys[b, K])
            ns.append(m)
            rows.append(toks)
        return mx.stack(ns).astype(mx.int32), mx.stack(rows).astype(mx.int32)
