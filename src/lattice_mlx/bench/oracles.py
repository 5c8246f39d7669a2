"""SYNTHETIC drafters for benchmarks and tests: they run the MTP head for its cost, then propose a recorded greedy
continuation with a chosen probability per position, so a benchmark can set the acceptance it measures at. Nothing
in the runtime imports them."""

import random

import mlx.core as mx
import numpy as np

from ..metal import iota
from ..metal.argmax import argmax
from ..sample import Sampler
from ..speculative.batched import BatchRounds
from ..speculative.draft_model import MTPDraftModel
from ..speculative.drafters import MTPDrafter
from ..speculative.pipelined import PipelinedRounds
from ..speculative.tree import TreeDrafter


class OracleDrafter(MTPDrafter):
    """SYNTHETIC chain drafts for benchmarks and tests (greedy only): runs the MTP head for its cost, then proposes the
    recorded greedy continuation `reference` (generated tokens) with probability `p_correct` per position, else a
    token that is surely wrong."""

    def __init__(self, model, sampler: Sampler, reference: list[int], p_correct: float, *, seed: int = 0):
        super().__init__(model, sampler)
        self.reference, self.p_correct = reference, p_correct
        self.rng = random.Random(seed)
        self.vocab = model.args.vocab_size

    def start(self, prompt: list[int], first: int, hidden: mx.array, cache: list) -> None:
        super().start(prompt, first, hidden, cache)
        self.prompt_len = len(prompt)

    def propose(self, history: list[int], k: int) -> tuple[list[int], None]:
        head_drafts, _ = super().propose(history, k)
        mx.async_eval(head_drafts)  # the head's work is paid, as a real draft's would be
        pos = len(history) - self.prompt_len
        truth = [self.reference[i] if i < len(self.reference) else 0 for i in range(pos, pos + k)]
        return [t if self.rng.random() < self.p_correct else (t + 1) % self.vocab for t in truth], None


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
                 seed: int = 0):
        super().__init__(model, shape)
        self.reference, self.p, self.decay = reference, p, decay
        self.rng = random.Random(seed)
        self.generated = 0
        self.vocab = model.args.vocab_size

    def observe(self, tokens: list[int], hidden: mx.array) -> None:
        super().observe(tokens, hidden)
        if not hasattr(self, "prompt_tail"):  # the first call: the prompt's last slots (the rest went to the cache)
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


class OracleDraftModel(MTPDraftModel):
    """SYNTHETIC drafts for benchmarks (greedy): the head runs for its cost (its logits stay in the graph), then the
    draft is the recorded greedy continuation `reference` (generated tokens) with probability p, else a token that
    is surely wrong; the twin of synthetic.OracleDrafter for mlx-lm's loop."""

    def __init__(self, target, reference: list[int], p: float, prompt_len: int, *, seed: int = 0):
        super().__init__(target)
        self.reference, self.p, self.prompt_len = reference, p, prompt_len
        self.rng = random.Random(seed)

    def __call__(self, inputs: mx.array, cache: list | None = None, **kwargs) -> mx.array:
        real = super().__call__(inputs, cache, **kwargs)
        i = cache[0].offset - self.prompt_len  # the generated index of the token this call drafts
        truth = self.reference[i] if 0 <= i < len(self.reference) else 0
        V = self.target.args.vocab_size
        token = truth if self.rng.random() < self.p else (truth + 1) % V
        return 0 * real.astype(mx.float32) + (mx.arange(V) == token).astype(mx.float32)[None, None] * 100.0


class DeviceOracle:
    """SYNTHETIC drafts for benchmarks (greedy only), the device twin of synthetic.OracleDrafter: the head's drafts
    are computed (their cost is paid) and replaced by the recorded greedy continuation `reference` with probability
    `p` per position, else by a token that is surely wrong; the same random sequence as OracleDrafter's for a seed."""

    def __init__(self, reference: list[int], p: float, vocab: int, k: int, *, seed: int = 0):
        self.ref = mx.array([*reference, *[0] * (k + 1)], dtype=mx.int32)
        self.last = len(reference) + k
        self.p, self.vocab, self.k = p, vocab, k
        self.rng = random.Random(seed)
        # the synthetic overhead in as few launches as the real drafts' none (a gather and two fused kernels): the
        # benchmark measures the round, not the oracle
        # + 0 * drafts: the head's drafts stay in the graph, so their cost is paid
        self._pick = mx.compile(lambda right, truth, drafts: mx.where(right, truth, (truth + 1) % vocab) + 0 * drafts)
        self._indices: dict = {}  # per K (adaptive rounds vary it): gen -> the reference rows of its drafts

    def _index(self, k: int):
        if k not in self._indices:
            # (host data: a constant of the trace, not an arange it would launch every round)
            steps, last = mx.array(np.arange(1, k + 1, dtype=np.int32)), self.last
            self._indices[k] = mx.compile(lambda gen: mx.minimum(gen + steps, last))
        return self._indices[k]

    def __call__(self, drafts: mx.array, q, rounds: PipelinedRounds, r: int) -> tuple[mx.array, None]:
        return self.apply(drafts, q, rounds, self.device_inputs(drafts.shape[0]))

    # A traced round (PipelinedRounds.round) takes the host's draws and the reference as inputs, not constants of
    # its trace: device_inputs once per round, apply inside the trace (a round built op by op calls both).
    def device_inputs(self, k: int) -> list[mx.array]:
        return [mx.array([self.rng.random() < self.p for _ in range(k)]), self.ref]

    def apply(self, drafts: mx.array, q, rounds: PipelinedRounds, extras: list) -> tuple[mx.array, None]:
        right, ref = extras
        k = drafts.shape[0]  # <= the K it was built for (its reference is padded for that many)
        return self._pick(right, ref[self._index(k)(rounds.gen)], drafts.astype(mx.int32)), None


