"""Pipelined MTP rounds (`--verify pipelined`): every decision of a round on the device, and round r + 1 dispatched
before round r is read, so the host builds the next round while the GPU runs this one.

A round of shape K (fixed, or picked per round by PipelinedTuner; K = 0 is a plain step: plain decoding's own traced
step, decode.TracedSteps, the head's slots waiting until a round resumes): the MTP head drafts K tokens; the target
verifies [y, d1..dK] (always K + 1 rows); acceptance picks n (leading matches when greedy; min(1, p/q) with the
residual and bonus draws when sampling) and the next token with array ops; the caches keep n + 1 rows: attention
caches hold their length as a device scalar (cache.FixedKVCache), GDN layers take the state and conv window of step
n from the verify's recorded steps (GDNCache.pick). The MTP head's next round feeds all K + 1 verified rows (rows
past n are stale and are overwritten) and reads its first draft at row n. No `.item()` inside a round: the host
reads a round's tokens one round late, so a stop (end of sequence, max tokens) inside a round discards the overshoot
and the tokens are exactly the synchronous loop's.

Indexing as in chain.py: y is the newest token (position p, not yet fed); MTP slot j pairs embed(t_{j+1})
with the target hidden h_j at RoPE position j.
"""

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator

import mlx.core as mx

from .. import cache as caches
from .. import decode, settings, traces
from ..decode import TracedSteps, resume
from ..metal import kernel_policy
from ..metal.argmax import argmax
from ..metal.gated_delta import picked
from ..models import compiled
from ..runtime import runtime_of
from ..sample import Sampler, accept_sampled_arrays
from .drafters import _pick, feed_head
from .options import SpecOptions, SpecStats
from .tuning import (
    OFF_HOPE,
    PipelinedTuner,
    tuner_memory,
    tuner_rates,
)

log = logging.getLogger("lattice_mlx")

# A device-side draft override for benchmarks and tests (DeviceOracle): (the head's drafts [K], their q [K, V] or
# None, the PipelinedRounds (its y [1], the newest token, and gen, y's generated index, are device arrays), the round
# number) -> (drafts [K], q)
DraftOverride = Callable[[mx.array, "mx.array | None", "PipelinedRounds", int], tuple[mx.array, "mx.array | None"]]


def accept(logits: mx.array, drafts: mx.array, q: mx.array | None, sampler: Sampler,
           values: mx.array | None = None):
    """On the device: logits [K+1, V] of the verify, drafts [K] -> (n accepted [scalar int32], the next token
    [scalar int32], tokens [K+1] whose first n + 1 are the round's output). Greedy: leading drafts equal to the
    argmax. Sampled: sample.accept_sampled_arrays, the rule the synchronous verifiers read back. `values`:
    Sampler.values() as a traced round's input (None: the sampler's own numbers)."""
    K = drafts.shape[0]
    if K == 0:  # a plain step inside the loop (adaptive depth chose no drafts): the token as plain decoding picks it
        token = (sampler(logits[0]) if values is None else sampler(logits[0], values)).astype(mx.int32)
        return mx.array(0, dtype=mx.int32), token, token.reshape(1)
    if sampler.greedy:
        targets = argmax(logits).astype(mx.int32)
        n = mx.cumprod((targets[:K] == drafts).astype(mx.int32)).sum()
        return n, targets[n], targets  # accepted drafts equal the targets at their rows
    p = sampler.probs(logits) if values is None else sampler.probs(logits, values)
    return accept_sampled_arrays(p, q, drafts)


# The round's bookkeeping on device scalars, each compiled into one fused kernel (on a GPU every op is a launch, and
# a round is bound by its launches): after a verify that kept n drafts, the attention offset + n + 1, the GDN pick
# index [n + 1, n, n, n] and the generated count + n + 1; before drafting, the head's offsets for its K steps.
# The pick index is padded to four int32 (the kernel reads the first two): an 8-byte pick made the GDN kernel's launch
# several times slower than the same values at the head of a 16-byte array, for a reason not established
# (docs/results/code_measurements.md, 'Small parameter arrays').
_PICK = mx.array([1, 0, 0, 0], dtype=mx.int32)


