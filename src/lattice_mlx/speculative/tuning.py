"""Adaptive draft depth: the tuners that pick K (or no speculation) from measured acceptance and cost, their
constants, and what a process remembers of a model's costs. `DepthTuner` serves the host-side loop (chain.py),
`PipelinedTuner` pipelined rounds (pipelined.py)."""

import logging
from collections import deque
from collections.abc import Callable

from ..runtime import runtime_of

log = logging.getLogger("lattice_mlx")

ADAPTIVE_WARMUP_ROUNDS = 4  # rounds before the first decision
# Adaptive rounds start at this depth (at most --draft-tokens) and the tuner moves K from there: a round at the
# deepest K is the dearest, and warming up on it cost the demo 0.79-0.88x plain at temperature 0.7 on the CPU
ADAPTIVE_START_K = 2
# The pipelined tuner starts at 3, the best fixed depth measured at acceptance 0.8 and with the demo's head: each
# depth's first round in a process traces its round (on a GPU once seconds of kernel builds per depth, so a first
# generation that climbed 2 -> 3 -> 4 paid three of them: docs/results/code_measurements.md, 'First use of a verify
# depth'; since the depth left the fused kernels' names, a trace alone: 'First use of a depth')
PIPELINED_START_K = 3
# A depth whose round has no trace in this process yet is taken only for at least this predicted gain over the current
# one (its first round traces its round; the kernels are the ones every depth shares, built by the process's first
# round, since the depth left the fused kernels' names: docs/results/code_measurements.md, 'First use of a depth').
# A probe and a shallower step on hope may take one
NEW_DEPTH_MIN_GAIN = 1.05
# Passes a depth is timed (after the untimed ones: SKIP, and FIRST_TRACE_SKIP more for a depth with no trace yet)
# before the tuner judges it: one slow pass read as a depth's cost steered the tuner off that depth for the rest of
# the process (its memory), in a replay of run E's costs and acceptance (scripts/bench/replay_tuner.py)
DWELL = 3
# Decisions in a row that find no depth paying before speculation goes off: one decision per round reads rates and
# costs that swing around break-even, and the first dip below it went off (the same replay)
OFF_CONFIRM = 4
PROBE_ROUNDS = 4  # rounds of speculation after a plain stretch before the next decision
PLAIN_WARMUP_STEPS, PLAIN_TIMED_STEPS = 2, 8  # the baseline: pipelined plain steps, after the T=1 shape's first cost
FIRST_OFF_TOKENS, MAX_OFF_TOKENS = 32, 1024  # plain stretch when speculation cannot pay; doubles while it cannot
# The pipelined tuner's plain stretches: longer, and growing faster, than the host loop's. Each probe of speculation
# after one has a fixed cost besides its rounds (the head's catch-up forward, a round and a plain step built op by op
# where the state changes hands: docs/results/code_measurements.md, 'The switch from plain steps to rounds'), and at
# acceptance 0 four probes in a 256-token generation lost 9% to plain
# decoding (docs/results/code_measurements.md, 'pipelined tuner'). A decision that speculation pays restarts the
# schedule: a good text that dipped once went off for 1,024 tokens, the rest of its generation, in a replay of texts
# three in ten of which draft at half the rate (docs/adr/0008, 'Run Y')
PIPELINED_FIRST_OFF, PIPELINED_OFF_GROWTH = 64, 4
# A plain stretch is counted in the process's tokens, not per generation: a generation that ends inside one hands
# the next generation the rest of it (memory["off"]), and the probe after it continues the schedule (memory["stretch"],
# the last stretch's length: the next is PIPELINED_OFF_GROWTH times it, up to MAX_OFF_TOKENS, or HOPELESS_MAX_OFF
# for hopeless ones). Restarting at 64
# tokens in every generation probed once or twice per 256 tokens at acceptance 0 and lost to plain decoding
# (docs/results/code_measurements.md, 'pipelined tuner'); carrying a stretch's whole length into every generation held
# the demo at temperature 0.7 in plain steps for eight generations after one poor start (docs/adr/0008, 'Run E'); and
# halving the carried length per generation (run F) made every other 256-token generation probe at acceptance 0, at
# 6-20% of its time (the repetitions that probed lost to plain's: 'Run F'). A carried stretch's rest waits for a probe
# of the new generation's own text (a few rounds where drafts fail, its catch-up only the prompt's slots; hopeless
# stretches excepted): texts draft unequally, and two poor texts at temperature 0.7 held the good ones after them in
# plain steps ('Runs K and L', with the replay of unequal texts, replay_tuner.py --vary, that chose this at the price
# of a probe per generation where drafts never pass).
# ... but not after this many texts in a row whose first probe found no gain: the next text goes on with the carried
# stretch, whose end probes as any stretch's (MAX_OFF_TOKENS apart at most), until speculation pays again. Where
# drafts never pass, a probe per text was most of the default's loss to plain decoding: the GPU time of plain's
# tokens and 2.7% more, with waits of tens of milliseconds where rounds began (docs/adr/0008, 'Runs P, Q and R',
# 'Run S'). Replayed, acceptance 0 went from 0.97 to 0.98 of plain over ten generations, and texts three in ten of
# which draft at a fifth of the rate lost nothing; after two poor texts they lost 0.03 (the demo at 0.7). 0: every
# text probed.
POOR_TEXTS = 3
# Plain steps' cost last read this many passes of the process ago or more is stale, and is read afresh (CHECK_PASSES
# plain steps, then rounds again) before speculation goes off on it. A host's speed drifts over a process (run F: one
# depth's cost per pass moved by two thirds within one process), and a plain cost read in a fast spell makes rounds
# read in a slow one look dear (run G's demo at 0.7 went off in its first generation on a plain cost from the
# baseline, which read a quarter higher next; docs/adr/0008, 'Run G'). Replayed with a drifting host
# (scripts/bench/replay_tuner.py --drift 0.2,0.99 and 0.3,0.98, --probe-ms 15, 30 seeds), the demo at 0.7 kept
# 0.89-0.93 of its best fixed depth without the check and 0.94-0.95 with it, oracle 0.5 0.87-0.96 and 0.97-0.98, the
# other cases unchanged; staleness from 256 passes helped less, from 64 about as much.
STALE_PASSES = 32
# A depth's cost read this many passes ago or more, while the tuner sat at another, no longer rules it out: it is
# estimated on the line through plain's cost and the current depth's, and a better estimate takes the tuner there to
# read it again. The demo at temperature 0.7 read K=2 at twice its cost in one slow spell, went to K=1 and stayed
# there for six generations where K=3 paid (docs/adr/0008, 'Run M'). Not sooner: the line is no measured cost (and
# flat where plain's cost read high), and each return to a depth on it costs the passes after a change of depth and
# DWELL passes there. Replayed, 1,024 passes ran every case as fast as 256 or up to 0.02 faster, as fast as no rule,
# and kept the demo at 0.7 over 1,024 tokens with a poor start as fast as 256 did, where no rule lost a tenth
# (docs/adr/0008, 'Run S', with the GPU's figures)
REREAD_PASSES = 1024
# ... and a depth's cost read in the process's first generation counts as that old from the second generation on:
# the first generation reads dear past the passes the tuner leaves untimed. Run Z's 0.8B shape at oracle 0.5 read
# K=2 at 1.4 times its fixed leg's cost per round in its first generation, and sat at K=3 and K=4 for seven
# generations, until the re-read age; run Q's oracle 0.8 read K=3 at 1.2 times its leg's at its first generation's
# start, run N's demo at 0.7 K=3 at 1.5-1.8 times its later readings (docs/adr/0008, 'Run Z', 'Runs P, Q and R',
# 'Runs N and O'). Unlike a first generation whose costs are dropped (run P: that lost), the readings stay: the
# line caps them only until the tuner reads them again. 0: off
FIRST_GEN_REREAD = 1
CHECK_PASSES = 6
# A neighbour of the current depth read before the tuner arrived at it is read again when the current depth's cost
# has fallen by this share since its first COST_WINDOW timed passes there (the host sped up: the neighbour's reading
# is from the slower spell), if its gain scaled by that fall is at least REVISIT_FLOOR of the current depth's. On a
# host-bound loop a slow spell raises a shallow depth's cost more than a deep one's that the GPU bounds: run V's 0.8B
# shape at oracle 0.8 read K=3 at 1.4x its cost and K=4 at 1.2x in its first repetitions, moved to K=4, and sat there
# for eight generations as K=4's cost fell by a sixth, at 0.91 of the fixed K=3 (docs/adr/0008, 'Run V'). Scaling the
# old reading instead of reading it again cannot tell a common slowdown from this one (the same page). Off (1.0):
# replayed (replay_tuner.py, 50 seeds, with a host-bound model of run V, --host-ms) at 0.15 it moved every case by
# -0.02 to +0.005 of its best fixed depth, and run W's A/B leg on the GPU gained 0.04 of the best fixed depth at
# oracle 0.8 where it fired, less than legs with the same rules differed by where it never fired (-0.07 to +0.01;
# docs/adr/0008, 'Run W')
REVISIT_DRIFT, REVISIT_FLOOR = 1.0, 0.95
# A depth's cost is the median of its last this many timed passes: on a noisy host an average let one slow pass
# steer the depth for rounds after it (the same page)
COST_WINDOW = 7
# The pipelined tuner's margins. Its costs leave out the passes just after a change of K (untraced rounds, a
# refilling pipeline), so a depth near break-even costs more than it predicts, and a tuner without a margin lost to
# plain decoding at low acceptance (docs/results/code_measurements.md, 'pipelined tuner').
SPECULATE_MIN_GAIN = 1.05  # keep speculating only at a predicted speedup of at least this
SWITCH_MIN_GAIN = 1.03  # move to a neighbouring depth only if it predicts this much more than the current one
# A draft position's measured acceptance is trusted from this many rounds that drafted it; before that the tuner
# continues the shallower positions' rate. One round at a new depth whose deepest draft was rejected read as a rate of 0
# there, and the tuner left that depth for good (the same page)
MIN_POSITION_ROUNDS = 8
# ... and only while one of the last this many rounds drafted it: a deeper position's rate read at the generation's
# start and never again (the tuner sat at a shallower depth since) held the demo at temperature 0.7 at K=1 for 460-500
# rounds of a 1,024-token generation with position 0 accepting 0.92-0.94 of its drafts, where K=3 ran at 1.48-1.73x
# plain; its rate from the start (0.35) predicted K=2 below K=1 (docs/adr/0008, 'Runs P, Q and R'). Past it the
# position is continued from the fresh ones' conditional rate, as one never read, and the tuner tries it again.
# Replayed with a text whose deeper drafts pass at 0.45 of their rate over its first 100 tokens (a quiet host, 1,024
# tokens, 80 seeds; replay_tuner.py --start, deeper positions only), the demo at 0.7 went from 1.15x to 1.22x plain
# (its best fixed depth: 1.34x) at 32 rounds, 1.21x at 64, 1.18x at 128; the other cases, and every case without
# such a start, moved by 0.01 or less
FRESH_POSITION_ROUNDS = 32
# A move to a deeper depth waits until this generation's rounds have read every position the current depth drafts
# (MIN_POSITION_ROUNDS rounds each past the first), or this many rounds in all: before that the rates hold the first
# position alone, read in a few rounds, and the deeper ones continue its rate, so a few accepted first drafts
# predicted every draft of a deeper round kept. Run Z's 0.8B shape at oracle 0.5 went K 3 -> 4 at the start of a
# generation on a predicted 3.32x, a figure no depth reaches at that acceptance (docs/adr/0008, 'Run Z'). Replayed
# (replay_tuner.py, 40 seeds, drift and spells), medians moved by -0.01 to +0.02 of the best fixed depth, and the
# worst processes mostly gained.
# 0: off
DEEPER_MIN_ROUNDS = 16
# Speculation goes off only when it cannot pay even with this many more accepted rounds at every draft position: a
# decision after four rounds read acceptance 0.5 as anything from 0 to 1, and a plain stretch taken wrongly costs 32+
# tokens at plain speed, while a round kept at low acceptance costs about a plain step
# (docs/results/code_measurements.md, 'pipelined tuner')
OFF_HOPE = 2.0
# ... and only after this many rounds of the generation were read: the pipelined loop reads a round two passes after
# dispatching it, so its first decision (after ADAPTIVE_WARMUP_ROUNDS rounds dispatched) saw two rounds, and two
# rejected first drafts turned speculation off for 64 tokens or more where the demo's head at temperature 0.7 and the
# 0.8B shape at oracle 0.5 paid at a fixed K (docs/adr/0008, 'Run E')
MIN_OFF_ROUNDS = 8
# OFF_HOPE's hope holds only at the current depth or shallower ones (the depth it keeps), and only while fewer than
# this many rounds were read: the 0.8B shape at acceptance 0 read K=2 at a plain step's cost plus 3% against a plain
# cost read in a slow spell, and hope at K=2 (or at K=3 beside it, in the replay: a depth it would not go to) held the
# probe for 45 rounds (docs/adr/0008, 'Runs P, Q and R')
HOPE_ROUNDS = 24
# No depth can pay, and speculation goes off for the longest stretch (its rest carried into the process's later
# generations, as any stretch's; after a confirmation, below), only when keeping every draft predicts no more than
# plain decoding: costs read on a noisy host put the ceiling just over 1 for the demo's sampled rounds, where a fixed
# K=3 paid (docs/adr/0008, 'Run E'). On MLX's CPU backend a round's rows cost what as many plain steps cost, and the ceiling
# stays at or below 1.
HOPELESS_CEILING = 1.01
# A first hopeless verdict takes only the ordinary plain stretch (PIPELINED_FIRST_OFF, or the carried schedule's): the
# longest one waits for the probe after it to find speculation hopeless again. A spell of slow rounds at the start
# of the demo's second greedy generation (K=3 read at twice its cost) went off for the longest stretch, four whole
# generations, where the fixed K=3 leg ran at 1.8x plain (docs/adr/0008, 'Run I').
# A hopeless stretch that a probe after it finds hopeless again grows PIPELINED_OFF_GROWTH-fold, up to this: on MLX's
# CPU backend, where no round can pay, each probe costs the head's catch-up over the stretch and four rounds at K + 1
# plain steps' cost each (docs/results/code_measurements.md, 'Hopeless stretches on the CPU'). A probe that pays ends
# the growth: its timed passes (four in the pipelined loop) outvote the three older ones left in its depth's window.
HOPELESS_MAX_OFF = 16 * MAX_OFF_TOKENS
# Passes not timed, besides SKIP, after a change to a depth whose round had no trace in the process yet: its first
# round traces it (before the depth left the fused kernels' names, seconds of kernel builds on MLX's CUDA backend),
# and the first replays after it cost up to three times the later ones (MLX loading the trace's kernels). The demo at
# temperature 0.7 read K=3 from them at three times its fixed leg's cost, went off as hopeless at its first decision
# and never speculated again in that process (docs/adr/0008, 'Run H').
FIRST_TRACE_SKIP = 6
# A process's first rounds on a model cost more than its later ones: on MLX's CUDA backend each kernel a round
# launches is loaded at its first launch in the process, and each round's trace is built. For the demo that came to
# tenths of a second in a first generation, a hundred steady rounds' worth, and a 256-token first generation lost a
# third to a half of plain decoding's speed to it (docs/adr/0008, 'Runs AC and AD'): more than speculation could win
# back in it. So a process buys its first rounds on a ski rental's terms: plain decoding goes on, where the process
# has run no round of the model yet (nor warmed them: pipelined.warm_rounds), until what plain decoding has forgone in
# the process's generations so far and what the rest of this one could gain (each token a plain step's cost times
# 1 - 1 / FIRST_ROUNDS_PRIOR) reach FIRST_ROUNDS_S; then speculation starts as ever. A process then pays at most
# about twice what the best choice made with hindsight would have (the rental's bound), and a generation whose length
# the loop is not told (`budget` None) speculates at once. 0: off.
FIRST_ROUNDS_S = 0.2
FIRST_ROUNDS_PRIOR = 1.5  # the speedup assumed for a text before any of its rounds is read
# A sampled generation's first rounds cost more (a round that draws launches its own kernels, each loaded at its first
# use) and its rounds gain less: on the demo at temperature 0.7 the first rounds cost about half as much again as
# greedy ones and a warm process's rounds gained 1.0-1.4x, below the greedy prior (docs/adr/0008, 'Run AF'). A
# sampled generation weighs its first rounds with these (0: not held).
FIRST_ROUNDS_SAMPLED_S = 0.3
FIRST_ROUNDS_SAMPLED_PRIOR = 1.2