class OracleBatchRounds(BatchRounds):
    """SYNTHETIC batched MTP rounds for benchmarks and tests (greedy only): the head drafts as in BatchRounds (its
    work stays in the verify's graph: `+ 0 * drafts`), then each sequence's draft at each position is its recorded
    greedy continuation (`references[uid]`, generated tokens) with probability `p_correct`, else a surely wrong
    token; on the device (the positions are the rounds' `gen`, the draws from a key of its own), so rounds stay
    queued one ahead as BatchRounds' are."""

    def __init__(self, model, *, k: int, references: dict[int, list[int]], p_correct: float, seed: int = 0,
                 **kwargs):
        super().__init__(model, k=k, **kwargs)
        self.references, self.p_correct = references, p_correct
        self.p = mx.array(p_correct, dtype=mx.float32)  # (state of a traced round: a number would be a constant
        # of the trace, kept with the model for the next engine)
        self.okey = mx.random.key(seed)
        self.table: mx.array | None = None  # each row's reference [B, L], padded with 0

    def _joined(self, seq) -> None:
        ref = mx.array(self.references[seq.uid], dtype=mx.int32)[None]
        if self.table is None:
            self.table = ref
            return
        L = max(self.table.shape[1], ref.shape[1])
        pad = lambda a: mx.pad(a, [(0, 0), (0, L - a.shape[1])])  # noqa: E731
        self.table = mx.concatenate([pad(self.table), pad(ref)])

    def _more_state(self):
        return [self.table, self.okey, self.p]

    def _set_more_state(self, it):
        self.table, self.okey, self.p = next(it), next(it), next(it)

    def _drop(self, rows):
        keep = super()._drop(rows)
        if keep is not None:
            self.table = self.table[mx.array(keep, dtype=mx.int32)] if keep else None
        return keep

    def _draft(self, K, keys):
        drafts, q = super()._draft(K, keys)
        B, V, L = drafts.shape[0], self.model.args.vocab_size, self.table.shape[1]
        at = self.gen[:, None] + iota(K)[None]  # the drafts' indices among generated tokens
        truth = mx.where(at < L, mx.take_along_axis(self.table, mx.minimum(at, L - 1), axis=1), 0)
        self.okey, use = mx.random.split(self.okey)
        right = mx.random.uniform(shape=(B, K), key=use) < self.p
        oracle = mx.where(right, truth, (truth + 1) % V).astype(mx.int32)
        return oracle + 0 * drafts, q


class ForcedBatchRounds(BatchRounds):
    """SYNTHETIC batched MTP rounds for benchmarks and tests (greedy only) that keep drafts at a set rate whatever
    the target says: the head drafts and the target verifies as in BatchRounds (both costs paid, their values
    real), then which drafts a sequence keeps is drawn on the device, each position kept with probability
    `p_correct` (the sequence keeps its leading kept ones), not compared with the target's argmax; its tokens are
    the kept drafts, then the target's token after them. No recorded continuation, so no rounding difference
    between a batch's verify and its plain steps can move the acceptance off p (OracleBatchRounds' rows left plain's
    continuation on a GPU, even in float32: docs/adr/0009-batch-cache-layout.md), and the model may run in bf16.
    The tokens are not plain greedy's past the first kept draft: a measure of costs only. At p = 0 they are plain
    greedy's (every round keeps no draft and takes the target's token)."""

    def __init__(self, model, *, k: int, p_correct: float, seed: int = 0, **kwargs):
        super().__init__(model, k=k, **kwargs)
        self.p_correct = p_correct
        self.p = mx.array(p_correct, dtype=mx.float32)  # (state of a traced round, as OracleBatchRounds')
        self.okey = mx.random.key(seed)

    def _more_state(self):
        return [self.okey, self.p]

    def _set_more_state(self, it):
        self.okey, self.p = next(it), next(it)

    def _accept(self, logits, drafts, q, keys):
        if q is not None:
            raise ValueError("ForcedBatchRounds is greedy only")
        B, K = drafts.shape
        target = argmax(logits).astype(mx.int32)  # [B, K + 1]
        self.okey, use = mx.random.split(self.okey)
        kept = mx.random.uniform(shape=(B, K), key=use) < self.p
        n = mx.cumprod(kept.astype(mx.int32), axis=1).sum(axis=1)
        padded = mx.concatenate([drafts.astype(mx.int32), target[:, K:]], axis=1)  # [B, K + 1]
        return n, mx.where(iota(K + 1)[None] < n[:, None], padded, target)
