"""Per-layer caches behind one protocol: begin() marks a speculative region, rollback(n) drops its last n positions,
commit() ends it; snapshot()/restore() copy everything (the replay oracle); nbytes. `.state` serves mlx-lm."""

import functools

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.models.cache import KVCache as _MlxLmKVCache

from .metal import iota, number


def _own(a: mx.array | None) -> mx.array | None:
    """A new array object on the same data: the KV cache writes rows with __setitem__, which changes the array
    object it holds in place, so a snapshot (or a cache restored from one) must not share that object."""
    return mx.array(a) if a is not None else None


class KVCache(_MlxLmKVCache):
    """mlx-lm's preallocated KV cache; rollback is a trim of the offset."""

    def begin(self) -> None:
        self._start = self.offset

    def rollback(self, n: int) -> None:
        self.trim(n)

    def keep(self, nodes: list[int]) -> None:
        """Tree verify: keep the rows of `nodes` (indices since begin()), compacted in that order."""
        start, idx = self._start, mx.array(nodes) + self._start
        self.keys[..., start : start + len(nodes), :] = self.keys[..., idx, :]
        self.values[..., start : start + len(nodes), :] = self.values[..., idx, :]
        self.offset = start + len(nodes)

    def commit(self) -> None:
        pass

    def snapshot(self) -> tuple:
        return _own(self.keys), _own(self.values), self.offset

    def restore(self, snap: tuple) -> None:
        self.keys, self.values, self.offset = _own(snap[0]), _own(snap[1]), snap[2]


@functools.cache
def _clamped_positions(last: int, T: int):
    """offset -> (the rows a write of T rows lands on, its start clamped to [0, last], as [1, 1, T, 1] int32; the
    length offset + T), compiled: one fused kernel per forward instead of a max, a min, an add and an arange (each a
    launch on a GPU)."""
    # (from host data: a constant of the trace, not an arange it would launch at every call)
    steps = mx.array(np.arange(T, dtype=np.int32).reshape(1, 1, T, 1))

    def positions(offset: mx.array) -> tuple[mx.array, mx.array]:
        # (`last` and T as metal.number: a Python int is a scalar constant, and a fused kernel named by its value
        # compiles per depth and capacity)
        return mx.minimum(mx.maximum(offset, 0), number(last)) + steps, offset + number(T)

    return mx.compile(positions)


