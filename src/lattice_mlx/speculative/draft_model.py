"""The MTP head as an mlx-lm draft model: `lattice_mlx.make_draft_model(model)` for `mlx_lm.stream_generate(model,
tokenizer, prompt, draft_model=..., num_draft_tokens=K)` (mlx-lm's own speculative loop; the target's GDN caches are trimmable,
cache.GDNCache).

mlx-lm calls a draft model with tokens only, `draft(tokens [1, T], cache)`; the head also needs the target's hidden
at the position before each token. The coupling:
- the target publishes the hidden of every forward it runs (`HiddenTap`, set by make_draft_model) with the
  position of its first row;
- the draft's cache (`DraftCache`) remembers every token mlx-lm fed it (its logical length is what mlx-lm trims)
  and writes a head row for token t_i (RoPE position i - 1, as this package's own loop does) with the true hidden
  h_{i-1} as soon as the target has published it; until then, a row after a written one is made from the head's
  own output (a draft chained on a draft) and rewritten with the true hidden once the target has verified it;
  rows whose predecessor is not written wait (mlx-lm prefills its draft model before its target).
- a step whose last token has no row yet (the first draft, before the target has run) returns flat logits: that
  draft is a guess, and the verifier rejects it unless it happens to be right. Exactness never depends on the draft.
"""


import mlx.core as mx

from ..cache import KVCache
from ..decode import PREFILL_STEP
from ..runtime import runtime_of


def make_draft_model(model) -> "MTPDraftModel":
    """The MTP head of `model` as a draft model for mlx-lm's speculative loop: from now on the model publishes the
    hidden of each forward to it (`MTPDraftModel.close` stops that)."""
    return MTPDraftModel(model)


class HiddenTap:
    """What the target's forwards produced: (first position, hidden [T, H]) chunks, newest last; at most MAX_ROWS
    rows are held (the oldest go first), so a target used without its draft model does not grow memory for ever."""

    MAX_ROWS = 1 << 16

    def __init__(self):
        self.chunks: list[tuple[int, mx.array]] = []
        self.cache = None  # a cache object of the target's latest forward: its offset says what is still valid

    def record(self, start: int, hidden: mx.array, cache) -> None:
        self.chunks.append((start, hidden))
        self.cache = cache
        while len(self.chunks) > 1 and sum(h.shape[0] for _, h in self.chunks) > self.MAX_ROWS:
            self.chunks.pop(0)

    def end(self, frontier: int) -> int:
        """The last position p >= frontier - 1 such that every hidden from `frontier` to p is published and still
        the target's (a verify's rows past its accepted tokens are trimmed from the target's cache: their hiddens
        were computed on rejected drafts); frontier - 1 if none. The newest chunk covering a position wins."""
        p, valid = frontier - 1, (self.cache.offset if self.cache is not None else 0)
        while p + 1 < valid and any(s <= p + 1 < s + h.shape[0] for s, h in self.chunks):
            p += 1
        return p

    def rows(self, a: int, b: int) -> mx.array:
        """Hiddens of positions a..b-1, [b - a, H], each from the newest chunk holding it."""
        parts, p = [], a
        while p < b:
            s, h = next((s, h) for s, h in reversed(self.chunks) if s <= p < s + h.shape[0])
            q = min(b, s + h.shape[0])
            parts.append(h[p - s : q - s])
            p = q
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def drop_before(self, p: int) -> None:
        """Forget chunks that end before position p (never needed again)."""
        self.chunks = [(s, h) for s, h in self.chunks if s + h.shape[0] > p]


class DraftCache:
    """The draft model's cache for mlx-lm: the head's KV cache (row j = token t_{j+1}), the tokens mlx-lm fed
    (`offset` = their count, what mlx-lm trims), how many head rows exist and how many of those were made with
    the target's true hidden; rows past that were chained on the head's own output."""

    def __init__(self, head_layers: int):
        self.kv = [KVCache() for _ in range(head_layers)]
        self.tokens = mx.zeros((0,), dtype=mx.uint32)
        self.written = 0  # head rows (tokens t_1 .. t_written)
        self.true = 0  # of those, made with the target's hidden
        self.last = None  # (row count it follows, the head's hidden for chaining the next row)

    @property
    def offset(self) -> int:
        return self.tokens.shape[0]

    @property
    def state(self) -> list:
        return [a for c in self.kv for a in c.state if a is not None] + [self.tokens]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.tokens = self.tokens[: self.offset - n]
        drop = self.written - max(self.offset - 1, 0)
        if drop > 0:
            for c in self.kv:
                c.trim(drop)
            self.written -= drop
            self.true = min(self.true, self.written)
        return n

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.kv)