@mx.compile
def _after_verify(offset: mx.array, n: mx.array, gen: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    return offset + n + 1, n + _PICK, gen + n + 1


@functools.cache
def _head_offsets(k: int):
    """(the head's offset, n) -> offset + n + 1 + i for i < max(k - 1, 1): the first is where the head's true rows
    end; the draft forward after draft i + 1 writes its scratch row at the i-th."""
    return mx.compile(lambda offset, n: tuple(offset + n + (1 + i) for i in range(max(k - 1, 1))))


# Traced rounds: a steady-state round (the same K as the round before, its K + 1 slots pending for the head) is one
# mx.compile trace, replayed every round: a replay hands MLX the graph for a fraction of the host time that building
# the round in Python takes (docs/results/code_measurements.md, 'Host-bound decoding, and traces'). The caches' arrays, the
# newest token and the head's pending slots go in and out of the trace as arguments; the model's arrays and the PRNG
# key are captured inputs (read at every call: weights changed in place are what the next round computes with).
# LATTICE_TRACE_ROUNDS=0 builds every round in Python.


def tracing_enabled() -> bool:
    """Traced rounds unless LATTICE_TRACE_ROUNDS=0 or `tracing(False)`."""
    return settings.on("trace_rounds")


def tracing(on: bool | None):
    """Traced rounds on / off inside a block (A/B legs, tests; None: as the environment says)."""
    return settings.override(trace_rounds=on)


def _traced_round(model, k: int):
    """(the function MLX traces: (state arrays, the override's device inputs) -> (state arrays, tokens, n), slot)."""

    def body(rounds: "PipelinedRounds", state: list, extras: list):
        override, vocab, values = rounds.override, rounds.model.mtp.draft_vocab, rounds.values
        try:
            rounds._set_state(state)
            if values is not None:  # the sampler's numbers: an input, so one trace serves every temperature
                rounds.values, extras = extras[0], extras[1:]
            if override is not None:
                rounds.override = lambda d, q, rr, r: override.apply(d, q, rr, extras)
            if vocab is not None:
                vocab.pinned = True  # its lm_head rows, gathered before the call, are constants of the trace
            # layer by layer inside the trace: the per-layer traces (models/compiled.py) would add nothing to this
            # one, and tracing them inside it would swap tracers into their captured weights
            with compiled.forced(False):
                tokens, n = rounds.verify(*rounds.draft(0, k))
            return rounds._state(), tokens, n
        finally:
            rounds.override, rounds.values = override, values
            if vocab is not None:
                vocab.pinned = False

    def fallback(state: list, extras: list):
        return list(state), mx.zeros((k + 1,), dtype=mx.int32), mx.array(0, dtype=mx.int32)

    vocab = model.mtp.draft_vocab
    captured = [mx.random.state, model.state] + ([vocab.arrays] if vocab is not None else [])
    return traces.compile_traced(body, fallback, captured)


# The row count of every head forward that catches up on pending slots (the prompt's, a plain stretch's)
CATCH_UP_PIECE = 64
# A change to a deeper depth pads the last round's pending rows and recorded steps instead of settling them
# (PipelinedRounds._settle); 0: settles them as after any other pass
PAD_UPWARD = 1


def warm_catch_up(model) -> None:
    """One head forward over CATCH_UP_PIECE rows on a scratch cache: its kernels compile now (a server's start-up)
    and not inside a generation."""
    head, H = model.mtp, model.args.hidden_size
    mcache = [caches.FixedKVCache.from_kv(c) for c in head.make_cache()]
    for c in mcache:
        c.whole = True
    e = model.model.embed_tokens(mx.zeros((CATCH_UP_PIECE,), dtype=mx.int32))
    hid = mx.zeros((CATCH_UP_PIECE, H), dtype=e.dtype)  # the activations' dtype, as the target's hiddens
    mx.eval(head(e[None], head.from_target(hid)[None], mcache))


def warm_passes(k_max: int) -> list[list[int]]:
    """The depths of the passes `warm_rounds` runs, one list per generation: each depth 1..k_max as a generation's
    first pass (a round right after the prefill, where a process's later generations start: the depth its tuner
    picked last), then plain steps and each depth after them, plain steps after it, and every change from one depth
    to another (each pair, both ways)."""
    depths = range(1, k_max + 1)
    seq = [0] * 3
    for a in depths:
        seq += [a] * 3 + [0] * 2
    for a in depths:
        for b in depths:
            if a != b:
                seq += [a] * 2 + [b] * 2
    return [[k, k, 0] for k in depths] + [seq]


def warm_rounds(model, k_max: int, samplers: tuple[Sampler, ...] = (Sampler(), Sampler(temp=1.0)),
                override: DraftOverride | None = None) -> int:
    """Every kind of pass the adaptive loop can run at depths up to k_max (`warm_passes`), greedy and sampled, on
    scratch caches after a 16-token prompt: each depth's traced round, plain decoding's traced step, and the work
    between passes of different kinds and a generation's first round (built op by op) are compiled now and not
    inside a generation. On MLX's CUDA backend a kind of pass not run before on the machine compiled kernels for
    2.3-2.8 s in the middle of a generation (docs/adr/0008, 'Runs N and O'); the builds are kept on disk, the traces
    only in this process. The PRNG's key is as before (a seeded generation after it samples as without it).
    `override`: the drafts of the generations to come replaced as theirs will be (a benchmark's synthetic drafts add
    work of their own to each kind of pass, compiled with it). Returns the passes run."""
    ids = mx.array([(7 * i + 3) % model.args.vocab_size for i in range(16)])
    hi, lo = mx.random.state[0].tolist()
    passes = 0
    try:
        for sampler in samplers:
            for seq in warm_passes(k_max):
                cache, _, logits, hidden, _ = resume(model, ids, None, return_hidden=True)
                first = sampler(logits)
                rounds = PipelinedRounds(model, sampler, k_max, ids.tolist(), first, hidden, cache, override)
                verified = 0
                for r, k in enumerate(seq):
                    rounds.bounds(r, verified)
                    tokens, n = rounds.round(r, k)
                    mx.eval(tokens, n) if k else mx.eval(tokens)
                    verified += (n.item() if k else 0) + 1
                    passes += 1
        runtime_of(model).rounds_run = True
    finally:
        mx.random.seed((hi << 32) | lo)  # (the key [hi, lo] again: mx.random.key(s) is [s >> 32, s & 0xffffffff])
    return passes


class PipelinedRounds:
    """The device state between rounds and the graph of one round; `run_pipelined` drives it."""

    def __init__(self, model, sampler: Sampler, k: int, prompt: list[int], first: "int | mx.array",
                 hidden: mx.array, cache: list, override: DraftOverride | None = None, *, prompt_len: int | None = None,
                 head_cache: list | None = None):
        """`prompt`: the prompt's tokens from the first one `hidden` [T, H] pairs with (all of them, or with a prompt
        cache the new ones from its last cached position on); `first`: the first generated token (or the scalar
        array that will hold it: nothing here reads it); `prompt_len`: the whole prompt's length (default
        len(prompt)); `head_cache`: the MTP head's caches of the cached prefix (None: a fresh cache)."""
        self.model, self.sampler, self.k, self.override = model, sampler, k, override
        # a Sampler's numbers (temperature, top-p, min-p), an input of a traced round (a subclass: its own numbers)
        self.values = sampler.values() if type(sampler) is Sampler else None
        # The head's prompt slots are not fed now: they wait with the plain steps' slots until the first round drafts
        # (`_catch_up`), so a generation that never speculates (adaptive depth found it cannot pay) never runs the
        # head over the prompt (on the CPU that was 0.67 s for a 1,900-token prompt, inside the first tokens).
        mcache = head_cache if head_cache is not None else model.mtp.make_cache()
        self.m0 = mcache[0].offset  # the head's rows before the first round
        self.mcache = [caches.FixedKVCache.from_kv(c) for c in mcache]
        self.cache = [caches.FixedKVCache.from_kv(c) if isinstance(c, caches.KVCache) else c for c in cache]
        self.kv = [c for c in self.cache if isinstance(c, caches.FixedKVCache)]
        self.gdn = [c for c in self.cache if isinstance(c, caches.GDNCache)]
        for c in self.kv:  # one offset array for every attention layer (they advance together)
            c.offset = self.kv[0].offset
        self.p = prompt_len if prompt_len is not None else len(prompt)
        self.tail = len(prompt)  # the head's slots pending before the first round (all the prompt's: its tokens from
        # the second on, then the first generated one)
        # last_k: the depth of the round dispatched last (0: a plain step; its unread rows bound the caches'
        # offsets). After plain steps the head's slots wait in `backlog`, all of their rows valid.
        self.last_k = 0
        # (tokens, hiddens, whether the hiddens are before the final norm: plain steps return them so, and the catch-up
        # norms a stretch's rows in one launch instead of one per step)
        self.backlog: list[tuple[mx.array, mx.array, bool]] = []
        # device state: the newest token, the head's pending slots (tokens, target hiddens, the row to draft from),
        # the generated index of y (plain steps count on the host, `plain_steps`, and are added when a round starts)
        self.y = (first.astype(mx.int32) if isinstance(first, mx.array) else mx.array(first, dtype=mx.int32)).reshape(1)
        self.ptok = mx.concatenate([mx.array(prompt[1:], dtype=mx.int32), self.y])
        self.phid, self.praw = hidden, False  # praw: phid is a plain step's hidden before the final norm
        self.pn = mx.array(self.tail - 1, dtype=mx.int32)
        self.gen = mx.array(0, dtype=mx.int32)
        self.plain_steps = 0
        self.traced = tracing_enabled() and (override is None or hasattr(override, "apply"))
        for c in (*self.mcache, *self.kv):  # traced rounds keep one shape: attention reads the whole buffer
            c.whole = self.traced
        # plain steps (K = 0): plain decoding's own step (decode.TracedSteps) on these caches, also returning the
        # hidden the head pairs with the next token, before its norm (one launch fewer per step: `_catch_up` norms a
        # stretch's rows at once)
        self.steps = TracedSteps(model, sampler, self.cache, hidden="pre", traced=decode.tracing_enabled())
        for c in self.kv:  # (a traced plain step too: its shapes stay the same from step to step)
            c.whole = self.traced or self.steps.traced

    def bounds(self, r: int, verified: int) -> None:
        """Host-side upper bounds of the caches' offsets before round r, `verified` = rows kept by rounds 0..r-2
        (read). The head's counts every slot there is, fed or pending (the prompt's, the plain steps'); the
        target's misses only round r-1's unread count."""
        head = self.m0 + self.tail + verified
        for c in self.mcache:
            c.bound = head
        for c in self.kv:
            c.bound = self.p + verified + (self.last_k + 1 if r else 0)

    def _feed(self, tok: mx.array, hid: mx.array, rows: "int | mx.array | None" = None) -> None:
        """The head takes slots (tokens [R], target hiddens [R, H]) into its cache (queued, not waited for); its true
        end moves on by `rows` (default R: all valid; fewer: the rows past them are scratch, overwritten later)."""
        feed_head(self.model, tok, hid, self.mcache, step=tok.shape[0], wait=False)
        for c in self.mcache:  # a fixed-capacity cache writes at its offset without moving it
            c.offset = c.offset + (tok.shape[0] if rows is None else rows)

    def plain_step(self) -> tuple[mx.array, int]:
        """A K = 0 pass: one step of plain decoding (decode.TracedSteps, the very step generate_step runs) on the
        target's caches. After a round, its slots (n + 1 of its rows valid, n on the device) go to the head now, as
        the next draft would take them, and the GDN caches leave the verify's recording; after a plain step its slot
        joins the backlog, which the head takes when speculation resumes (`_catch_up`). Returns (the token, a scalar
        array as the step returns it: no reshape per token; 0)."""
        if self.last_k:
            with compiled.forced(False) if self._one_off() else contextlib.nullcontext():
                self._draft_rows(0)
            window = self.model.args.linear_conv_kernel_dim - 1
            for c in self.gdn:  # the verify's picked window and state as plain ones: the step replays its trace
                c.commit()
                c.conv, c.ssm = picked(c.conv, c.ssm, c.window_pick, window)
                c.window_pick = None
        else:
            self.backlog.append((self.ptok, self.phid, self.praw))
        self.steps.bound = self.kv[0].bound if self.kv else 0
        self.y, self.phid = self.steps.step(self.y)
        self.ptok, self.praw, self.plain_steps, self.last_k = self.y, True, self.plain_steps + 1, 0
        return self.y, 0

    def _settle(self, k: int) -> None:
        """Before a traced round of depth k after a pass of another kind (plain steps, a round of another depth):
        the state a round of depth k leaves, so that this round replays its trace instead of being built op by op
        (docs/results/code_measurements.md, 'The switch from plain steps to rounds'). The head takes every pending
        slot but the newest, which waits alone, repeated to k + 1 rows (pn = 0: the copies are scratch rows); each
        GDN cache's window and state become a recorded forward of k + 1 steps read at its first step (window_pick
        [1, 0, ..]: the rows after the first hold nothing the round reads). After a shallower round (PAD_UPWARD),
        its own pending rows and recorded steps, padded to k + 1 with copies, are that state already: a round of
        depth k that accepted as many drafts leaves the same rows up to pn and scratch after them, so nothing of
        the head or the GDN caches is computed here (the first pass after a change of depth was the dearest of all,
        docs/adr/0008 'Run S', with the head's forward and the caches' picking built op by op in it)."""
        if PAD_UPWARD and 0 < self.last_k < k:
            extra = k - self.last_k
            self.ptok = mx.concatenate([self.ptok, mx.repeat(self.ptok[-1:], extra)])
            self.phid = mx.concatenate([self.phid, mx.repeat(self.phid[-1:], extra, axis=0)])
            for c in self.gdn:  # (the recorded forward's conv input [B, W + R, C] and per-step states [B, R, ..])
                c.conv = mx.pad(c.conv, [(0, 0), (0, extra), (0, 0)])
                c.ssm = mx.pad(c.ssm, [(0, 0), (0, extra)] + [(0, 0)] * (c.ssm.ndim - 2))
            self.last_k = k
            return
        window = self.model.args.linear_conv_kernel_dim - 1
        if self.last_k == 0:
            tok, hid = self._pending_slots()
            rows = tok.shape[0] - 1
            for start in range(0, rows, CATCH_UP_PIECE):
                piece = min(CATCH_UP_PIECE, rows - start)
                self._feed(*_padded(tok[start : start + piece], hid[start : start + piece]), piece)
            newest, last = tok[-1:], hid[-1:]
            self._opened()
            for c in self.gdn:
                c.begin()
        else:  # the last round's slots up to its newest kept one; that one waits again (rewritten where it was)
            self._feed(self.ptok, self.phid, self.pn)
            for c in self.mcache:  # the newest slot sits up to the last round's K rows past the true end's bound
                c.bound += self.last_k
            newest, last = mx.take(self.ptok, self.pn.reshape(1)), mx.take(self.phid, self.pn.reshape(1), axis=0)
            for c in self.gdn:
                c.conv, c.ssm = picked(c.conv, c.ssm, c.window_pick, window)
        self.ptok, self.phid = mx.repeat(newest.astype(mx.int32), k + 1), mx.repeat(last, k + 1, axis=0)
        self.pn, self.praw = mx.array(0, dtype=mx.int32), False
        # (an array of its own, not _PICK: the trace takes it as an input, and _after_verify inside the trace
        # holds _PICK as a constant; MLX refuses the same array as both)
        pick = mx.array([1, 0, 0, 0], dtype=mx.int32)
        for c in self.gdn:
            c.conv = mx.pad(c.conv, [(0, 0), (1, k), (0, 0)])
            c.ssm = mx.pad(c.ssm[:, None], [(0, 0), (0, k)] + [(0, 0)] * (c.ssm.ndim - 1))
            c.window_pick = pick
        self.last_k = k

    def _pending_slots(self) -> tuple[mx.array, mx.array]:
        """Every slot the head has not taken after plain steps (the prompt's, the plain steps'), all valid: tokens
        [R] and the target's hiddens [R, H], normed (runs of hiddens before the norm in one launch each)."""
        slots = [*self.backlog, (self.ptok, self.phid, self.praw)]  # (a plain step's token is a scalar)
        tok = mx.concatenate([t.reshape(-1) for t, _, _ in slots]) if len(slots) > 1 else slots[0][0].reshape(-1)
        parts: list[tuple[list[mx.array], bool]] = []  # runs of hiddens normed or not (one norm launch per run)
        for _, h, raw in slots:
            if parts and parts[-1][1] == raw:
                parts[-1][0].append(h)
            else:
                parts.append(([h], raw))
        hids = [self.model.head_input(_join(hs)) if raw else _join(hs) for hs, raw in parts]
        return tok, _join(hids)

    def _opened(self) -> None:
        """The backlog is the head's now: the newest token as a round takes it, the plain steps counted."""
        self.backlog = []
        self.y = self.y.reshape(1).astype(mx.int32)
        if self.plain_steps:
            self.gen, self.plain_steps = self.gen + self.plain_steps, 0

    def _catch_up(self) -> None:
        """Before the first draft after plain steps (or the generation's first): the head takes every pending slot
        (the prompt's, the plain steps') in forwards of CATCH_UP_PIECE rows, the last one with the draft's forward,
        padded with copies of the newest slot (scratch rows past the head's true end that the next ones overwrite, as
        a draft step's are). One row count whatever the stretch: on a GPU a forward over a row count not seen before
        compiles new kernels, seconds inside a generation (docs/results/code_measurements.md, 'pipelined tuner')."""
        tok, hid = self._pending_slots()
        rows = tok.shape[0]
        cut = rows - (rows % CATCH_UP_PIECE or CATCH_UP_PIECE)
        for start in range(0, cut, CATCH_UP_PIECE):
            self._feed(tok[start : start + CATCH_UP_PIECE], hid[start : start + CATCH_UP_PIECE])
        tok, hid, rows = tok[cut:], hid[cut:], rows - cut
        tok, hid = _padded(tok, hid)
        # (plain steps' tokens are the samplers' uint32; a round's are int32, as its trace takes them)
        self.ptok, self.phid, self.pn = tok.astype(mx.int32), hid, mx.array(rows - 1, dtype=mx.int32)
        self.praw = False
        self._opened()
        for c in self.gdn:
            c.begin()  # every verify records its steps; pick() keeps the accepted ones

    def _draft_rows(self, k: int):
        """The head over the pending slots (the last round's rows, or after plain steps every slot waiting:
        `_catch_up`): returns its output at the newest token's slot [1, 1, H], the head caches' (true end, bound)
        and the offsets of the scratch rows of k draft steps."""
        if self.last_k == 0:
            self._catch_up()
        head, embed = self.model.mtp, self.model.model.embed_tokens
        x = head(embed(self.ptok)[None], head.from_target(self.phid)[None], self.mcache)  # [1, R, H]
        x = mx.take(x, self.pn.reshape(1), axis=1)  # the slot of the newest token
        base, offsets = [], []
        for c in self.mcache:
            offsets.append(_head_offsets(max(k, 1))(c.offset, self.pn))
            c.offset = offsets[-1][0]
            base.append((c.offset, c.bound))
        return x, base, offsets

    def draft(self, r: int, k: int | None = None) -> tuple[mx.array, mx.array | None]:
        """k >= 1 drafts [k] (default: the K it was built with; and q [k, V] when sampling) from the pending slots;
        the head's cache keeps the true rows."""
        k = self.k if k is None else k
        model, head, embed = self.model, self.model.mtp, self.model.model.embed_tokens
        vocab, V = head.draft_vocab, model.args.vocab_size
        x, base, offsets = self._draft_rows(k)
        R = self.ptok.shape[0]
        # Without a rotation the head's final norm runs inside the kernels that read its output: the lm_head's
        # prologue, and the next step's input norm (rms_pair's pre-norm) when the head reads its post-norm hidden.
        # A greedy draft stays the argmax's [1, 1] array until the drafts are joined: one cast per round.
        fold = "rotation" not in head
        drafts, qs = [], []
        for i in range(k):
            if fold:
                post = None
                logits = vocab.lm_logits(model, x, norm=head.norm) if vocab is not None else \
                    model.lm_logits(x, norm=head.norm)
            else:
                post = head.norm(x)
                u = head.to_target(post)
                logits = vocab.lm_logits(model, u) if vocab is not None else model.lm_logits(u)
            if self.sampler.greedy:
                d, q = argmax(logits), None  # [1, 1]
            else:
                d, q = _pick(self.sampler, logits[0, -1], self.values)
                d = d.reshape(1, 1)
            if vocab is not None:
                d, q = vocab.to_full(d, q, V)
            drafts.append(d)
            qs += [q] if q is not None else []
            if i + 1 < k:  # a scratch row past the true ones (overwritten by the next round)
                for c, offs, (_, bound) in zip(self.mcache, offsets, base):
                    c.offset, c.bound = offs[i], bound + R + i
                if head.input_hidden != "post":
                    x = head(embed(d), x, self.mcache)
                elif fold:
                    x = head(embed(d), x, self.mcache, hidden_norm=head.norm)
                else:
                    x = head(embed(d), post, self.mcache)
        for c, (off, bound) in zip(self.mcache, base):
            c.offset, c.bound = off, bound
        drafts = mx.concatenate(drafts, axis=1).reshape(k).astype(mx.int32)
        q = mx.stack(qs) if qs else None
        if self.override is not None:
            drafts, q = self.override(drafts, q, self, r)
        self.last_k = k
        return drafts, q

    def _state(self) -> list[mx.array]:
        """The arrays a round reads and writes (a traced round's inputs and outputs)."""
        out = [self.y, self.ptok, self.phid, self.pn, self.gen]
        for c in self.mcache:
            out += [c.keys, c.values, c.offset]
        out += traces.kv_arrays(self.kv)
        for c in self.gdn:
            out += [c.conv, c.ssm, c.window_pick]
        return out

    def _set_state(self, arrays: list) -> None:
        it = iter(arrays)
        self.y, self.ptok, self.phid, self.pn, self.gen = next(it), next(it), next(it), next(it), next(it)
        for c in self.mcache:
            c.keys, c.values, c.offset = next(it), next(it), next(it)
        traces.set_kv_arrays(self.kv, it)
        for c in self.gdn:
            c.conv, c.ssm, c.window_pick = next(it), next(it), next(it)

    def _can_trace(self, k: int) -> bool:
        """A steady-state round: same K as the last one, its K + 1 rows pending for the head, every cache written
        once already (a round after plain steps is not: its GDN caches hold no verify's picks); and no hidden tap
        (make_draft_model's, which would keep the trace's arrays)."""
        return (self.traced and k == self.last_k and self.ptok.shape[0] == k + 1
                and all(c.keys is not None for c in (*self.mcache, *self.kv))
                and all(c.window_pick is not None for c in self.gdn)
                and runtime_of(self.model).hidden_tap is None)

    def _one_off(self) -> bool:
        """Whether work outside a traced round is a one-off between replays (rounds traced, no hidden tap holding
        every round out of its trace): then it is built layer by layer, not from per-layer traces compiled for it."""
        return self.traced and runtime_of(self.model).hidden_tap is None

    def trace_key(self, k: int) -> tuple:
        """What a traced round's graph depends on besides its inputs: K, the sampler's structure (its numbers are an
        input; a Sampler subclass: the sampler itself), the draft vocabulary, the head and how it reads the target's
        hidden, the override's kind, the kernels switch."""
        head = self.model.mtp
        sampler = self.sampler.structure() if self.values is not None else self.sampler
        return (k, sampler, head.draft_vocab, id(head), head.input_hidden, type(self.override), kernel_policy())

    def has_trace(self, k: int) -> bool:
        """Whether a round of depth k would replay a trace this process has compiled (k = 0: plain decoding's step,
        or rounds are not traced: no compile either way)."""
        return not k or not self.traced or self.trace_key(k) in runtime_of(self.model).traces.get("rounds", {})

    def round(self, r: int, k: int) -> tuple[mx.array, "mx.array | int"]:
        """Round r of depth k, traced when it can be (`_can_trace`), else built op by op; k = 0: a plain step
        (`plain_step`). Returns (tokens [k + 1], n) as `verify` (n = 0, a host int, for a plain step)."""
        if k == 0:
            return self.plain_step()
        if k != self.last_k and self._one_off():
            with compiled.forced(False):  # (one-off work: no per-layer traces of the head compiled for it)
                self._settle(k)
        if not self._can_trace(k):
            # a round that cannot replay a trace (its state not a round's: rounds untraced, a hidden tap, a head
            # with no rows yet) is built layer by layer: per-layer traces would be compiled for it alone (on a GPU,
            # seconds)
            with compiled.forced(False) if self._one_off() else contextlib.nullcontext():
                return self.verify(*self.draft(r, k))
        key = self.trace_key(k)
        cached, _ = traces.cached(self.model, "rounds", key, lambda: _traced_round(self.model, k))
        # room for the round: the target's k + 1 rows, the head's k + 1 pending and k - 1 scratch rows past its
        # bound; a buffer that must grow takes the others with it (one new shape for the trace, not one per buffer)
        need = [(c, k + 1) for c in self.kv] + [(c, 2 * k) for c in self.mcache]
        if any(c.needed(rows) > c.capacity() for c, rows in need):
            cap = max(c.needed(rows) for c, rows in need)
            for c, rows in need:
                c.reserve(rows, capacity=cap)
        vocab = self.model.mtp.draft_vocab
        if vocab is not None:
            vocab._lm_rows(self.model)  # gathered (or checked) outside the trace
        extras = ([self.values] if self.values is not None else []) + \
            (self.override.device_inputs(k) if self.override is not None else [])
        tokens, n = traces.call(cached, key, self, [*self.mcache, *self.kv], extras)
        self.last_k = k
        return tokens, n

    def verify(self, drafts: mx.array, q: mx.array | None) -> tuple[mx.array, mx.array]:
        """The target over [y, d1..dK]; acceptance, cache advance and the next round's inputs on the device.
        Returns (tokens [K+1], n): the round's output is tokens[: n + 1]."""
        logits, hidden = self.model(mx.concatenate([self.y, drafts])[None], self.cache, return_hidden=True)
        n, token, tokens = accept(logits[0], drafts, q, self.sampler, self.values)
        n = n.astype(mx.int32)
        # (the generated count is computed with the rest, so it is evaluated with them: no chain of lazy adds)
        offset, index, self.gen = _after_verify(self.kv[0].offset if self.kv else n, n, self.gen)
        for c in self.kv:
            c.offset = offset
        for c in self.gdn:
            c.pick(index)  # the conv window from row n + 1, the state of step n
        self.y = token.reshape(1)
        self.ptok, self.phid, self.pn = tokens, hidden[0], n
        return tokens, n


def _padded(tok: mx.array, hid: mx.array) -> tuple[mx.array, mx.array]:
    """Slots (tokens [R], hiddens [R, H], R <= CATCH_UP_PIECE) padded to CATCH_UP_PIECE rows with copies of the last:
    one row count for every catch-up forward (PipelinedRounds._catch_up)."""
    pad = CATCH_UP_PIECE - tok.shape[0]
    if not pad:
        return tok, hid
    return mx.concatenate([tok, mx.repeat(tok[-1:], pad)]), mx.concatenate([hid, mx.repeat(hid[-1:], pad, axis=0)])


def _join(arrays: list[mx.array]) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays)


