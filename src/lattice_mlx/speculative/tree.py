"""Tree-structured speculation: the MTP head proposes the top-k tokens at each depth (shape "2-2-1": two at depth 1,
two under each, one under each of those), the target verifies every node in one forward (tree attention mask,
GDN recurrence following parent indices, conv windows per path), and the longest agreeing path is kept.

Acceptance is exact. Greedy: follow the child equal to the target's argmax. Sampling (SpecInfer-style recursive
rejection with one-hot drafts): at a node with target distribution p, try its children in order, accepting child c
with probability p(c) and otherwise removing c from p and renormalising; if none is accepted, draw from what is left.
"""

import time
from collections.abc import Iterator

import mlx.core as mx

from .. import cache as caches
from ..decode import prefill
from ..metal.argmax import argmax
from ..models.tree import Tree
from ..sample import Sampler, sample_from
from .drafters import mtp_prefill, mtp_step
from .options import SpecStats


class TreeDrafter:
    """Builds the draft tree with the MTP head; its KV cache keeps exactly one row per verified position."""

    def __init__(self, model, shape: tuple[int, ...]):
        self.model, self.shape = model, shape
        self.cache = model.mtp.make_cache()
        self.tokens, self.hidden = [], []

    def observe(self, tokens: list[int], hidden: mx.array) -> None:
        self.tokens += tokens
        self.hidden.append(hidden)

    def propose(self, y: int) -> tuple[mx.array, list[int], list[int]]:
        """Returns (tokens, parents, child rank) for nodes 1..N (node 0 is y, not included). The tokens are a lazy
        int array [N]: the tree's layout depends only on the shape, so nothing is read back until the verify."""
        hidden = self.model.mtp.from_target(mx.concatenate(self.hidden))
        logits, h = mtp_step(self.model, mx.array(self.tokens), hidden, self.cache)
        self.tokens, self.hidden = [], []
        tokens, parents, ranks = [], [], []
        self._expand(logits, h, 0, 0, tokens, parents, ranks)
        return mx.stack(tokens), parents, ranks

    def _expand(self, logits, h, node: int, depth: int, tokens, parents, ranks) -> None:
        top = mx.argsort(-logits)[: self.shape[depth]]
        vocab = self.model.mtp.draft_vocab
        if vocab is not None:  # the head's logits cover its draft vocabulary only
            top = vocab.ids[top]
        children = []
        for r in range(self.shape[depth]):
            tokens.append(top[r])
            parents.append(node)
            ranks.append(r)
            children.append((len(tokens), top[r : r + 1]))
        if depth + 1 == len(self.shape):
            return
        for child, t in children:
            child_logits, child_h = mtp_step(self.model, t, h, self.cache)
            self._expand(child_logits, child_h, child, depth + 1, tokens, parents, ranks)
            caches.rollback(self.cache, 1)


def accept_path(tree: Tree, tokens: list[int], logits: mx.array, sampler: Sampler,
                targets: list[int] | None = None) -> tuple[list[int], int]:
    """The accepted path (node indices from the root) and the token that follows it. Greedy: `targets`, every
    node's argmax, if the caller already read them back."""
    children = {i: [j for j, p in enumerate(tree.parents) if p == i] for i in range(len(tree.parents))}
    node, path = 0, [0]
    if sampler.greedy and targets is None:
        targets = argmax(logits).tolist()  # one read-back for every node
    while True:
        if sampler.greedy:
            best = targets[node]
            nxt = next((c for c in children[node] if tokens[c] == best), None)
            if nxt is None:
                return path, best
        else:
            p = sampler.probs(logits[node])
            nxt = None
            for c in children[node]:
                if mx.random.uniform().item() < p[tokens[c]].item():
                    nxt = c
                    break
                p = mx.where(mx.arange(p.shape[-1]) == tokens[c], 0.0, p)
                p = p / mx.maximum(p.sum(), 1e-30)
            if nxt is None:
                return path, sample_from(p).item()
        node = nxt
        path.append(node)


def run_tree(model, ids: mx.array, *, sampler: Sampler, shape: tuple[int, ...], stats: SpecStats,
             drafter: TreeDrafter | None = None) -> Iterator[int]:
    """Tree rounds (`speculate` is the entrance, and checks the model can run them): yields tokens with the
    distribution of plain decoding (identical tokens when greedy), filling `stats`. `drafter`: e.g. a synthetic
    oracle for benchmarks; by default the MTP head's top-k tree."""
    cache, drafter = model.make_cache(trimmable=False), drafter or TreeDrafter(model, shape)
    logits, hidden = prefill(model, ids, cache, return_hidden=True)
    y = sampler(logits).item()
    drafter.observe(*mtp_prefill(model, [*ids.tolist()[1:], y], hidden, drafter.cache))
    yield y
    while True:
        tic = time.perf_counter()
        tokens, parents, ranks = drafter.propose(y)
        tree = Tree(tuple([-1, *parents]))
        stats.draft_time_s += time.perf_counter() - tic  # graph building: the lazy drafts' device time is verify's
        tic = time.perf_counter()
        caches.begin(cache)
        lazy = isinstance(tokens, mx.array)
        if lazy:  # the verify is built on the lazy drafts while they compute; one read-back for both
            mx.async_eval(tokens)
            inputs = mx.concatenate([mx.array([y]), tokens.astype(mx.int32)])[None]
        else:
            inputs = mx.array([[y, *tokens]])
        logits, hidden = model(inputs, cache, return_hidden=True, tree=tree)
        targets = argmax(logits[0]) if sampler.greedy else None
        if lazy:
            mx.eval(tokens, *([targets] if targets is not None else [logits]))
            tokens = tokens.tolist()
        targets = targets.tolist() if targets is not None else None
        all_tokens = [y, *tokens]
        path, token = accept_path(tree, all_tokens, logits[0], sampler, targets)
        stats.verify_time_s += time.perf_counter() - tic
        tic = time.perf_counter()
        caches.keep(cache, path)
        caches.commit(cache)
        stats.rollback_time_s += time.perf_counter() - tic
        accepted = [all_tokens[i] for i in path[1:]]
        stats.record(len(shape), len(accepted), [ranks[i - 1] for i in path[1:]])
        drafter.observe([*accepted, token], hidden[0, mx.array(path)])
        y = token
        yield from accepted
        yield token
