"""Tree-structured speculation: the MTP head proposes the top-k tokens at each depth (shape "2-2-1": two at depth 1,
two under each, one under each of those), the target verifies every node in one forward (tree attention mask,
GDN recurrence following parent indices, conv windows per path), and the longest agreeing path is kept.

Acceptance is exact. Greedy: follow the child equal to the target's argmax. Sampling (SpecInfer-style recursive
rejection with one-hot drafts): at a node with target distribution p, try its children in order, accepting child c
with probability p(c) and otherwise removing c from p and renormalising; if none is accepted, draw from what is left.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from . import cache as caches
from .generate import prefill
from .models.qwen3_5 import Tree
from .sample import Sampler, sample_from


def parse_shape(spec: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(p) for p in spec.split("-"))
    except ValueError:
        shape = ()
    if not shape or any(w < 1 for w in shape) or len(shape) > 8:
        raise ValueError(f"bad tree shape {spec!r}: use widths per depth such as 2-2-1 (1..8 depths)")
    return shape


@dataclass
class TreeStats:
    shape: tuple[int, ...]
    rounds: int = 0
    depth_hist: list[int] = field(default_factory=list)  # rounds whose accepted path had this many drafts
    branch_hist: list[list[int]] = field(default_factory=list)  # per depth: how often each child rank was taken

    def record(self, depth: int, ranks: list[int]) -> None:
        self.depth_hist += [0] * (depth + 1 - len(self.depth_hist))
        self.depth_hist[depth] += 1
        for d, r in enumerate(ranks):
            while len(self.branch_hist) <= d:
                self.branch_hist.append([0] * self.shape[len(self.branch_hist)])
            self.branch_hist[d][r] += 1
        self.rounds += 1

    def to_dict(self) -> dict:
        accepted = sum(d * n for d, n in enumerate(self.depth_hist))
        return {"tree": "-".join(map(str, self.shape)), "tree_nodes": _count_nodes(self.shape), "rounds": self.rounds,
                "mean_accepted_length": accepted / self.rounds if self.rounds else 0.0,
                "accepted_depth_hist": self.depth_hist, "branch_hist": self.branch_hist}


def _count_nodes(shape: tuple[int, ...]) -> int:
    total, width = 0, 1
    for w in shape:
        width *= w
        total += width
    return total


class TreeDrafter:
    """Builds the draft tree with the MTP head; its KV cache keeps exactly one row per verified position."""

    def __init__(self, model, shape: tuple[int, ...], mode: str = "post"):
        self.model, self.shape, self.mode = model, shape, mode
        self.cache = model.mtp.make_cache()
        self.tokens, self.hidden = [], []

    def observe(self, tokens: list[int], hidden: mx.array) -> None:
        self.tokens += tokens
        self.hidden.append(hidden)

    def _head(self, tokens: mx.array, hidden: mx.array):
        head = self.model.mtp
        x = head(self.model.model.embed_tokens(tokens)[None], hidden[None], self.cache)[:, -1:]
        post = head.norm(x)
        logits = self.model.lm_logits(head.to_target(post))[0, -1]
        return logits, (post if self.mode == "post" else x)[0]

    def propose(self, y: int) -> tuple[mx.array, list[int], list[int]]:
        """Returns (tokens, parents, child rank) for nodes 1..N (node 0 is y, not included). The tokens are a lazy
        int array [N]: the tree's layout depends only on the shape, so nothing is read back until the verify."""
        head = self.model.mtp
        hidden = head.from_target(mx.concatenate(self.hidden), self.mode)
        logits, h = self._head(mx.array(self.tokens), hidden)
        self.tokens, self.hidden = [], []
        tokens, parents, ranks = [], [], []
        self._expand(logits, h, 0, 0, tokens, parents, ranks)
        return mx.stack(tokens), parents, ranks

    def _expand(self, logits, h, node: int, depth: int, tokens, parents, ranks) -> None:
        top = mx.argsort(-logits)[: self.shape[depth]]
        children = []
        for r in range(self.shape[depth]):
            tokens.append(top[r])
            parents.append(node)
            ranks.append(r)
            children.append((len(tokens), top[r : r + 1]))
        if depth + 1 == len(self.shape):
            return
        for child, t in children:
            child_logits, child_h = self._head(t, h)
            self._expand(child_logits, child_h, child, depth + 1, tokens, parents, ranks)
            caches.rollback(self.cache, 1)