class FixedKVCache:
    """A KV cache whose length lives on the device (pipelined rounds, speculative/pipelined.py): keys and values are buffers of a
    fixed capacity, `offset` an int32 scalar array. A forward writes its T rows at `offset` without moving it; the
    loop then advances it by the accepted count, itself a device array, so no round waits for the host. The rows
    go in with one scatter per buffer (`mx.put_along_axis` at device row indices): a `mx.slice_update` at a device
    start costs two kernels on MLX's CUDA backend (docs/results/code_measurements.md, 'Device-side KV writes'). Attention
    reads the first `bound` + T rows (`bound`: a host-side upper bound of the offset, kept by the loop) and masks to
    `length` (offset + T) on the device; rows past the length are stale drafts, never read. The write's start is clamped
    on the device (MLX bounds-checks neither a scatter nor a dynamic slice), and the buffers grow in blocks of GROW rows
    as `bound` nears their capacity."""

    GROW = 1024

    def __init__(self, keys: mx.array | None, values: mx.array | None, offset: int):
        self.keys, self.values = keys, values  # [B, Hkv, capacity, D]
        self.offset = mx.array(offset, dtype=mx.int32)
        self.bound = offset
        self.length: mx.array | None = None
        # attention reads the whole buffer (masked to `length` on the device) instead of its first bound + T rows:
        # the shapes of a round then do not change from round to round, so one trace of it serves them all
        # (speculative/pipelined.py, traced rounds)
        self.whole = False

    @classmethod
    def from_kv(cls, kv: KVCache) -> "FixedKVCache":
        n = kv.offset
        if kv.keys is None:
            return cls(None, None, 0)
        return cls(kv.keys[..., :n, :], kv.values[..., :n, :], n)

    def _reserve(self, k: mx.array) -> None:
        """Room for k's rows past `bound`: a bigger buffer (old rows copied) only when the capacity is short."""
        self.reserve(k.shape[2], like=k)

    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def needed(self, rows: int) -> int:
        """The capacity that holds `rows` rows past `bound`: a multiple of GROW (the same shapes for every prompt
        length up to it: a traced round is reused across requests), at least the current one."""
        have, end = self.capacity(), self.bound + rows
        return have if end <= have else -(-end // self.GROW) * self.GROW

    def reserve(self, rows: int, like: mx.array | None = None, *, capacity: int = 0) -> None:
        """Room for `rows` rows past `bound`, and at least `capacity` rows in all (pipelined rounds grow the head's
        and the target's buffers together: one new shape of a traced round, not two); `like` gives
        [B, Hkv, _, D] and the dtype when the cache is still empty."""
        have = self.capacity()
        cap = max(self.needed(rows), capacity)
        if cap <= have:
            return
        ref = like if self.keys is None else self.keys
        shape = (*ref.shape[:2], cap - have, ref.shape[3])
        grow = lambda a: mx.zeros(shape, ref.dtype) if a is None else mx.concatenate([a, mx.zeros(shape, a.dtype)], 2)  # noqa: E731
        self.keys, self.values = grow(self.keys), grow(self.values)

    # (offset, capacity, T, rows, length) of the last write: the target's attention layers share one offset array
    # and capacity, so a forward computes its rows and length once, not once per layer (kernels per round)
    _memo: tuple | None = None

    def _positions(self, T: int) -> tuple[mx.array, mx.array]:
        cap, m = self.keys.shape[2], FixedKVCache._memo
        if m is not None and m[0] is self.offset and m[1:3] == (cap, T):
            return m[3], m[4]
        rows, length = _clamped_positions(cap - T, T)(self.offset)
        FixedKVCache._memo = (self.offset, cap, T, rows, length)
        return rows, length

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        T = k.shape[2]
        self._reserve(k)
        rows, self.length = self._positions(T)
        self.keys = mx.put_along_axis(self.keys, rows, k, axis=2)
        self.values = mx.put_along_axis(self.values, rows, v, axis=2)
        if self.whole:
            return self.keys, self.values
        view = self.bound + T
        return self.keys[..., :view, :], self.values[..., :view, :]

    def advance(self, n: mx.array) -> None:
        """Keep n (a device scalar) of the rows the last forward wrote at the offset."""
        self.offset = self.offset + n.astype(mx.int32)

    @property
    def state(self) -> list:
        return [a for a in (self.keys, self.values, self.offset) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys, self.values) if a is not None)