class MTPDraftModel:
    """The MTP head of `target` behind mlx-lm's model protocol: __call__(inputs, cache) -> logits [1, 1, V] for the
    last input token (mlx-lm samples the draft from the last row), make_cache(), layers."""

    def __init__(self, target):
        if not target.has_mtp:
            raise ValueError("make_draft_model() needs MTP weights (mtp.*), and this checkpoint has none")
        self.target, self.head = target, target.mtp
        self.tap = HiddenTap()
        runtime_of(target).hidden_tap = self.tap  # the target publishes its hiddens from now on
        self.model_type = target.model_type

    def close(self) -> None:
        """Stop the target publishing its hiddens (each forward then computes one op less)."""
        rt = runtime_of(self.target)
        if rt.hidden_tap is self.tap:
            rt.hidden_tap = None

    @property
    def layers(self) -> list:
        return self.head.layers

    def make_cache(self) -> list:
        return [DraftCache(len(self.head.layers))]

    def _rows(self, cache: DraftCache, tokens: mx.array, hidden: mx.array) -> mx.array:
        """Head rows for `tokens` [T] with the hiddens before them [T, H] (head basis); returns the head's output of
        the last row [1, 1, H] (before its norm)."""
        x = self.head(self.target.model.embed_tokens(tokens)[None], hidden[None], cache.kv)
        cache.written += tokens.shape[0]
        return x[:, -1:]

    def __call__(self, inputs: mx.array, cache: list | None = None, **kwargs) -> mx.array:
        c = cache[0]
        c.tokens = mx.concatenate([c.tokens, inputs.reshape(-1).astype(mx.uint32)])
        L = c.offset
        # 1) rows whose true hidden is now published: rewrite chained rows, then write the waiting ones
        end = min(L - 1, self.tap.end(c.true) + 1)  # the last token that can get a true row
        out = None
        if end > c.true:
            if c.written > c.true:
                for kv in c.kv:
                    kv.trim(c.written - c.true)
                c.written = c.true
            for a in range(c.true + 1, end + 1, PREFILL_STEP):  # tokens t_a .. t_b, hiddens h_{a-1} .. h_{b-1}
                b = min(end + 1, a + PREFILL_STEP)
                out = self._rows(c, c.tokens[a:b], self.head.from_target(self.tap.rows(a - 1, b - 1)))
                if b <= end:
                    mx.eval([s for kv in c.kv for s in kv.state])
            c.true = end
            c.last = (c.written, out)
            self.tap.drop_before(c.true)
        # 2) tokens past the published hiddens, chained on the head's own output while each follows a written row
        while c.written < L - 1 and c.last is not None and c.last[0] == c.written:
            post = self.head.norm(c.last[1])
            prev = post if self.head.input_hidden == "post" else c.last[1]
            out = self._rows(c, c.tokens[c.written + 1 : c.written + 2], prev[0])
            c.last = (c.written, out)
        if c.written != L - 1 or c.last is None or c.last[0] != c.written:
            # the last token has no row yet: a flat guess (the verifier decides; exactness is untouched)
            return mx.zeros((1, 1, self.target.args.vocab_size), dtype=mx.float32)
        u = self.head.to_target(self.head.norm(c.last[1]))
        vocab = self.head.draft_vocab
        if vocab is None:
            return self.target.lm_logits(u)
        # a draft vocabulary: logits over the subset, scattered into the whole vocabulary (-inf elsewhere: a token
        # outside the subset is never proposed)
        V = self.target.args.vocab_size
        if getattr(self, "_in_vocab", None) is None or self._in_vocab[0] is not vocab:
            self._in_vocab = (vocab, mx.zeros((V,), dtype=mx.bool_).at[vocab.ids].add(True))
        sub = vocab.lm_logits(self.target, u).astype(mx.float32)
        full = mx.zeros((1, 1, V), dtype=mx.float32).at[..., vocab.ids].add(sub)
        return mx.where(self._in_vocab[1], full, -mx.inf)