class OracleTreeDrafter(TreeDrafter):
    """SYNTHETIC tree drafts for benchmarks (greedy only): builds the real tree with the MTP head (its cost is paid),
    then relabels it against a recorded greedy continuation. Under each node on the true path, the child of rank r
    holds the true next token with probability p * decay**r given that the ranks before it did not (at most one
    child does); every other node gets a token that is surely wrong. A chain (all widths 1) is then exactly the
    chain oracle at per-position acceptance p. decay is a modelling assumption, not a fit: on the demo head the
    ranks below 1 added less (width-3 and width-4 trees accepted 0.66 / 0.69 per round where the 3-chain accepted
    0.92), i.e. a smaller decay; the smaller it is, the more chains are favoured. This drafter reads its tokens
    back before the verify (a sync the real lazy tree drafter no longer has)."""

    def __init__(self, model, shape: tuple[int, ...], reference: list[int], p: float, *, decay: float = 0.6,
                 seed: int = 0, mode: str = "post"):
        super().__init__(model, shape, mode)
        import random

        self.reference, self.p, self.decay = reference, p, decay
        self.rng = random.Random(seed)
        self.generated = 0
        self.vocab = model.args.vocab_size

    def observe(self, tokens: list[int], hidden: mx.array) -> None:
        super().observe(tokens, hidden)
        if not hasattr(self, "prompt_tail"):  # the first call carries prompt[1:] and the first generated token
            self.prompt_tail = len(tokens) - 1
        self.generated += len(tokens)

    def propose(self, y: int) -> tuple[list[int], list[int], list[int]]:
        tokens, parents, ranks = super().propose(y)
        tokens = tokens.tolist()
        # generated counts the prompt tail observed at start too; the true next token is reference[position]
        pos = self.generated - self.prompt_tail
        truth = lambda d: self.reference[pos + d] if pos + d < len(self.reference) else 0  # noqa: E731
        on_path = {0: 0}  # node -> depth, for nodes on the true path (node 0 = y)
        out = []
        for i, (t, parent, rank) in enumerate(zip(tokens, parents, ranks), start=1):
            depth = on_path.get(parent)
            if depth is not None and rank == 0:
                self._hit = None  # a new sibling group starts at rank 0
                for r in range(self.shape[depth]):
                    if self.rng.random() < self.p * self.decay**r:
                        self._hit = r
                        break
            if depth is not None and rank == self._hit:
                on_path[i] = depth + 1
                out.append(truth(depth))
            else:
                wrong = truth(depth if depth is not None else 0)
                out.append(t if t != wrong else (t + 1) % self.vocab)
        return out, parents, ranks


def accept_path(tree: Tree, tokens: list[int], logits: mx.array, sampler: Sampler,
                targets: list[int] | None = None) -> tuple[list[int], int]:
    """The accepted path (node indices from the root) and the token that follows it. Greedy: `targets`, every
    node's argmax, if the caller already read them back."""
    children = {i: [j for j, p in enumerate(tree.parents) if p == i] for i in range(len(tree.parents))}
    node, path = 0, [0]
    if sampler.greedy and targets is None:
        targets = mx.argmax(logits, axis=-1).tolist()  # one read-back for every node
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


def tree_step(model, ids: mx.array, *, sampler: Sampler, shape: tuple[int, ...], stats: TreeStats,
              mtp_hidden: str = "post", drafter: TreeDrafter | None = None) -> Iterator[int]:
    """Yields tokens with the distribution of plain decoding (identical tokens when greedy). `drafter`: e.g. an
    OracleTreeDrafter for benchmarks; by default the MTP head's top-k tree."""
    if not model.has_mtp:
        raise ValueError("tree drafting needs MTP weights (mtp.*), and this checkpoint has none")
    cache, drafter = model.make_cache(), drafter or TreeDrafter(model, shape, mtp_hidden)
    logits, hidden = prefill(model, ids, cache, hidden=mtp_hidden)
    y = sampler(logits).item()
    yield y
    drafter.observe([*ids.tolist()[1:], y], hidden)
    while True:
        tokens, parents, ranks = drafter.propose(y)
        tree = Tree(tuple([-1, *parents]))
        caches.begin(cache)
        lazy = isinstance(tokens, mx.array)
        if lazy:  # the verify is built on the lazy drafts while they compute; one read-back for both
            mx.async_eval(tokens)
            inputs = mx.concatenate([mx.array([y]), tokens.astype(mx.int32)])[None]
        else:
            inputs = mx.array([[y, *tokens]])
        logits, hidden = model(inputs, cache, return_hidden=mtp_hidden, tree=tree)
        targets = mx.argmax(logits[0], axis=-1) if sampler.greedy else None
        if lazy:
            mx.eval(tokens, *([targets] if targets is not None else [logits]))
            tokens = tokens.tolist()
        targets = targets.tolist() if targets is not None else None
        all_tokens = [y, *tokens]
        path, token = accept_path(tree, all_tokens, logits[0], sampler, targets)
        caches.keep(cache, path)
        caches.commit(cache)
        accepted = [all_tokens[i] for i in path[1:]]
        stats.record(len(accepted), [ranks[i - 1] for i in path[1:]])
        drafter.observe([*accepted, token], hidden[0, mx.array(path)])
        y = token
        yield from accepted
        yield token
