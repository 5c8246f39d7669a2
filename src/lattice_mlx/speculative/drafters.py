"""Draft sources for the speculative loop: the MTP head, self-speculation (a subset of the target's own layers),
prompt lookup (n-gram), and their hybrid. All share one protocol, so verify / accept / rollback is written once:

    start(prompt, first, hidden, cache)  once, after prefill (hidden: the target hidden of every prompt position)
    propose(history, k) -> drafts, q     up to k drafts: a list of ids, or a lazy int array [len] that the verifier
                                         evaluates with its own forward (one sync per round); q [len, V] when
                                         sampling, None for one-hot drafts
    rollback()                           undo the draft's own scratch work after verification
    observe(tokens, hidden)              the verified tokens of a round and the target hidden that precedes each
"""

import mlx.core as mx

from .. import cache as caches
from ..decode import PREFILL_STEP
from ..metal.argmax import argmax
from ..sample import Sampler

# Slots the MTP head takes per catch-up forward during a plain stretch (adaptive depth switched speculation off): one
# row count however long the stretch. A forward over a row count not seen before compiles new kernels on a GPU (the
# 4-bit matmul's template takes its rows; seconds under CUDA), and one piece of a stretch's length was a new count
# at every stretch. <= the 4-bit kernel's MAX_ROWS and the compiled path's MAX_T.
CATCH_UP_ROWS = 8


