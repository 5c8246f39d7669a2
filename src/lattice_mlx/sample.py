"""Samplers (temperature, top-p, top-k) and the speculative acceptance rules that must see the same distribution."""

import math
from dataclasses import dataclass
from numbers import Integral, Real

import mlx.core as mx

from .metal import iota
from .metal.argmax import argmax


@dataclass(frozen=True)
class Sampler:
    """Turns logits [..., V] into tokens. temp == 0 is greedy; otherwise sample from `probs(logits)`."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # keep tokens with probability >= min_p x the most likely one's (0: off), as mlx-lm does

    def __post_init__(self):
        """The one check of the sampling options, for the API and the CLI alike (ValueError, one line)."""
        if isinstance(self.temp, bool) or not isinstance(self.temp, Real) or not math.isfinite(self.temp) \
                or self.temp < 0:
            raise ValueError(f"temp (--temp) must be a finite number >= 0, got {self.temp!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, Real) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p (--top-p) must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, Integral) or self.top_k < 0:
            raise ValueError(f"top_k (--top-k) must be an integer >= 0 (0: off), got {self.top_k!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, Real) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p (--min-p) must be in [0, 1] (0: off), got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def values(self) -> mx.array:
        """[temp, top_p, min_p] as a float32 array: what a traced step takes as an input (decode.TracedSteps), so
        that one trace serves every sampler of the same `structure`."""
        return mx.array([self.temp or 1.0, self.top_p, self.min_p], dtype=mx.float32)

    def structure(self) -> tuple:
        """What shapes the sampling graph: greedy or not, top-k, whether top-p and min-p filter."""
        return self.greedy, self.top_k, self.top_p < 1.0, self.min_p > 0

    def probs(self, logits: mx.array, values: mx.array | None = None) -> mx.array:
        """The distribution actually sampled from (fp32): temperature, then top-k, then top-p, then min-p,
        renormalised. `values` (`values()` of a sampler of the same structure) replaces the fields' numbers."""
        temp, top_p, min_p = (self.temp, self.top_p, self.min_p) if values is None else values
        logits = logits.astype(mx.float32) / temp
        V = logits.shape[-1]
        if 0 < self.top_k < V:
            kth = mx.sort(logits, axis=-1)[..., V - self.top_k, None]
            logits = mx.where(logits < kth, -mx.inf, logits)
        p = mx.softmax(logits, axis=-1)
        if self.top_p < 1.0:
            order = mx.argsort(-p, axis=-1)
            sorted_p = mx.take_along_axis(p, order, axis=-1)
            # Keep a token when the mass before it is below top_p: the smallest set reaching top_p, at least one.
            keep_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) < top_p
            keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
            p = mx.where(keep, p, 0.0)
            p = p / p.sum(axis=-1, keepdims=True)
        if self.min_p > 0:
            p = mx.where(p >= min_p * p.max(axis=-1, keepdims=True), p, 0.0)
            p = p / p.sum(axis=-1, keepdims=True)
        return p

    def __call__(self, logits: mx.array, values: mx.array | None = None, key: mx.array | None = None) -> mx.array:
        """Tokens from logits [..., V]; `key`: sample_from's (None: MLX's global generator)."""
        if self.greedy:
            return argmax(logits)  # one kernel on a GPU (metal/argmax.py)
        return sample_from(self.probs(logits, values), key)


def sample_from(p: mx.array, key: mx.array | None = None) -> mx.array:
    """One draw per row of the probability table p [..., V]. `key`: a PRNG key [2] (mx.random.key) for p [V], or
    keys [R, 2], one per row of p [R, V] (each row its own stream: a batch's sequences); None: MLX's global
    generator."""
    if key is None or key.ndim == 1:
        return mx.random.categorical(mx.log(p), axis=-1, key=key)
    return mx.vmap(lambda k, lp: mx.random.categorical(lp, axis=-1, key=k))(key, mx.log(p))


def split_keys(keys: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's PRNG key [R, 2] split in two: (the keys to keep [R, 2], one use's keys [R, 2])."""
    both = mx.vmap(mx.random.split)(keys)  # [R, 2, 2]
    return both[:, 0], both[:, 1]


def accept_greedy(target_tokens: list[int], drafts: list[int]) -> int:
    """Number of leading drafts equal to the target's argmax at the same position."""
    n = 0
    while n < len(drafts) and drafts[n] == target_tokens[n]:
        n += 1
    return n


def bonus_row(p: mx.array, K: int) -> mx.array:
    """The distribution the token after K acceptances is drawn from: the target's row K, [1, V] (none: [0, V])."""
    return p[K:]


def accept_sampled_arrays(p: mx.array, q: mx.array, drafts: mx.array,
                          key: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """Exact speculative sampling (Leviathan et al. 2023) as array ops, no sync: p [K or K+1, V] target, q [K, V]
    draft distributions, drafts [K] int32. Draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)), each with its
    own uniform; at the first rejection n the token is drawn from norm(max(0, p_n - q_n)), after K acceptances from
    p_K (when given; else the token is meaningless). Returns n [scalar int32], the token [scalar int32] and tokens
    [K+1] whose first n + 1 are the round's output (the kept drafts, then the token). `key`: a PRNG key [2] for
    the draws (None: MLX's global generator)."""
    K = drafts.shape[0]
    rows = iota(K)
    ratio = p[rows, drafts] / mx.maximum(q[rows, drafts], 1e-30)
    keys = (None, None) if key is None else mx.random.split(key)
    n = mx.cumprod((mx.random.uniform(shape=(K,), key=keys[0]) < ratio).astype(mx.int32)).sum()
    residual = mx.maximum(p[:K] - q, 0.0)
    total = residual.sum(axis=-1, keepdims=True)
    # p == q leaves no residual mass (and then a draft is never rejected); guard the division all the same
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[:K])
    table = mx.concatenate([residual, bonus_row(p, K)], axis=0)  # row n: the token's distribution after n kept
    token = sample_from(table[mx.minimum(n, table.shape[0] - 1)], keys[1]).astype(mx.int32)
    tokens = mx.where(iota(K + 1) == n, token, mx.concatenate([drafts.astype(mx.int32), mx.zeros((1,), mx.int32)]))
    return n, token, tokens


def accept_sampled(p: mx.array, q: mx.array, drafts: list[int]) -> tuple[int, int | None]:
    """`accept_sampled_arrays` read back: (accepted, the next token, or None after K acceptances without p_K)."""
    K = len(drafts)
    if K == 0:
        return 0, sample_from(p[0]).item()
    n, token, _ = accept_sampled_arrays(p, q, mx.array(drafts, dtype=mx.int32))
    n, token = mx.stack([n, token]).tolist()
    return n, (token if n < K or p.shape[0] > K else None)