def tuner_rates(stats, hope: float = 0.0) -> list[float]:
    """The per-position acceptance the pipelined tuners decide on (SpecStats.accepted_per_position): positions read
    in at least MIN_POSITION_ROUNDS rounds and in the last FRESH_POSITION_ROUNDS; `hope`: OFF_HOPE for next_k's
    `hopeful`."""
    return stats.accepted_per_position(MIN_POSITION_ROUNDS, hope, FRESH_POSITION_ROUNDS)


def expected_tokens(k: int, rates: list[float]) -> float:
    """Tokens a round of depth k yields: rates[i] is the share of rounds whose draft i was accepted, i.e. P(the first
    i + 1 drafts all accepted); depths not measured yet continue the last measured conditional rate."""
    expected, last, ratio = 1.0, 1.0, 0.0
    for i in range(k):
        if i < len(rates):
            ratio, last = (rates[i] / last if last > 0 else 0.0), rates[i]
        else:
            last *= ratio
        expected += last
    return expected



class DepthTuner:
    """Adaptive K: expected tokens per round from per-position acceptance, cost from measured round times.

    cost(K) = t_verify(K+1) + K * t_draft with t_verify(T) = t1 + slope * (T - 1); speedup(K) = E(K) * t1 / cost(K).
    """

    def __init__(self, k_max: int, t1: float):
        self.k_max, self.t1 = k_max, t1
        self.slope = 0.1 * t1  # priors, replaced by the first measured round
        self.t_draft = 0.2 * t1
        self.observed = 0

    def observe(self, k: int, t_draft: float, t_verify: float) -> None:
        w = 0.2 if self.observed else 1.0  # a moving average of measured rounds only: the priors carry no weight
        self.t_draft = (1 - w) * self.t_draft + w * t_draft / k
        self.slope = (1 - w) * self.slope + w * max(0.0, (t_verify - self.t1) / k)
        self.observed += 1

    def speedup(self, k: int, rates: list[float]) -> float:
        """rates[i]: share of rounds whose draft i was accepted, i.e. P(the first i+1 drafts all accepted); depths
        not measured yet continue the last measured conditional rate."""
        cost = self.t1 + self.slope * k + self.t_draft * k
        return expected_tokens(k, rates) * self.t1 / cost

    def best(self, rates: list[float]) -> tuple[int, float]:
        return max(((k, self.speedup(k, rates)) for k in range(1, self.k_max + 1)), key=lambda t: t[1])