class BatchFixedKVCache(BatchKVCache):
    """mlx-lm's left-padded batch cache (continuous batching, batch.py) with its write column on the device, for
    traced batched steps (batch.BatchSteps): a forward writes its T rows of every sequence at column `pos` (an int32
    scalar array, the same for all rows: the rows are left-padded to it) with one scatter per buffer, and attention
    reads the whole buffer through a mask of each row's columns (its left padding .. pos + t), so a step's shapes do
    not change from step to step. `_idx` is pos on the host; the buffers grow in GROW-column blocks, before a forward
    (`reserve`). Joins and leaves are mlx-lm's (extend, filter), pos following."""

    GROW = 256

    @classmethod
    def of(cls, c: BatchKVCache) -> "BatchFixedKVCache":
        out = cls.__new__(cls)
        out.keys, out.values, out.offset, out.left_padding = c.keys, c.values, c.offset, c.left_padding
        out._idx = c._idx
        out._right_padding = None
        out.pos = mx.array(out._idx, dtype=mx.int32)
        return out

    def reserve(self, rows: int) -> None:
        """Room for `rows` more columns past _idx (a multiple of GROW columns in all)."""
        have = self.keys.shape[2]
        if self._idx + rows <= have:
            return
        cap = -(-(self._idx + rows) // self.GROW) * self.GROW
        grow = lambda a: mx.concatenate([a, mx.zeros((*a.shape[:2], cap - have, a.shape[3]), a.dtype)], 2)  # noqa: E731
        self.keys, self.values = grow(self.keys), grow(self.values)

    def make_mask(self, N: int, **kwargs) -> mx.array:
        """[B, 1, N, capacity] bool: row t of sequence b sees its columns left_padding[b] .. pos + t."""
        self.reserve(N)
        cols = iota(self.keys.shape[2])
        causal = cols[None, :] <= (self.pos + iota(N))[:, None]  # [N, cap]
        return causal[None, None] & (cols[None, :] >= self.left_padding[:, None])[:, None, None, :]

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        T = k.shape[2]
        self.reserve(T)
        rows = (self.pos + iota(T)).reshape(1, 1, T, 1)
        self.keys = mx.put_along_axis(self.keys, rows, k, axis=2)
        self.values = mx.put_along_axis(self.values, rows, v, axis=2)
        self.offset, self.pos, self._idx = self.offset + T, self.pos + T, self._idx + T
        return self.keys, self.values

    def _settle(self) -> None:
        """After a join or a leave: pos from _idx, the capacity back to a multiple of GROW (mlx-lm's extend and
        filter leave any width, and each new width is a new trace of the step, kept for good)."""
        self.pos = mx.array(self._idx, dtype=mx.int32)
        if self.keys is not None and self.keys.shape[2] % self.GROW:
            self.reserve(-(-self.keys.shape[2] // self.GROW) * self.GROW - self._idx)

    def filter(self, batch_indices) -> None:
        super().filter(batch_indices)
        self._settle()

    def extend(self, other) -> None:
        super().extend(other)
        self._settle()

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("BatchFixedKVCache is plain batched steps' (batch.BatchSteps): MTP rounds run "
                                  "mlx-lm's BatchKVCache")

    trim = prepare = finalize = _unsupported


class RoundKVCache(BatchKVCache):
    """mlx-lm's left-padded batch cache for MTP rounds over a batch (speculative/batched.py), its rollback on the
    device and O(1): a forward writes its T columns in every row at the shared write column `_idx` (a host count); a
    row that keeps m of them (`keep`) marks the rest dead in `live` [B, capacity] (bool), where the mask hides them,
    instead of rolling its keys to the left (mlx-lm's prepare / finalize: a copy of every layer's buffer, read back
    to the host, per round). `offset` [B] stays each row's count of live columns, its RoPE position. A dead column
    costs room and a masked read until `reserve` finds the buffer full and compacts it (each row's live columns
    gathered to the right, the dead ones becoming left padding); joins and leaves (extend, filter) carry `live`
    along. Attention reads the columns up to the write column through the mask; with `whole` (a traced round,
    speculative/batched.py) every shape is fixed: the write column is `pos` (an int32 scalar array, set from _idx
    before the round), writes are scatters at it, and attention reads the whole buffer through the mask."""

    GROW = 256
    whole = False
    pos: mx.array | None = None

    @classmethod
    def of(cls, c: BatchKVCache) -> "RoundKVCache":
        out = cls.__new__(cls)
        out.keys, out.values, out.offset, out.left_padding = c.keys, c.values, c.offset, c.left_padding
        out._idx, out._right_padding, out.last = c._idx, None, None
        out.live = out._live_of(c)
        if out.keys is not None and out.keys.shape[2] % cls.GROW:
            out._grow(-(-out.keys.shape[2] // cls.GROW) * cls.GROW)
        return out

    @staticmethod
    def _live_of(c: BatchKVCache) -> mx.array:
        """[B, capacity]: a cache without holes, its columns left_padding .. _idx."""
        cols = iota(c.keys.shape[2] if c.keys is not None else 0)[None]
        return (cols >= c.left_padding[:, None]) & (cols < c._idx)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2] if self.keys is not None else 0

    def _grow(self, cap: int) -> None:
        have = self.capacity
        pad = lambda a: mx.concatenate([a, mx.zeros((*a.shape[:2], cap - have, a.shape[3]), a.dtype)], 2)  # noqa: E731
        self.keys, self.values = pad(self.keys), pad(self.values)
        self.live = mx.concatenate([self.live, mx.zeros((self.live.shape[0], cap - have), mx.bool_)], 1)

    def _room(self, rows: int) -> int:
        """The capacity a forward of `rows` columns needs (whole GROW blocks)."""
        return max(self.capacity, -(-(self._idx + rows) // self.GROW) * self.GROW)

    def reserve(self, rows: int, *, compact: bool = True) -> None:
        """Room for `rows` more columns past _idx: compacted first when that frees GROW columns or more (it reads
        the rows' live counts: a sync), else grown by GROW-column blocks."""
        if self.keys is None or self._idx + rows <= self.capacity:
            return
        if compact:
            self.compact()
            if self._idx + rows <= self.capacity:
                return
        self._grow(-(-(self._idx + rows) // self.GROW) * self.GROW)

    def compact(self) -> None:
        """Each row's live columns gathered, in order, to the right of column _idx' = the most any row has; the rest
        of the row is left padding. Done only where it frees GROW columns or more."""
        counts = self.live[:, : self._idx].astype(mx.int32).sum(axis=1)
        longest = int(counts.max().item())
        if self._idx - longest < self.GROW:
            return
        cols = iota(self._idx)[None]
        # each row's columns sorted dead first (-1), then live in order; its last `longest` are what it keeps
        order = mx.argsort(mx.where(self.live[:, : self._idx], cols, -1), axis=1)[:, self._idx - longest :]
        pick = order[:, None, :, None]
        keys = mx.take_along_axis(self.keys[:, :, : self._idx], pick, axis=2)
        values = mx.take_along_axis(self.values[:, :, : self._idx], pick, axis=2)
        cap = self.capacity
        self.keys, self.values, self.left_padding, self.offset, self._idx = keys, values, longest - counts, counts, longest
        self.live = self._live_of(self)
        self._grow(cap)

    def make_mask(self, N: int, **kwargs) -> mx.array:
        """[B, 1, N, _idx + N] bool: row t of a sequence sees its live columns up to _idx + t (the forward's own
        columns are live while it runs). With `whole`: [B, 1, N, capacity], from `pos`."""
        if self.whole:
            cols = iota(self.capacity)
            causal = cols[None, :] <= (self.pos + iota(N))[:, None]  # [N, cap]
            seen = self.live | (cols >= self.pos)[None]  # [B, cap]
            return causal[None, None] & seen[:, None, None, :]
        width = self._idx + N
        cols = iota(width)
        causal = cols[None, :] <= (self._idx + iota(N))[:, None]  # [N, width]
        live = self.live[:, : self._idx] if self.keys is not None else mx.zeros((self.offset.shape[0], 0), mx.bool_)
        seen = mx.concatenate([live, mx.ones((live.shape[0], N), mx.bool_)], axis=1)  # [B, width]
        return causal[None, None] & seen[:, None, None, :]

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        T, i = k.shape[2], self._idx
        if self.keys is None:  # (a sequence whose head had no rows yet)
            cap = self._room(T)
            self.keys = mx.zeros((*k.shape[:2], cap, k.shape[3]), k.dtype)
            self.values = mx.zeros((*v.shape[:2], cap, v.shape[3]), v.dtype)
            self.live = mx.zeros((k.shape[0], cap), mx.bool_)
        self.reserve(T, compact=False)
        if self.whole:  # (the room was reserved before the round: no shape changes inside it)
            cols = self.pos + iota(T)
            self.keys = mx.put_along_axis(self.keys, cols.reshape(1, 1, T, 1), k, axis=2)
            self.values = mx.put_along_axis(self.values, cols.reshape(1, 1, T, 1), v, axis=2)
            self.live = mx.put_along_axis(self.live, mx.broadcast_to(cols[None], (k.shape[0], T)),
                                          mx.ones((k.shape[0], T), mx.bool_), axis=1)
            # (T as number(T): a depth's row count as a scalar constant names fused kernels of its own)
            t = number(T)
            self.offset, self._idx, self.last = self.offset + t.astype(self.offset.dtype), i + T, (self.pos, T)
            self.pos = self.pos + t
            return self.keys, self.values
        self.keys[..., i : i + T, :] = k
        self.values[..., i : i + T, :] = v
        self.live[:, i : i + T] = True
        self.offset, self._idx, self.last = self.offset + number(T).astype(self.offset.dtype), i + T, (i, T)
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def keep(self, counts: mx.array) -> None:
        """Of the columns the last forward wrote, row b keeps its first counts[b] (a device array [B]); the rest
        are dead."""
        i, T = self.last
        kept = iota(T)[None] < counts[:, None]  # [B, T]
        if isinstance(i, mx.array):  # (written at `pos`: whole)
            cols = mx.broadcast_to((i + iota(T))[None], kept.shape)
            self.live = mx.put_along_axis(self.live, cols, kept, axis=1)
        else:
            self.live[:, i : i + T] = kept
        self.offset = self.offset - number(T).astype(self.offset.dtype) + counts.astype(self.offset.dtype)

    def trim(self, n: int) -> int:
        """The newest n columns of every row dropped (the MTP head's draft rows)."""
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - number(n).astype(self.offset.dtype)
        if self.whole and n:
            self.pos = self.pos - number(n)
        return n

    def filter(self, batch_indices) -> None:
        """mlx-lm's filter (the rows kept, then the columns every row pads dropped), `live` alike."""
        live = self.live[batch_indices]
        super().filter(batch_indices)
        if self.keys is None:
            self.live = live
            return
        self.live = live[:, live.shape[1] - self.capacity :]
        self._settle()

    def extend(self, other: BatchKVCache) -> None:
        """mlx-lm's extend (both right-justified to the longer write column, then stacked), `live` alike."""
        lives = [(c.live if isinstance(c, RoundKVCache) else self._live_of(c), c._idx) for c in (self, other)]
        super().extend(other)
        width = self.capacity

        def place(live, idx):
            left = self._idx - idx
            live = mx.pad(live, [(0, 0), (left, 0)])[:, :width]
            return mx.pad(live, [(0, 0), (0, width - live.shape[1])])

        self.live = mx.concatenate([place(*x) for x in lives])
        self._settle()

    def _settle(self) -> None:
        """The capacity back to whole GROW blocks (each new width is a new shape for the kernels and traces)."""
        if self.keys is not None and self.capacity % self.GROW:
            self._grow(-(-self.capacity // self.GROW) * self.GROW)

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("RoundKVCache rolls back with keep(): not mlx-lm's prepare / finalize")

    prepare = finalize = _unsupported


# mlx-lm's speculative loop trims after verify forwards of K+1 tokens and after its draft model's one-token steps;
# on a trimmable cache forwards up to this long record their per-step states (prompt chunks are longer: never trimmed).
TRIM_RECORD_MAX_T = 16
TRIM_WINDOW = 8  # steps a trimmable cache can undo (its last forwards', newest first); each keeps a state alive


class GDNCache:
    """Conv window [B, K-1, C] and recurrent state [B, Hv, Dv, Dk] (fp32) of one Gated DeltaNet layer.

    Inside a speculative region the layer records its conv inputs and the state after every step, so rollback(n) is
    a pick of already-computed arrays: no replay of any forward.

    Trimmable in mlx-lm's sense when made with `trimmable=True` (what `Model.make_cache()` gives mlx-lm; this
    package's own loops use begin/rollback instead and make lean caches): every forward of up to TRIM_RECORD_MAX_T
    tokens records its steps, the latest TRIM_WINDOW stay, and `trim(n)` undoes up to that many exactly; trimming
    further back raises (the states are gone). The price: up to TRIM_WINDOW extra recurrent states per layer.
    """

    def __init__(self, *, trimmable: bool = False):
        self.conv: mx.array | None = None
        self.ssm: mx.array | None = None
        self.offset = 0
        self.recording = False
        self.trimmable = trimmable  # record short forwards so that trim() can undo them
        self._base_state: mx.array | None = None
        self._conv_in: list[mx.array] = []  # each recorded call's conv input [B, W + T, C] (its window first)
        self._states: list[mx.array] = []
        self.window_pick: mx.array | None = None  # pick(): conv/ssm hold a whole verify's arrays, read at this index
        self.valid: mx.array | None = None  # a left-padded group's prefill: [B, T], False at pad positions (batch.py)

    @property
    def state(self) -> list:
        return [self.conv, self.ssm]

    @state.setter
    def state(self, v: list) -> None:
        self.conv, self.ssm = v

    def records(self, T: int) -> bool:
        """Whether a forward of T tokens records its per-step states: inside a speculative region (begin), or on a
        trimmable cache for verify-sized forwards."""
        return self.recording or (self.trimmable and T <= TRIM_RECORD_MAX_T)

    def update(self, conv_in: mx.array, new_state: mx.array, *, window: int, stepwise: bool) -> None:
        """Called by the layer: conv_in [B, window+T, C]; new_state final [B, Hv, Dv, Dk] or per-step [B, T, ...]."""
        if stepwise:
            if not self._conv_in:
                self._base_state = self.ssm
            self._conv_in.append(conv_in)
            self._states.append(new_state)
            # trimmable, outside a speculative region: the latest TRIM_WINDOW steps stay undoable, older ones go
            # (mlx-lm trims its draft model's cache across several one-token forwards)
            while not self.recording and len(self._conv_in) > 1 and \
                    sum(c.shape[1] for c in self._conv_in) - window * len(self._conv_in) > TRIM_WINDOW:
                self._base_state = self._states.pop(0)[:, -1]
                self._conv_in.pop(0)
            new_state = new_state[:, -1]
        elif not self.recording:  # an unrecorded forward (a prompt chunk): nothing before it can be undone
            self._base_state, self._conv_in, self._states = None, [], []
        self.conv = conv_in[:, -window:]
        self.ssm = new_state
        self.window_pick = None
        self.offset += conv_in.shape[1] - window

    def record_tree(self, windows: mx.array, states: mx.array) -> None:
        """Tree verify: each node's conv window [B, N, K-1, C] and state [B, N, Hv, Dv, Dk], kept until keep()."""
        self._tree = (windows, states)

    def keep(self, nodes: list[int]) -> None:
        """Tree verify: continue from the last node of the accepted path `nodes`."""
        windows, states = self._tree
        self.conv, self.ssm = windows[:, nodes[-1]], states[:, nodes[-1]]
        self.offset += len(nodes)
        self._tree = None

    def begin(self) -> None:
        self.recording = True
        self._base_state, self._conv_in, self._states = None, [], []

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        W = self.conv.shape[1]
        # One recorded call (the batched verifier): its conv input already is [window; every recorded row], so the
        # new window is a slice of it and nothing is concatenated (no copy kernel per layer and rejected round).
        conv_in = self._conv_in[0] if len(self._conv_in) == 1 else \
            mx.concatenate([self._conv_in[0]] + [c[:, W:] for c in self._conv_in[1:]], axis=1)  # [B, W + R, C]
        states = self._states[0] if len(self._states) == 1 else mx.concatenate(self._states, axis=1)  # [B, R, Hv, ..]
        keep = conv_in.shape[1] - W - n
        assert keep >= 0, "rollback past the start of the speculative region"
        self.conv = conv_in[:, keep : keep + W]
        self.ssm = states[:, keep - 1] if keep > 0 else self._base_state
        self._conv_in = [conv_in[:, : W + keep]]
        self._states = [states[:, :keep]]
        self.offset -= n

    def commit(self) -> None:
        self.recording = False
        self._base_state, self._conv_in, self._states = None, [], []

    def pick(self, index: mx.array) -> None:
        """Pipelined rounds (speculative/pipelined.py): continue from step n of the one recorded forward, index = [n + 1, n, ..] (a
        device array, one per round for every layer). Nothing is gathered: `conv` and `ssm` become the forward's
        whole conv input and per-step states and `window_pick` = index, and the next forward's GDN kernel reads
        the window (rows n + 1 ..) and state (step n) in place (metal/gated_delta.py `picked`). The region stays
        open for the next forward. `offset` then counts every row written, kept or not (nothing computes with it)."""
        (conv_in,), (states,) = self._conv_in, self._states
        self.conv, self.ssm, self.window_pick = conv_in, states, index
        self._base_state, self._conv_in, self._states = None, [], []

    def snapshot(self) -> tuple:
        return self.conv, self.ssm, self.offset

    def restore(self, snap: tuple) -> None:
        self.conv, self.ssm, self.offset = snap

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        """Undo the last n tokens of the last recorded forward (mlx-lm's trim_prompt_cache)."""
        if n <= 0:
            return 0
        recorded = sum(c.shape[1] - self.conv.shape[1] for c in self._conv_in)
        if n > recorded:
            raise ValueError(f"cannot trim {n} tokens from a GDN cache: only its {recorded} latest recorded steps can "
                             f"be undone (a trimmable cache records forwards of up to {TRIM_RECORD_MAX_T} tokens, at "
                             f"most {TRIM_WINDOW} steps back)")
        self.rollback(n)
        return n

    def empty(self) -> bool:
        return self.ssm is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv, self.ssm) if a is not None)


class NullCache:
    """The cache of a layer another pipeline stage runs (Model.pipeline): nothing to hold, every operation a no-op."""

    offset = 0
    recording = False
    state: list = []

    def begin(self) -> None:
        pass

    def rollback(self, n: int) -> None:
        pass

    def keep(self, nodes: list[int]) -> None:
        pass

    def commit(self) -> None:
        pass

    def snapshot(self) -> tuple:
        return ()

    def restore(self, snap: tuple) -> None:
        pass

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return n

    def empty(self) -> bool:
        return True

    nbytes = 0


def begin(cache: list) -> None:
    for c in cache:
        c.begin()


def rollback(cache: list, n: int) -> None:
    for c in cache:
        c.rollback(n)


def keep(cache: list, nodes: list[int]) -> None:
    for c in cache:
        c.keep(nodes)


def commit(cache: list) -> None:
    for c in cache:
        c.commit()


def snapshot(cache: list) -> list:
    return [c.snapshot() for c in cache]


def restore(cache: list, snaps: list) -> None:
    for c, s in zip(cache, snaps):
        c.restore(s)
