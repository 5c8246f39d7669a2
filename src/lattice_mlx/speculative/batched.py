"""MTP rounds over a continuous batch: every running sequence drafts K tokens with the checkpoint's MTP head, one
target forward verifies all of them ([B, K + 1] rows), and each sequence keeps its own accepted count n_b, its bonus
token and its own rollback.

A round, for B sequences at depth K (shapes: B rows, P pending head slots at most, V vocabulary):
- head: each sequence's pending slots (embed(t_{j+1}) paired with the target hidden h_j: the tokens verified in its
  last round) in one forward [B, P], right-padded; the padding is rolled to the left of each row afterwards
  (BatchKVCache.prepare / finalize) where the mask hides it; then K - 1 more head steps [B, 1] on its own hiddens;
- verify: [y_b, d_1 .. d_K] through the target, the GDN layers recording every step's state;
- accept: greedy, the leading drafts equal to the target's argmax; sampled, min(1, p/q) per draft with the residual
  resample (sample.accept_sampled_arrays), per sequence;
- rollback per sequence: attention rows past n_b + 1 rolled out of the row (right padding made left padding), the GDN
  state and conv window of step n_b picked row by row, the head's K - 1 draft rows trimmed (the same count in every
  row).
Greedy output equals each sequence's plain greedy decoding (fp32; tests/speculative/test_batched.py); sampled output
keeps the plain distribution per sequence. With `adaptive`, the pipelined tuner (tuning.PipelinedTuner: costs per
pass measured in this engine, paired against plain steps) picks K or plain steps for the batch as a whole, with its
costs kept per batch size (a power-of-two bucket); in plain steps each sequence's head slots wait and go in with
the next round's head forward.
"""

import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from .. import cache as caches
from ..batch import BatchDecoder, Sequence, filter_rows, join_rows
from ..sample import accept_greedy, accept_sampled_arrays, split_keys
from .drafters import feed_head
from .options import SpecStats
from .tuning import MIN_POSITION_ROUNDS, OFF_HOPE, PipelinedTuner