def fresh_memory() -> dict:
    """A process's tuner memory before its first generation. What that generation measures is kept, as any other's:
    a second generation that started afresh (the plain baseline, then PIPELINED_START_K) to leave the first one's
    readings behind ran at 0.60-0.92 of the best of plain decoding and the fixed depths (mean 0.79, six groups of
    run P), where second generations starting from the first one's costs ran at 0.91-0.94 on average in runs N, O
    and Q (docs/adr/0008, 'Runs P, Q and R')."""
    return {}


# What a process's pipelined tuners measured of a model (`model.runtime.tuner`): greedy? -> {"cost": {K: seconds per
# pass}, "k": the depth last picked}. A later generation on the same model starts from those costs at that depth
# instead of timing ten plain steps first (in a 96-token generation the baseline alone held an adaptive leg near plain
# speed for a tenth of its tokens). Greedy and sampled rounds differ in cost (the sampled acceptance), so they are kept
# apart.
def tuner_memory(model, greedy: bool) -> dict:
    """The costs the tuners of this process measured on `model` (kept on the model: they go with it)."""
    return runtime_of(model).tuner.setdefault(bool(greedy), fresh_memory())


class PipelinedTuner:
    """Adaptive depth for pipelined rounds. In the loop's steady state the host builds and dispatches round r while
    the GPU runs round r - 1, so one pass of the loop lasts what a round of its K costs, whichever side bounds it:
    cost(K) is the median of its last COST_WINDOW passes (K = 0: a plain step), tokens(K) comes from the measured
    per-position acceptance (tuning.expected_tokens), and the depth picked is the K within one of the current one
    with the most tokens per second, else a traced depth further off that pays, or 0 (plain steps) when none of them
    beats plain for OFF_CONFIRM decisions in a row (and MIN_OFF_ROUNDS rounds were read; a plain cost read
    STALE_PASSES passes ago or more is read again first, CHECK_PASSES plain steps, and the decision taken again on
    it). The passes just after a change of K are not timed (the pipeline refills, and a verify shape's first use
    compiles it; FIRST_TRACE_SKIP more after a change to a depth with no trace yet), and a depth is judged after DWELL
    timed passes. The schedule:
    plain steps first (the baseline), then PIPELINED_START_K for ADAPTIVE_WARMUP_ROUNDS rounds read (`lag`: the
    passes from a round's dispatch to its acceptance); then a decision after every round. Plain wins: plain steps
    for a stretch (64 tokens, growing 4x while speculation still cannot pay) and speculation is probed again. With a
    `memory` (tuner_memory) that holds costs of plain steps and of rounds, the plain baseline is skipped: the tuner
    starts at the depth picked last, from those costs, and writes what it measures back. Acceptance is always this
    generation's own (it depends on the text)."""

    SKIP = 2  # passes after a change of K that are not timed
    LOGGED_SWITCHES = 8  # changes of K (and slow passes) logged per generation (SpecStats.tuner_log)
    SLOW_PASS = 20  # a pass this many times the cheapest cost is not timed and is logged (a round costs ~1-2.5 plain
    # steps): something compiled in it
    SPIKE = 4  # a pass this many times its depth's cost so far is not timed (a host stall)
    REJECTS = 3  # passes in a row not timed at one depth, after which the next one is

    def __init__(self, k_max: int, memory: dict | None = None, traced: Callable[[int], bool] | None = None,
                 lag: int = 0, budget: int | None = None, first_rounds: bool = False, greedy: bool = True):
        """`traced(k)`: whether a round of depth k has a compiled trace in this process (None: every depth has).
        `lag`: how many passes after dispatching a round its acceptance reaches the rates next_k is given (the
        pipelined loop: 2). `budget`: the tokens this generation may still produce, one per pass of plain steps
        (None: not told). `first_rounds`: this process has run no round of the model yet (FIRST_ROUNDS_S; a sampled
        generation, `greedy` False: FIRST_ROUNDS_SAMPLED_S)."""
        self.k_max, self.memory, self.lag = k_max, {} if memory is None else memory, lag
        self.budget, self.first_rounds, self.passes = budget, first_rounds, 0  # passes: of this generation
        self.greedy = greedy
        self.held_gain = 0.0  # held by FIRST_ROUNDS_S: what each plain pass forgoes, added to memory["forgone"]
        self.below = 0  # decisions in a row that predicted no gain at any depth
        self.dispatched, self.carried = 0, False  # rounds dispatched in this generation; began in a carried stretch
        self.after = deque(maxlen=lag)  # `dispatched` after each of the last `lag` passes
        self.traced = traced or (lambda k: True)
        # the memory's own dict: what this tuner measures is there for the next one, with no copying per round
        # (depths past k_max stay in it: the line through cost(0) and the deepest measured depth may use them)
        self.cost = self.memory.setdefault("cost", {})
        self.k, self.left = 0, PLAIN_WARMUP_STEPS + PLAIN_TIMED_STEPS
        self.prev, self.since = None, 0  # the K of the last pass observed, and how many passes in a row had it
        self.skip = self.SKIP  # passes at it not timed (SKIP; FIRST_TRACE_SKIP more for a depth with no trace yet)
        self.probe_k, self.off_tokens, self.decisions = min(k_max, PIPELINED_START_K), PIPELINED_FIRST_OFF, []
        self.switches, self.slow, self.log = 0, 0, []  # log: the off decisions, the first changes of K with
        # their costs, and the first slow passes
        self.timed, self.rejected = {}, {}  # per depth: passes timed since its cost was (re)set; rejected in a row
        # per depth: its last COST_WINDOW timed passes, kept in the memory: a depth the tuner left after a slow
        # reading kept that reading as its cost in later generations (a remembered cost alone counts as one pass)
        self.window = self.memory.setdefault("window", {})
        self.at = self.memory.setdefault("at", {})  # per depth: the process's pass (memory["clock"]) it was last timed
        self.checking = False  # plain steps of such a check are running
        self.recheck = False  # plain's next timed pass replaces its cost (a check of a stale one) instead of joining it
        self.resume = 0  # a carried stretch's rest, where this generation's first probe goes if it finds no gain
        # per depth: (its cost, the pass clock) after its first COST_WINDOW timed passes since the tuner arrived there
        self.arrival = self.memory.setdefault("arrival", {})
        self.judged = None  # the depth whose arrival was marked last (a change of depth marks the next one)
        self.reread = None  # a depth gone back to for a re-read: its next timed pass replaces its cost window
        # the process's first generation on this model that timed a round (a batch engine's: the first tuner of its
        # batch-size bucket that did; a generation that ended in its baseline, or held in plain steps by
        # FIRST_ROUNDS_S, is none)
        if not any(d > 0 for d in self.cost):
            self.memory["first_gen"] = True
        elif self.memory.pop("first_gen", False) and FIRST_GEN_REREAD:  # the second: what the first read is old
            self.memory["first_end"] = self.memory.get("clock", 0)
        if 0 in self.cost and len(self.cost) > 1:  # measured before: no baseline
            self.probe_k = min(k_max, max(1, self.memory.get("k") or PIPELINED_START_K))
            self.k, self.left = self.probe_k, ADAPTIVE_WARMUP_ROUNDS - 1 + lag
            self.timed = {d: 2 for d in self.cost}  # established: a fast pass is averaged in, not taken as the cost
            self.log.append(f"start at K={self.k} from the costs measured before; {self._costs()}")
            self.judged = self.k if self.k in self.arrival else None  # (its neighbours were read before it still)
            if self.memory.get("stretch"):  # the last probe ended in a plain stretch (and nothing paid since; a
                # hopeless one too: restarting its MAX_OFF_TOKENS in every generation never probed again in
                # generations shorter than it, docs/adr/0008, 'Run H')
                self.carried, rest = True, int(self.memory.get("off") or 0)
                self.off_tokens = min(int(self.memory["stretch"]) * PIPELINED_OFF_GROWTH, MAX_OFF_TOKENS)
                poor = self.memory.get("poor_texts", 0)
                poor = poor if POOR_TEXTS and poor >= POOR_TEXTS else 0
                if rest and not self.memory.get("confirmed") and not poor:
                    # a new generation is a new text: a probe of it first (its catch-up only the prompt's slots),
                    # and the stretch's rest only if that finds no gain either
                    self.resume = rest
                    self.log.append(f"a probe of this text first, then plain steps for {rest} more tokens if it finds "
                                    "no gain: the last generation ended in a plain stretch")
                elif rest:  # the stretch goes on here (hopeless twice, or POOR_TEXTS texts in a row found no gain): plain
                    # steps for its rest first, then a probe
                    self.k, self.left = 0, rest
                    why = f"the probes of the last {poor} texts found no gain" if poor and not \
                        self.memory.get("confirmed") else "the last generation ended in a plain stretch"
                    self.log.append(f"plain steps for {rest} more tokens first: {why}")

    def _costs(self) -> str:
        """The measured cost per depth, for the decision log: 'ms per pass K=0 1.52 K=1 1.90 ..'."""
        return "ms per pass " + " ".join(f"K={k} {1e3 * c:.2f}" for k, c in sorted(self.cost.items()))

    def observe(self, k: int, seconds: float) -> None:
        """One pass of the loop that dispatched a round of depth k. A pass over SLOW_PASS times the cheapest cost
        measured, or over SPIKE times its own depth's, is not timed (a compile, a host stall): one compile among a
        generation's plain steps made cost(0) hundreds of times a step's, and a tuner that kept that (in its memory)
        never left K=2 again (docs/results/code_measurements.md, 'pipelined tuner'). REJECTS such passes in a row at
        one depth are its cost now (a longer
        context, a slower machine than the memory's): the next one is timed, as the depth's only measurement."""
        cheapest, old = min(self.cost.values(), default=None), self.cost.get(k)
        slow = cheapest is not None and seconds > self.SLOW_PASS * cheapest
        stall = not slow and old is not None and seconds > self.SPIKE * old
        if k != self.prev:  # a change of K: its first passes are not timed (more for a depth with no trace yet)
            self.skip = self.SKIP + (FIRST_TRACE_SKIP if k and not self.traced(k) else 0)
        if stall and (self.since + 1 if k == self.prev else 0) < self.skip:
            stall = False  # (the passes just after a change of K are slow by nature, and not timed anyway)
        if (slow or stall) and self.slow < self.LOGGED_SWITCHES:
            self.slow += 1
            self.log.append(f"{'slow pass' if slow else 'stall'}: {1e3 * seconds:.0f} ms at K={k} after K={self.prev} "
                            f"({self.since + 1 if k == self.prev else 0} passes at K={k} before)")
        self.since = self.since + 1 if k == self.prev else 0
        self.prev = k
        clock = self.memory["clock"] = self.memory.get("clock", 0) + 1
        if self.since < self.skip:
            return
        if slow or stall:
            self.rejected[k] = self.rejected.get(k, 0) + 1
            if self.rejected[k] <= self.REJECTS:
                return
            old = None  # the new level: timed afresh
        self.rejected[k] = 0
        # a first measurement that was itself a spike gives way to the next ordinary pass (only the first: a lone
        # fast pass later is averaged in, as any other)
        fresh = old is None or self.timed.get(k, 0) == 1 and old > self.SPIKE * seconds or k == 0 and self.recheck \
            or k == self.reread
        self.recheck = self.recheck and k != 0
        self.reread = None if k == self.reread else self.reread
        self.at[k] = clock
        self.timed[k] = 1 if fresh else self.timed.get(k, 0) + 1
        window = self.window[k] = [seconds] if fresh else [*self.window.get(k, [old]), seconds][-COST_WINDOW:]
        self.cost[k] = sorted(window)[(len(window) - 1) // 2]  # (the lower one of two: stalls only add time)

    def stale(self, k: int, passes: int = STALE_PASSES) -> bool:
        """Whether depth k's cost was last read `passes` passes of the process ago or more (or never by this count: a
        memory from before it)."""
        return k in self.cost and self.memory.get("clock", 0) - self.at.get(k, -passes) >= passes

    def estimate(self, k: int) -> float | None:
        """cost(k): measured, or on the line through cost(0) and the deepest measured depth, and never below a
        shallower depth's measured cost. A depth other than the current one measured REREAD_PASSES passes ago or
        more (or last in the process's first generation: FIRST_GEN_REREAD) costs at most the line through cost(0)
        and the current depth's (fresh) cost, that too never below a shallower depth's: a reading from another spell
        of the host is not held against it for good."""
        if k in self.cost:
            c = self.cost[k]
            if 0 < k != self.k and self.k and self.k in self.cost and 0 in self.cost and k in self.at \
                    and (self.stale(k, REREAD_PASSES) or self.at[k] <= self.memory.get("first_end", -1)):
                line = self.cost[0] + (self.cost[self.k] - self.cost[0]) * k / self.k
                c = min(c, max(line, *(v for d, v in self.cost.items() if d < k)))
            return c
        known = [d for d in self.cost if d > 0]
        if 0 not in self.cost or not known:
            return None
        m = max(known)
        line = self.cost[0] + (self.cost[m] - self.cost[0]) * k / m
        return max(line, *(c for d, c in self.cost.items() if d < k))

    def speedup(self, k: int, rates: list[float]) -> float | None:
        """Predicted tokens per second of depth k over plain steps'. A plain step does less than any round, so a
        plain cost measured above a round's (a plain step built op by op against traced rounds: the same page) is
        read as that round's: else a round accepting nothing predicts
        a gain, and speculation never goes off."""
        cost, plain = self.estimate(k), self.cost.get(0)
        if cost is None or plain is None:
            return None
        plain = min([plain, *(c for d, c in self.cost.items() if d > 0)])
        return expected_tokens(k, rates) * plain / cost

    def next_k(self, rates: list[float], hopeful: Callable[[], list[float]] | None = None) -> int:
        """The depth of the next round, from the measured acceptance `rates`; speculation goes off only if the
        rates `hopeful()` gives (OFF_HOPE; asked for only then) predict no gain either."""
        k = self._next_k(rates, hopeful)
        self.passes += 1
        if self.held_gain:
            self.memory["forgone"] = self.memory.get("forgone", 0.0) + self.held_gain
        self.dispatched += k > 0
        self.after.append(self.dispatched)
        return k

    def plain_left(self) -> int:
        """Passes of the current plain stretch still to run with no decision between them (0 while speculating):
        the loop may run them as plain decoding's own loop and report them at once (`plain_ran`)."""
        return self.left if self.k == 0 else 0

    def plain_ran(self, seconds: list[float]) -> None:
        """`len(seconds)` passes of the plain stretch ran, each `seconds[i]` long, as next_k and observe would have
        taken them one by one: the stretch and its carried rest count down, the pass clock moves on, and the first
        pass and the last COST_WINDOW + REJECTS are timed (the cost window keeps COST_WINDOW, stalls not timed among
        them; the passes between only count)."""
        n = len(seconds)
        if not n:
            return
        self.left -= n
        self.passes += n
        if self.held_gain:  # (the passes that ran: a generation stopped early forwent only those)
            self.memory["forgone"] = self.memory.get("forgone", 0.0) + n * self.held_gain
        if self.memory.get("off") and not self.resume:  # (as _next_k: the carried rest, not a check's steps)
            self.memory["off"] = self.left
        self.after.extend([self.dispatched] * min(n, self.lag))
        self.observe(0, seconds[0])
        tail = seconds[max(1, n - COST_WINDOW - self.REJECTS):]
        between = n - 1 - len(tail)
        self.since += between
        self.memory["clock"] = self.memory.get("clock", 0) + between
        for s in tail:
            self.observe(0, s)

    def read(self) -> int:
        """Rounds of this generation whose acceptance the rates hold now: those dispatched `lag` passes ago or
        earlier."""
        if not self.lag:
            return self.dispatched
        return self.after[0] if len(self.after) == self.lag else 0

    def _revisit(self, gains: dict) -> int | None:
        """A neighbour of the current depth to read again (REVISIT_DRIFT), or None. The current depth's mark is
        re-armed: the next re-read waits for a further fall of the same share."""
        if REVISIT_DRIFT >= 1:  # off
            return None
        mark, current = self.arrival.get(self.k), gains.get(self.k)
        if mark is None or current is None or self.k not in self.cost:
            return None
        fall = self.cost[self.k] / mark[0]
        if fall > 1 - REVISIT_DRIFT:
            return None
        scaled = {n: g / fall for n, g in gains.items()
                  if n != self.k and g is not None and self.at.get(n, mark[1]) < mark[1] and self.traced(n)}
        n, g = max(scaled.items(), key=lambda t: t[1], default=(None, 0.0))
        if n is None or g < current * REVISIT_FLOOR:
            return None
        self.arrival[self.k] = (self.cost[self.k], self.memory.get("clock", 0))
        if self.switches < self.LOGGED_SWITCHES:
            self.switches += 1
            self.log.append(f"K {self.k} -> {n}: read again, K={self.k}'s cost fell to {fall:.2f} of its reading on "
                            f"arrival, after K={n}'s; {self._costs()}")
        return n

    def _first_rounds_pay(self) -> bool:
        """Whether to probe now where this process has run no round yet (FIRST_ROUNDS_S): what plain decoding has
        forgone in the process (memory["forgone"]) and what the rest of this generation could gain cover the first
        rounds' cost. If not, plain steps for the rest of the generation, each pass that runs counted as forgone.
        Else, or where the first rounds were paid, nothing is held back. Decided once per generation: a generation
        that went on to speculate is not held at a later stretch's end."""
        plain = self.cost.get(0)
        price, prior = (FIRST_ROUNDS_S, FIRST_ROUNDS_PRIOR) if self.greedy else \
            (FIRST_ROUNDS_SAMPLED_S, FIRST_ROUNDS_SAMPLED_PRIOR)
        if not self.first_rounds or self.budget is None or price <= 0 or plain is None:
            return True
        self.first_rounds = False
        rest = max(0, self.budget - self.passes)
        gain = rest * plain * (1 - 1 / prior)
        forgone = float(self.memory.get("forgone", 0.0))
        if forgone + gain >= price:
            return True
        self.held_gain = plain * (1 - 1 / prior)
        self.decisions.append(f"plain decoding for this generation's last {rest} tokens: the process's first rounds "
                              f"(~{1e3 * price:.0f} ms) would not pay yet ({1e3 * (forgone + gain):.0f} ms "
                              f"to gain so far)")
        self.log.append(f"{self.decisions[-1]}; {self._costs()}")
        self.left = 1 << 30  # the rest of the generation, however long (a round dispatched at its end, one pass ahead
        # of the tokens read, would pay the first uses for nothing)
        return False

    def _pays(self, k: int) -> int:
        """Speculation pays at depth k: the tuner goes there, and the off schedule restarts (its next stretch the
        first one, the process's record of stretches, poor texts and hopeless verdicts cleared)."""
        self.k = self.probe_k = self.memory["k"] = k
        self.below, self.resume, self.off_tokens = 0, 0, PIPELINED_FIRST_OFF
        self.memory.update(off=False, stretch=False, poor_texts=0, hopeless=False, confirmed=False)
        return k

    def _next_k(self, rates: list[float], hopeful: Callable[[], list[float]] | None) -> int:
        if self.left > 0:
            self.left -= 1
            if self.k == 0 and self.memory.get("off") and not self.resume:  # a plain stretch's rest, for the next
                # generation (not a stale-plain check's steps inside a text's probe: the carried rest stays)
                self.memory["off"] = self.left
            return self.k
        if self.k == 0 and self.checking:  # a stale-plain check is over: the off decision that asked for it is
            # taken again at once, on plain's fresh cost and the rounds' costs and rates read just before. A second
            # probe (ADAPTIVE_WARMUP_ROUNDS rounds, OFF_CONFIRM decisions) re-read what the first one had read: with
            # the hope that held the first, run O's 0.8B shape at acceptance 0 ran probes of 52-60 rounds, a fifth
            # to a quarter of its generation's passes (docs/adr/0008, 'Runs N and O')
            self.checking, self.k, self.below = False, self.probe_k, OFF_CONFIRM - 1
        elif self.k == 0:  # a plain stretch (or the baseline) is over: probe speculation
            if not self._first_rounds_pay():
                return 0
            self.k, self.left = self.probe_k, ADAPTIVE_WARMUP_ROUNDS - 1 + self.lag  # (its rounds all read)
            return self.k
        elif self.prev == self.k and self.since < self.skip + DWELL - 1:
            return self.k  # this depth's cost is not measured enough yet to judge it (or its neighbours) by
        if self.prev == self.k and self.judged != self.k and self.k in self.cost \
                and self.since >= self.skip + COST_WINDOW - 1:  # a whole window read since the tuner came here
            self.arrival[self.k] = (self.cost[self.k], self.memory.get("clock", 0))
            self.judged = self.k
        # one step at a time: a depth not run yet is a guess (and its first rounds compile a new verify shape)
        near = range(max(1, self.k - 1), min(self.k_max, self.k + 1) + 1)
        gains = {k: self.speedup(k, rates) for k in near}
        k, gain = max(((k, g) for k, g in gains.items() if g is not None), key=lambda t: t[1], default=(self.k, None))
        if gain is None:  # nothing measured to decide on yet: stay
            return self.k
        if gain < SPECULATE_MIN_GAIN and hopeful is not None and self.read() < HOPE_ROUNDS:
            hoped = hopeful()
            hope = [(d, self.speedup(d, hoped)) for d in near if d <= self.k]
            d, g = max(((d, g) for d, g in hope if g is not None), key=lambda t: t[1], default=(k, None))
            if g is not None and g >= SPECULATE_MIN_GAIN:  # too few rounds to tell: stay, or go shallower
                # (hope is a reason to keep speculating, not to explore deeper)
                k = d if d < self.k else self.k
                if k != self.k and self.switches < self.LOGGED_SWITCHES:
                    self.switches += 1
                    self.log.append(f"K {self.k} -> {k}: predicted {gain:.2f}, hoping {g:.2f}; {self._costs()}")
                self.k = self.probe_k = self.memory["k"] = k
                return k
        if gain >= SPECULATE_MIN_GAIN:
            current = gains.get(self.k)
            margin = SWITCH_MIN_GAIN if self.traced(k) else NEW_DEPTH_MIN_GAIN
            if k != self.k and current is not None and current >= SPECULATE_MIN_GAIN and gain < current * margin:
                k = self.k  # a change of K costs untraced rounds (and a new depth a compile): not for a small gain
            if k > self.k and current is not None and current >= SPECULATE_MIN_GAIN and len(rates) < self.k \
                    and self.read() < DEEPER_MIN_ROUNDS:
                k = self.k  # deeper only on this generation's own rates at every position the current depth drafts
            again = self._revisit(gains) if k == self.k else None
            if again is not None:
                k, self.reread, self.judged = again, again, None  # (back here, its mark is taken afresh)
            elif k != self.k and self.switches < self.LOGGED_SWITCHES:
                self.switches += 1
                self.log.append(f"K {self.k} -> {k}: predicted {gain:.2f} against "
                                f"{'-' if current is None else f'{current:.2f}'}; {self._costs()}")
            return self._pays(k)
        # A depth further off that pays (its cost measured or on the line): there rather than off. Moving one step
        # at a time from a depth whose neighbour read one slow pass, the tuner went off at K=1 where K=3 paid.
        far = [(d, self.speedup(d, rates)) for d in range(1, self.k_max + 1) if d not in near and self.traced(d)]
        d, g = max(((d, g) for d, g in far if g is not None), key=lambda t: t[1], default=(k, None))
        if g is not None and g >= SPECULATE_MIN_GAIN:
            if self.switches < self.LOGGED_SWITCHES:
                self.switches += 1
                self.log.append(f"K {self.k} -> {d}: predicted {g:.2f} against {gain:.2f}; {self._costs()}")
            return self._pays(d)
        # Could any depth pay if every draft were kept? Not when a round's rows cost what plain steps cost (MLX's
        # CPU backend: a forward's cost grows with its rows as K + 1 plain steps' would): then plain decoding for
        # the longest stretch (its rest carried into the next generations; memory["hopeless"] records that the last
        # off decision was one: a hopeless one after it grows the stretch, HOPELESS_MAX_OFF).
        ceiling = max((self.speedup(d, [1.0] * d) or 0.0 for d in range(1, self.k_max + 1)), default=0.0)
        hopeless = 0 < ceiling <= HOPELESS_CEILING
        if not hopeless and self.read() < (ADAPTIVE_WARMUP_ROUNDS if self.carried else MIN_OFF_ROUNDS):
            return self.k  # too few rounds read to tell a poor text from a poor start (unless the last generation
            # ended in plain steps too)
        self.below += 1
        if not hopeless and self.below < OFF_CONFIRM:
            return self.k
        if not hopeless and self.stale(0):  # plain's cost from long ago: read it again first (then it is fresh for
            # STALE_PASSES passes: the decision at the check's end goes off on it, with no second check)
            self.recheck = self.checking = True
            self.probe_k = self.k
            self.log.append(f"plain steps for {CHECK_PASSES} passes: plain's cost is stale; {self._costs()}")
            self.k, self.left = 0, CHECK_PASSES - 1
            return 0
        if self.resume and not hopeless:  # this text's first probe found no gain: the carried stretch goes on, its
            # schedule as it was
            rest, self.resume = self.resume, 0
            self.memory["poor_texts"] = self.memory.get("poor_texts", 0) + 1
            self.decisions.append(f"speculation off for the carried stretch's {rest} more tokens: predicted speedup "
                                  f"{gain:.2f} at K={k}")
            self.log.append(f"{self.decisions[-1]}; {self._costs()}")
            self.probe_k = self.memory["k"] = k
            self.k, self.left, self.below = 0, rest - 1, 0
            self.memory["off"], self.memory["hopeless"], self.memory["confirmed"] = self.left, False, False
            return 0
        self.resume = 0  # (a hopeless verdict takes its own stretch, the carried rest dropped)
        # hopeless the first time: the ordinary stretch, and the probe after it (its own passes outvoting the older
        # readings in the depth's window) confirms before the longest one; then PIPELINED_OFF_GROWTH times the last
        # one while it stays hopeless
        last = int(self.memory.get("stretch") or 0) if self.memory.get("hopeless") else 0
        if hopeless and last:
            self.off_tokens = min(PIPELINED_OFF_GROWTH * last, HOPELESS_MAX_OFF) if last >= MAX_OFF_TOKENS \
                else MAX_OFF_TOKENS
        elif hopeless and not self.memory.get("stretch"):  # speculation paid since the last stretch (or there was
            # none): the first stretch of the schedule, not the one an earlier poor stretch of text had grown to
            self.off_tokens = PIPELINED_FIRST_OFF
        # a stretch's rest goes to the next generation with no probe of its text first only where two verdicts in a
        # row found no depth able to pay: one can be a spell's (a depth read at twice its cost in one)
        self.memory["confirmed"] = hopeless and bool(self.memory.get("hopeless"))
        self.memory["hopeless"] = hopeless
        self.decisions.append(f"speculation off for {self.off_tokens} tokens: predicted speedup {gain:.2f} at K={k}"
                              + (f" (at most {ceiling:.2f} with every draft kept)" if hopeless else ""))
        self.log.append(f"{self.decisions[-1]}; {self._costs()}")
        log.info(self.log[-1])
        # the next probe at the best depth, traced or not: at acceptance 0 the best is the shallowest, and probes held
        # at a traced deeper one cost every generation's probe more per round (docs/adr/0008, 'Run M')
        self.probe_k = self.memory["k"] = k
        self.k, self.left, self.below = 0, self.off_tokens - 1, 0
        self.memory["off"], self.memory["stretch"] = self.left, self.off_tokens  # (its rest, for a later generation)
        self.off_tokens = min(PIPELINED_OFF_GROWTH * self.off_tokens, MAX_OFF_TOKENS)
        return 0


