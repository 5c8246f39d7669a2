"""Speculation as the user asks for it (SpecOptions) and as the loop reports it (SpecStats): one options object from
the CLI and the API to the loops, one statistics schema from the loops to the CLI's JSON and the benchmark."""

import math
from dataclasses import asdict, dataclass, field, replace

DRAFT_SOURCES = ("mtp", "self", "ngram", "mtp+ngram")
VERIFIERS = ("batched", "sequential", "pipelined")
MAX_DRAFT_TOKENS = 8
# K when --draft-tokens is not given: adaptive depth ranges over 1..4 (a depth past 4 paid in no leg measured), a fixed
# depth is 3 (the best fixed K measured at acceptance 0.8 and with the demo's head: docs/results/README.md)
ADAPTIVE_MAX_K, FIXED_K = 4, 3


def parse_tree(spec: str) -> tuple[int, ...]:
    """'2-2-1' -> (2, 2, 1): the top-k width of the draft tree at each depth."""
    try:
        shape = tuple(int(p) for p in spec.split("-"))
    except ValueError:
        shape = ()
    if not shape or any(w < 1 for w in shape) or len(shape) > MAX_DRAFT_TOKENS:
        raise ValueError(f"bad tree shape {spec!r}: use widths per depth such as 2-2-1 (1..8 depths)")
    return shape


@dataclass(frozen=True)
class SpecOptions:
    """draft: 'mtp' (the checkpoint's MTP head), 'self[:LAYERS]' (a subset of the target's layers), 'ngram' (prompt
    lookup) or 'mtp+ngram'; draft_tokens: K, the most drafted per round (None: ADAPTIVE_MAX_K when adaptive,
    FIXED_K when not); verify: 'batched' (one forward over K+1
    tokens), 'pipelined' (batched, every decision on the device and the next round dispatched before this one is
    read; MTP chains: pipelined.py), 'sequential' (one per token, the A/B reference) or 'auto' (the default: pipelined
    for MTP chains on one process, batched otherwise; `resolved`); adaptive: tune K from measured
    acceptance and cost and turn speculation off when it cannot pay; tree: verify a tree of MTP drafts, widths per
    depth ('2-2-1')."""

    draft: str = "mtp"
    draft_tokens: int | None = None
    verify: str = "auto"
    adaptive: bool = True
    tree: str | None = None

    def __post_init__(self):
        if self.draft_tokens is None:
            object.__setattr__(self, "draft_tokens", ADAPTIVE_MAX_K if self.adaptive else FIXED_K)
        if self.draft.partition(":")[0] not in DRAFT_SOURCES:
            raise ValueError(f"unknown draft source {self.draft!r}: use mtp, self[:LAYERS], ngram or mtp+ngram")
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int) \
                or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens (--draft-tokens) must be an integer in 1..{MAX_DRAFT_TOKENS}, "
                             f"got {self.draft_tokens!r}")
        if self.verify not in (*VERIFIERS, "auto"):
            raise ValueError(f"unknown verifier (--verify) {self.verify!r}: use auto, batched, pipelined or "
                             "sequential")
        if self.verify == "pipelined":
            if self.draft != "mtp" or self.tree is not None:
                raise ValueError("--verify pipelined drafts with the MTP head in chains: drop "
                                 + ("--tree" if self.tree is not None else f"--draft {self.draft}"))
        if self.tree is not None:
            parse_tree(self.tree)
            if self.draft != "mtp":
                raise ValueError(f"a draft tree is built by the MTP head: tree with draft {self.draft!r} is not a "
                                 "combination (drop the draft source)")

    def resolved(self, *, split: bool = False, host_drafter: bool = False) -> "SpecOptions":
        """'auto' made concrete: pipelined rounds for MTP chains (the faster verifier in every leg measured:
        docs/results/code_measurements.md, 'pipelined tuner'), batched for other draft
        sources, trees, a model split over processes (`split`) or a draft source that runs on the host
        (`host_drafter`: an object with `propose`, e.g. synthetic.OracleDrafter)."""
        if self.verify != "auto":
            return self
        chain = self.draft == "mtp" and self.tree is None and not split and not host_drafter
        return replace(self, verify="pipelined" if chain else "batched")

    @property
    def needs_mtp(self) -> bool:
        return self.draft in ("mtp", "mtp+ngram")


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