class BatchRounds(BatchDecoder):
    """A BatchDecoder whose steps are MTP rounds of depth `k` (every step advances each running sequence by 1 to
    k + 1 tokens)."""

    PROMPT_HIDDEN = True

    def __init__(self, model, *, k: int, adaptive: bool = False, **kwargs):
        if not getattr(model, "has_mtp", False):
            raise ValueError("batched MTP rounds need a checkpoint with an MTP head")
        if model.mtp.draft_vocab is not None:
            raise ValueError("batched MTP rounds draft over the whole vocabulary: this head has a draft vocabulary")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        super().__init__(model, **kwargs)
        self.k = self.k_max = k
        self.adaptive = adaptive
        # adaptive: one tuner's costs per batch size bucket (a round's extra rows cost more in a larger batch);
        # acceptance is the batch's, over every round since the engine started
        self.memories: dict[int, dict] = {}
        self.tuner, self.bucket = None, 0
        self.stats = SpecStats(draft_tokens=k)
        self.head_cache: list | None = None
        self._pending: list[tuple[list[int], mx.array]] = []  # per row: head slots to feed (tokens, hiddens [p, H])
        self.rounds = self.drafted = self.accepted = 0

    def _join(self, seq: Sequence, cache: list, hidden: mx.array) -> None:
        super()._join(seq, cache, hidden)
        # the prompt's slots: embed(t_{j+1}) with h_j; all but the last go in now, the last with the first round
        head = self.model.mtp.make_cache()
        tokens = [*seq.prompt[1:], seq.tokens[-1]]
        if len(tokens) > 1:
            feed_head(self.model, tokens[:-1], hidden[:-1], head)
        self.head_cache = join_rows(self.head_cache, head)
        self._pending.append((tokens[-1:], hidden[-1:]))

    def _drop(self, rows: list[int]) -> list[int] | None:
        keep = super()._drop(rows)
        if keep is not None:
            self._pending = [self._pending[b] for b in keep]
            if keep:
                filter_rows(self.head_cache, keep)
            else:
                self.head_cache = None
        return keep

    def _draft(self, keys: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """drafts [B, K] and, where any sequence samples, the head's distributions q [B, K, V]; `keys` [B, K + 1, 2]:
        each sequence's keys for the round (its K drafts' draws, then the acceptance's), where any samples."""
        model, head, K = self.model, self.model.mtp, self.k
        B, H = len(self.active), model.args.hidden_size
        counts = [len(t) for t, _ in self._pending]
        P = max(counts)
        tokens = mx.array([t + [0] * (P - len(t)) for t, _ in self._pending], dtype=mx.int32)  # [B, P]
        hidden = mx.stack([mx.concatenate([h, mx.zeros((P - h.shape[0], H), dtype=h.dtype)]) if h.shape[0] < P
                           else h for _, h in self._pending])  # [B, P, H]
        x = head(model.model.embed_tokens(tokens), head.from_target(hidden), self.head_cache)  # [B, P, H]
        if P > 1:  # each row's padding after its real slots becomes left padding, which the mask hides
            for c in self.head_cache:
                c.prepare(right_padding=[P - n for n in counts])
                c.finalize()
        x = x[mx.arange(B), mx.array(counts) - 1][:, None]  # each row's last real slot [B, 1, H]
        sampled = keys is not None
        drafts, qs, h = [], [], None
        for step in range(K):
            if step:  # the next slot: the last draft with the head's own hidden
                x = head(model.model.embed_tokens(drafts[-1][:, None]), h, self.head_cache)
            post = head.norm(x)
            logits = model.lm_logits(head.to_target(post))[:, -1]  # [B, V]
            h = post if head.input_hidden == "post" else x
            if sampled:
                # q [B, V]: a greedy sequence's row is never read (its drafts are checked against the argmax)
                q = mx.stack([s.sampler.probs(logits[b]) if not s.sampler.greedy else logits[b]
                              for b, s in enumerate(self.active)])
                d = mx.stack([s.sampler(logits[b], key=keys[b, step]) if not s.sampler.greedy else
                              mx.argmax(logits[b]) for b, s in enumerate(self.active)])
                qs.append(q)
            else:
                d = mx.argmax(logits, axis=-1)
            drafts.append(d.astype(mx.int32))
        return mx.stack(drafts, axis=1), (mx.stack(qs, axis=1) if qs else None)

    def _advance(self) -> list[tuple[Sequence, int]]:
        """A round for every running sequence at the depth chosen (0: a plain step, the head's slots kept)."""
        k = self._choose_k() if self.adaptive else self.k_max
        tic = time.perf_counter()
        out = self._round(k) if k else self._plain()
        if self.tuner is not None:
            self.tuner.observe(k, time.perf_counter() - tic)  # (both read their tokens back: the pass is over)
        return out

    def _choose_k(self) -> int:
        """The depth of the next pass from the tuner of this batch size's bucket (a power of two)."""
        bucket = 1 << (len(self.active) - 1).bit_length()
        if bucket != self.bucket:
            self.bucket = bucket
            self.tuner = PipelinedTuner(self.k_max, self.memories.setdefault(bucket, {}))
        return self.tuner.next_k(self.stats.accepted_per_position(MIN_POSITION_ROUNDS),
                                 lambda: self.stats.accepted_per_position(MIN_POSITION_ROUNDS, OFF_HOPE))

    def _plain(self) -> list[tuple[Sequence, int]]:
        """One plain step of every running sequence; its token and hidden join the sequence's pending head slots."""
        x = mx.array(self._last, dtype=mx.int32)[:, None]  # [B, 1]
        logits, hidden = self.model(x, self.cache, return_hidden=True)
        out = self._sample(logits[:, -1])
        for b, y in enumerate(self._last):  # (row b of the batch, whatever its sequence took)
            tokens, h = self._pending[b]
            self._pending[b] = (tokens + [y], mx.concatenate([h, hidden[b]]))
        return out

    def _round(self, K: int) -> list[tuple[Sequence, int]]:
        """One round of depth K for every running sequence."""
        self.k = K
        model, B = self.model, len(self.active)
        keys = None
        if not all(s.sampler.greedy for s in self.active):  # one split of each row's key per round
            self._keys, use = split_keys(self._keys)
            keys = mx.vmap(lambda k: mx.random.split(k, K + 1))(use)  # [B, K + 1, 2]
        drafts, q = self._draft(keys)
        gdn = [c for c in self.cache if isinstance(c, caches.GDNCache)]
        for c in gdn:
            c.begin()
        x = mx.concatenate([mx.array(self._last, dtype=mx.int32)[:, None], drafts], axis=1)  # [B, K + 1]
        logits, hidden = model(x, self.cache, return_hidden=True)  # [B, K + 1, V], [B, K + 1, H]
        ns, tokens = self._accept(logits, drafts, q, keys)
        # rollback, row by row: keep n_b + 1 of the K + 1 positions
        n = mx.array(ns, dtype=mx.int32)
        for c in self.cache:
            if isinstance(c, BatchKVCache):
                c.prepare(right_padding=[K - m for m in ns])
                c.finalize()
        rows = mx.arange(B)
        for c in gdn:
            (conv_in,), (states,) = c._conv_in, c._states  # [B, W + K + 1, C], [B, K + 1, Hv, Dv, Dk]
            W = conv_in.shape[1] - (K + 1)
            window = (n + 1)[:, None] + mx.arange(W)[None]  # [B, W]
            c.commit()
            c.conv = mx.take_along_axis(conv_in, window[..., None], axis=1)
            c.ssm = states[rows, n]
        for c in self.head_cache:
            c.trim(K - 1)
        out = []
        for b, s in enumerate(self.active):
            kept = tokens[b][: ns[b] + 1]
            self._pending[b] = (kept, hidden[b, : ns[b] + 1])
            for t in kept:
                if s.done:
                    break
                s._take(t)
                out.append((s, t))
            self._last[b] = kept[-1]
        self.rounds += 1
        self.drafted += B * K
        self.accepted += sum(ns)
        for m in ns:
            self.stats.record(K, m)
        return out

    def _accept(self, logits: mx.array, drafts: mx.array, q: mx.array | None,
                keys: mx.array | None) -> tuple[list[int], list[list[int]]]:
        """Per sequence: drafts accepted n_b, and the round's tokens (the kept drafts, then the next token)."""
        K = self.k
        if q is None:  # every sequence greedy
            target = mx.argmax(logits, axis=-1)  # [B, K + 1]
            target, d = target.tolist(), drafts.tolist()
            ns = [accept_greedy(t, dr) for t, dr in zip(target, d)]
            return ns, [dr[:m] + [t[m]] for dr, t, m in zip(d, target, ns)]
        outs = []
        for b, s in enumerate(self.active):
            if s.sampler.greedy:  # a greedy sequence beside sampled ones: its drafts against the argmax
                target = mx.argmax(logits[b], axis=-1)
                m = mx.cumprod((drafts[b] == target[:K]).astype(mx.int32)).sum()
                outs.append((m, target[m], mx.concatenate([drafts[b], target[-1:]])))
                continue
            m, token, toks = accept_sampled_arrays(s.sampler.probs(logits[b]), q[b], drafts[b],  # p [K + 1, V]
                                                   keys[b, K])
            outs.append((m, token, toks))
        mx.eval([o for triple in outs for o in triple])
        ns, tokens = [], []
        for m, token, toks in outs:
            m, toks = int(m.item()), toks.tolist()
            ns.append(m)
            tokens.append(toks[:m] + [int(token.item())])
        return ns, tokens