def run_pipelined(model, ids: mx.array, *, sampler: Sampler, options: SpecOptions, stats: SpecStats,
                          override: DraftOverride | None = None, prompt_cache=None,
                          budget: int | None = None) -> Iterator[int]:
    """Yields the tokens of plain decoding (identical when greedy; the same distribution when sampling), MTP rounds
    pipelined one deep: of fixed K, or with options.adaptive of the depth PipelinedTuner picks (up to K; 0 = plain
    steps, pipelined the same way). Fills `stats` (draft_time_s: building the drafts' graph; verify_time_s: building
    the verify's graph and waiting for the previous round; plain steps are not counted as rounds). `prompt_cache`
    (prompt_cache.PromptCache): its prefix of `ids` is not prefilled again (target and MTP head). `budget`: the most
    tokens the caller will take (the tuner's FIRST_ROUNDS_S; None: not told)."""
    if not model.has_mtp:
        raise ValueError("pipelined rounds draft with the MTP head, and this checkpoint has none (mtp.*)")
    k = options.draft_tokens
    cache, head_cache, logits, hidden, n = resume(model, ids, prompt_cache, return_hidden=True)
    # the first token is read after the first pass is queued behind it, as plain decoding reads its own (reading it
    # first left the GPU idle while the loop was set up and the pass built)
    first = sampler(logits)
    mx.async_eval(first)
    # (with a prompt cache `hidden` starts at the cached prefix's last position, so the head's work starts there)
    rounds = PipelinedRounds(model, sampler, k, ids.tolist()[max(n - 1, 0):], first, hidden, cache, override,
                             prompt_len=ids.size, head_cache=head_cache if n else None)
    runtime = runtime_of(model)
    tuner = PipelinedTuner(k, tuner_memory(model, sampler.greedy), rounds.has_trace, lag=2,
                           budget=None if budget is None else budget - 1, first_rounds=not runtime.rounds_run,
                           greedy=sampler.greedy) \
        if options.adaptive else None  # (a round's acceptance is read two passes after its dispatch; the first
    # token is the prefill's)
    # the prefill's caches and hiddens: what the rounds need of them is in their own buffers now (memory: the
    # attention caches' rows would be held twice for the whole generation, and the hiddens are [T, H])
    del cache, head_cache, hidden
    verified, pending, r, last, logged, decided = 0, None, 0, None, 0, 0  # (log/decisions entries forwarded)
    hopeful = functools.partial(tuner_rates, stats, OFF_HOPE)
    while True:
        tic = time.perf_counter()
        if tuner is not None:
            if last is not None:
                tuner.observe(last[0], tic - last[1])
            k = tuner.next_k(tuner_rates(stats), hopeful)
            last = (k, tic)
        rounds.bounds(r, verified)
        out = rounds.round(r, k)
        runtime.rounds_run = runtime.rounds_run or k > 0
        mid = time.perf_counter()
        mx.async_eval(out[0], out[1]) if k else mx.async_eval(out[0])
        if first is not None:
            yield first.item()
            first = None
        if pending is not None:
            # read round r's own arrays (evaluated with round r) and cut in Python: tokens[: n + 1] would be a new
            # array, evaluated on the stream behind round r + 1, so reading it waited for round r + 1 to finish and
            # undid the pipelining (scripts/bench/round_host.py measures both reads)
            tokens, n, pk = pending
            n = n.item() if pk else 0
            tokens = tokens.tolist()[: n + 1] if pk else [tokens.item()]
        if k:
            stats.draft_time_s += mid - tic
            stats.verify_time_s += time.perf_counter() - mid
        if pending is not None:
            if pk:
                stats.record(pk, n)
            verified += n + 1
            if tuner is not None and len(tuner.log) > logged:  # every decision is logged too: one test per round
                stats.decisions += tuner.decisions[decided:]
                stats.tuner_log += tuner.log[logged:]
                decided, logged = len(tuner.decisions), len(tuner.log)
            yield from tokens
        pending, r = (*out, k), r + 1
        if k == 0 and tuner is not None and tuner.plain_left():
            # the rest of a plain stretch as plain decoding's own loop (generate_step: the next step queued, then this
            # one's token read), with no decision, rates or bookkeeping per pass: the tuner takes the passes at the
            # stretch's end, or where the generation stops inside it
            y, times = out[0], []
            try:
                for _ in range(tuner.plain_left()):
                    times.append(time.perf_counter())
                    rounds.bounds(r, verified)
                    nxt, _ = rounds.plain_step()
                    mx.async_eval(nxt)
                    tok = y.item()
                    verified, r, y = verified + 1, r + 1, nxt
                    yield tok
            finally:
                tuner.plain_ran([b - a for a, b in zip([last[1], *times], times)])
            pending, last = (y, 0, 0), (0, times[-1])