def _pick(sampler: Sampler, logits: mx.array, values: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
    """A draft and its distribution q (None when greedy); `values`: Sampler.values() as a traced round's input."""
    if sampler.greedy:
        return argmax(logits), None
    q = sampler.probs(logits) if values is None else sampler.probs(logits, values)
    return mx.random.categorical(mx.log(q)), q


def mtp_step(model, tokens: mx.array, hidden: mx.array, cache: list) -> tuple[mx.array, mx.array]:
    """One MTP head step: slots pairing embed(tokens [T]) with hidden [T, H] (the head's basis) -> the last slot's
    logits [V] (over the head's draft vocabulary [|ids|] when it has one: DraftVocab.to_full maps a pick) and the
    hidden that feeds the next slot [1, H]."""
    head = model.mtp
    x = head(model.model.embed_tokens(tokens)[None], hidden[None], cache)[:, -1:]
    post = head.norm(x)
    u = head.to_target(post)
    logits = (head.draft_vocab.lm_logits(model, u) if head.draft_vocab is not None else model.lm_logits(u))[0, -1]
    return logits, (post if head.input_hidden == "post" else x)[0]


def feed_head(model, tokens: list[int] | mx.array, hidden: mx.array, cache: list, *, step: int = PREFILL_STEP,
              wait: bool = True) -> None:
    """The MTP head's slots pairing tokens [T] with the target hiddens [T, H] before them, written to its cache in
    chunks of `step` (memory bounded by the chunk, as the target's prefill). wait=False queues each chunk behind the
    work already dispatched instead of waiting for it (catch-up inside the decode loop)."""
    for start in range(0, len(tokens), step):
        chunk = mx.array(tokens[start : start + step])
        h = model.mtp.from_target(hidden[start : start + step])
        model.mtp(model.model.embed_tokens(chunk)[None], h[None], cache)
        (mx.eval if wait else mx.async_eval)([c.state for c in cache])


def mtp_prefill(model, tokens: list[int], hidden: mx.array, cache: list, *, step: int = PREFILL_STEP):
    """Feeds the MTP head the prompt's slots (tokens [T] with the target hiddens [T, H]) but the last chunk, and
    returns that chunk's slots, which the first draft step adds together with its own (it needs their output)."""
    cut = len(tokens) - (len(tokens) % step or step)
    feed_head(model, tokens[:cut], hidden[:cut], cache, step=step)
    return tokens[cut:], hidden[cut:]


class MTPDrafter:
    """Drafts with the checkpoint's MTP head. Its KV cache holds one row per verified target position: slot j pairs
    embed(t_{j+1}) with the target hidden h_j (RoPE position j); rows built on the head's own hidden are dropped."""

    def __init__(self, model, sampler: Sampler):
        self.model, self.sampler = model, sampler
        self.cache = model.mtp.make_cache()
        self.tokens, self.hidden, self.drafted = [], [], 0

    def start(self, prompt: list[int], first: int, hidden: mx.array, cache: list) -> None:
        tokens, hidden = mtp_prefill(self.model, [*prompt[1:], first], hidden, self.cache)
        self.tokens, self.hidden, self.tail = list(tokens), [hidden], len(tokens)

    # slots of the prompt's last chunk still pending: they go with the first forward (a draft's or a catch-up piece's)
    tail = 0

    def observe(self, tokens: list[int], hidden: mx.array) -> None:
        self.tokens += tokens
        self.hidden.append(hidden)
        if len(self.tokens) <= self.tail + CATCH_UP_ROWS:
            return
        # more slots than a round leaves: a plain stretch (adaptive depth). Feed the head CATCH_UP_ROWS at a time as
        # they come (queued behind the plain steps; the first piece also takes the prompt's pending slots), keeping
        # the newest for the next draft step, which needs its output.
        hidden = mx.concatenate(self.hidden)
        while len(self.tokens) > self.tail + CATCH_UP_ROWS:
            rows, self.tail = self.tail + CATCH_UP_ROWS, 0
            feed_head(self.model, self.tokens[:rows], hidden[:rows], self.cache, step=rows, wait=False)
            self.tokens, hidden = self.tokens[rows:], hidden[rows:]
        self.hidden = [hidden]

    def propose(self, history: list[int], k: int) -> tuple[list[int], mx.array | None]:
        tokens, h = mx.array(self.tokens), self.model.mtp.from_target(mx.concatenate(self.hidden))
        self.tokens, self.hidden, self.tail = [], [], 0
        drafts, qs = [], []
        vocab = self.model.mtp.draft_vocab
        for _ in range(k):
            logits, h = mtp_step(self.model, tokens, h, self.cache)
            d, q = _pick(self.sampler, logits)
            if vocab is not None:
                d, q = vocab.to_full(d, q, self.model.args.vocab_size)
            drafts.append(d)
            qs += [q] if q is not None else []
            tokens = d.reshape(1)
        self.drafted = k
        # Lazy: the verifier builds its graph on these while the GPU computes them (one sync per round).
        return (mx.stack(drafts) if drafts else []), (mx.stack(qs) if qs else None)

    def rollback(self) -> None:
        if self.drafted:
            caches.rollback(self.cache, self.drafted - 1)
        self.drafted = 0


class NgramDrafter:
    """Prompt lookup: find the longest n-gram (n = max_n .. min_n) that ends the history and occurred before, and
    propose what followed its most recent earlier occurrence. Drafts are deterministic (q is one-hot). The n-grams
    are indexed incrementally as the history grows, so a round costs O(max_n) lookups, not a scan."""

    def __init__(self, vocab_size: int, *, max_n: int = 4, min_n: int = 2):
        self.vocab, self.max_n, self.min_n = vocab_size, max_n, min_n
        self._seq, self._done, self._last = None, 0, {}

    def start(self, prompt, first, hidden, cache) -> None:
        pass

    def observe(self, tokens, hidden) -> None:
        pass

    def rollback(self) -> None:
        pass

    def _index(self, seq: list[int]) -> None:
        if seq is not self._seq or len(seq) < self._done:
            self._seq, self._done, self._last = seq, 0, {}
        # Continuation start e indexes the n-grams seq[e-n:e]; e stops before len(seq) so the tail never finds itself.
        for e in range(max(self._done, 1), len(seq)):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self._last[tuple(seq[e - n : e])] = e
        self._done = max(self._done, len(seq))

    def lookup(self, history: list[int], k: int) -> list[int]:
        self._index(history)
        for n in range(min(self.max_n, len(history) - 1), self.min_n - 1, -1):
            e = self._last.get(tuple(history[-n:]))
            if e is not None:
                return history[e : e + k]
        return []

    def propose(self, history: list[int], k: int) -> tuple[list[int], mx.array | None]:
        return self.lookup(history, k), None


class HybridDrafter:
    """`mtp+ngram`: the n-gram proposal when the history has a match, the MTP head otherwise. The MTP head keeps
    observing every verified position, so its cache stays complete in n-gram rounds."""

    def __init__(self, ngram: NgramDrafter, mtp: MTPDrafter):
        self.ngram, self.mtp = ngram, mtp

    def start(self, prompt, first, hidden, cache) -> None:
        self.mtp.start(prompt, first, hidden, cache)

    def observe(self, tokens, hidden) -> None:
        self.mtp.observe(tokens, hidden)

    def rollback(self) -> None:
        self.mtp.rollback()

    def propose(self, history: list[int], k: int) -> tuple[list[int], mx.array | None]:
        drafts = self.ngram.lookup(history, k)
        return (drafts, None) if drafts else self.mtp.propose(history, k)


class OverlayKVCache:
    """Read-only view of a target KV cache plus the draft's own rows; the target's arrays are never written."""

    def __init__(self, base: caches.KVCache):
        self.base_k, self.base_v = (base.keys[..., : base.offset, :], base.values[..., : base.offset, :]) \
            if base.keys is not None else (None, None)
        self.offset = base.offset
        self.k = self.v = None

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        self.k = k if self.k is None else mx.concatenate([self.k, k], axis=2)
        self.v = v if self.v is None else mx.concatenate([self.v, v], axis=2)
        self.offset += k.shape[2]
        if self.base_k is None:
            return self.k, self.v
        return mx.concatenate([self.base_k, self.k], axis=2), mx.concatenate([self.base_v, self.v], axis=2)


def parse_layers(spec: str, model) -> list[int]:
    """'gdn' (default: the GDN layers only), 'first:N', 'every:M', or a comma list of layer indices."""
    n = len(model.layers)
    if spec in ("", "gdn"):
        return [i for i, layer in enumerate(model.layers) if layer.is_linear]
    kind, _, arg = spec.partition(":")
    if kind == "first" and arg.isdigit():
        return list(range(min(int(arg), n)))
    if kind == "every" and arg.isdigit() and int(arg) > 0:
        return list(range(0, n, int(arg)))
    if all(p.strip().isdigit() for p in spec.split(",")) and all(int(p) < n for p in spec.split(",")):
        return sorted({int(p) for p in spec.split(",")})
    raise ValueError(f"bad self-speculation layer spec {spec!r}: use gdn, first:N, every:M or a list like 0,1,2")


class SelfSpecDrafter:
    """Self-speculation: draft with a subset of the target's own layers (default: the GDN layers, skipping the
    attention layers and their MLPs), its final norm and lm_head. The draft's caches are scratch copies: GDN
    state arrays are immutable in MLX and attention layers see the target's KV through a read-only overlay."""

    def __init__(self, model, sampler: Sampler, layers: str = "gdn"):
        self.model, self.sampler = model, sampler
        self.layers = parse_layers(layers, model)

    def start(self, prompt, first, hidden, cache) -> None:
        self.target_cache = cache

    def observe(self, tokens, hidden) -> None:
        pass

    def rollback(self) -> None:
        pass

    def scratch(self) -> dict[int, object]:
        out = {}
        for i in self.layers:
            c = self.target_cache[i]
            if isinstance(c, caches.GDNCache):
                s = caches.GDNCache()
                s.conv, s.ssm, s.offset = c.conv, c.ssm, c.offset
                out[i] = s
            else:
                out[i] = OverlayKVCache(c)
        return out

    def propose(self, history: list[int], k: int) -> tuple[list[int], mx.array | None]:
        model, scratch = self.model, self.scratch()
        tok = mx.array([[history[-1]]])
        drafts, qs = [], []
        for _ in range(k):
            h = model.model.embed_tokens(tok)
            for i in self.layers:
                h = model.layers[i](h, scratch[i])
            d, q = _pick(self.sampler, model.lm_logits(model.model.norm(h))[0, -1])
            drafts.append(d)
            qs += [q] if q is not None else []
            tok = d.reshape(1, 1)
        return (mx.stack(drafts) if drafts else []), (mx.stack(qs) if qs else None)


def make_drafter(kind: str, model, sampler: Sampler):
    """'mtp', 'self[:LAYERS]', 'ngram', 'mtp+ngram' (SpecOptions has checked the name)."""
    name, _, arg = kind.partition(":")
    if name in ("mtp", "mtp+ngram") and not model.has_mtp:
        raise ValueError(f"--draft {kind} needs MTP weights (mtp.*), and this checkpoint has none")
    if name == "self":
        return SelfSpecDrafter(model, sampler, arg or "gdn")
    if name == "ngram":
        return NgramDrafter(model.args.vocab_size)
    if name == "mtp+ngram":
        return HybridDrafter(NgramDrafter(model.args.vocab_size), MTPDrafter(model, sampler))
    return MTPDrafter(model, sampler)