@dataclass
class SpecStats:
    """Raw counts of one generation's speculation (summable with +); to_dict() adds the rates derived from them."""

    draft: str = "mtp"
    verify: str = "batched"
    draft_tokens: int = 0  # K (the largest tried, when adaptive); a tree's depth
    tree: str | None = None
    rounds: int = 0
    proposed_at: list[int] = field(default_factory=list)  # rounds that drafted a token at position i
    accepted_at: list[int] = field(default_factory=list)  # rounds that accepted the draft at position i
    accepted_hist: list[int] = field(default_factory=list)  # rounds that accepted exactly n drafts
    branch_hist: list[list[int]] = field(default_factory=list)  # trees: per depth, accepted child ranks
    draft_time_s: float = 0.0  # building the drafts (lazy drafts' device time lands in verify_time_s)
    verify_time_s: float = 0.0
    rollback_time_s: float = 0.0
    decisions: list[str] = field(default_factory=list)
    # pipelined tuner diagnostics: its first changes of K and off decisions with the costs behind them, slow passes
    tuner_log: list[str] = field(default_factory=list)
    # per position: the round (1, 2, ..) that last drafted it (accepted_per_position's `fresh`; not in to_dict)
    last_drafted: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, options: SpecOptions) -> "SpecStats":
        if options.tree:  # a tree verifies all its nodes in one forward; branch_hist has a slot per child rank
            shape = parse_tree(options.tree)
            return cls(draft="mtp", verify="tree", draft_tokens=len(shape), tree=options.tree,
                       branch_hist=[[0] * w for w in shape])
        return cls(draft=options.draft, verify=options.verify, draft_tokens=options.draft_tokens)

    def record(self, proposed: int, accepted: int, ranks: list[int] = ()) -> None:
        """One round: `proposed` draft positions, the first `accepted` of them kept (trees: the child `ranks`)."""
        self.proposed_at = _add_lists(self.proposed_at, [1] * proposed)
        self.accepted_at = _add_lists(self.accepted_at, [1] * accepted + [0] * (proposed - accepted))
        self.accepted_hist = _add_lists(self.accepted_hist, [0] * accepted + [1])
        self.last_drafted = [self.rounds + 1] * proposed + self.last_drafted[proposed:]
        for d, r in enumerate(ranks):
            if d == len(self.branch_hist):
                self.branch_hist.append([])
            self.branch_hist[d] = _add_lists(self.branch_hist[d], [0] * r + [1])
        self.rounds += 1

    def __add__(self, other: "SpecStats") -> "SpecStats":
        out = SpecStats(self.draft, self.verify, max(self.draft_tokens, other.draft_tokens), self.tree,
                        decisions=self.decisions + other.decisions, tuner_log=self.tuner_log + other.tuner_log)
        for name in ("rounds", "draft_time_s", "verify_time_s", "rollback_time_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("proposed_at", "accepted_at", "accepted_hist"):
            setattr(out, name, _add_lists(getattr(self, name), getattr(other, name)))
        n = max(len(self.last_drafted), len(other.last_drafted))
        mine, theirs = (v + [0] * (n - len(v)) for v in (self.last_drafted, other.last_drafted))
        # (in the sum's count of rounds, other's come after self's)
        out.last_drafted = [max(a, b + self.rounds if b else 0) for a, b in zip(mine, theirs)]
        depth = max(len(self.branch_hist), len(other.branch_hist))
        pad = lambda h: h + [[]] * (depth - len(h))  # noqa: E731
        out.branch_hist = [_add_lists(a, b) for a, b in zip(pad(self.branch_hist), pad(other.branch_hist))]
        return out

    def accepted_per_position(self, min_rounds: int = 0, hope: float = 0.0, fresh: int = 0) -> list[float]:
        """Share of the rounds that drafted position i whose draft i was accepted (so were all before it). With
        min_rounds: the first position, then the next ones while at least that many rounds drafted them (the
        tuner's view: tuning.expected_tokens continues the rest from the last conditional rate). `hope` adds that
        many accepted rounds at every position (an optimistic estimate from few rounds). `fresh`: the first position,
        then the next ones while one of the last `fresh` rounds drafted them (a rate read long ago, at a depth the
        tuner left, is continued as one never read)."""
        out = []
        for i, (a, p) in enumerate(zip(self.accepted_at, self.proposed_at)):
            if min_rounds and (not p or (i and p < min_rounds)):
                break
            if fresh and i and self.rounds - (self.last_drafted[i] if i < len(self.last_drafted) else 0) >= fresh:
                break
            out.append((a + hope) / (p + hope) if p else 0.0)
        return out

    def to_dict(self) -> dict:
        drafted, accepted = sum(self.proposed_at), sum(self.accepted_at)
        out = {
            **{k: v for k, v in asdict(self).items() if k != "last_drafted"},
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "accepted_per_position": self.accepted_per_position(),
            "mean_accepted_length": accepted / self.rounds if self.rounds else 0.0,
        }
        if self.tree:
            out["tree_nodes"] = sum(math.prod(parse_tree(self.tree)[: d + 1]) for d in range(self.draft_tokens))
        return out
