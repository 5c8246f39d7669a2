"""MTP rounds over a continuous batch (speculative/batched.py): each sequence keeps its own accepted count, bonus token
and rollback, and gets its plain greedy decoding's tokens (fp32), whoever its batch-mates are and whenever they join
or leave; sampled sequences keep the plain distribution."""

import mlx.core as mx
import pytest
from conftest import greedy_tokens

from lattice_mlx import SpecOptions, batch_generate, load
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative.batched import BatchRounds
from lattice_mlx.speculative.tuning import PipelinedTuner

TEXTS = ["def add(a, b):", "import os\n", "class Stack:\n    def", "# a comment\nx = ", "for i in range(10):"]


@pytest.fixture(scope="module")
def demo32():
    return load(dtype="float32")  # the demo's trained head: its drafts are mostly accepted, so rounds keep 0..K


solo = greedy_tokens


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_rounds_equal_each_plain_generation(demo32, k):
    """Five prompts into three rows with budgets of their own: sequences leave mid-round (their budget cuts a
    round's tokens) and the waiting ones join a running batch; every sequence's tokens are its plain greedy ones."""
    model, tok = demo32
    prompts = [list(tok.encode(t)) for t in TEXTS]
    budgets = [20, 9, 15, 12, 7]
    engine = BatchRounds(model, k=k, max_batch=3)
    seqs, pending = [], list(zip(prompts, budgets))
    while pending or engine.busy:
        while pending and not engine.full:
            p, n = pending.pop(0)
            seqs.append(engine.add(p, max_tokens=n))
        engine.step()
    for s, p in zip(seqs, prompts):
        assert s.tokens == solo(model, p, s.max_tokens) and s.finish_reason == "length"
    assert engine.drafted and 0.5 < engine.accepted / engine.drafted <= 1  # rounds kept drafts, and not all of them
    assert engine.accepted < engine.drafted or k == 1


def test_a_rejected_round_and_a_cancel_leave_the_others_exact(checkpoint):
    """A random head (its drafts are rejected: every round rolls back K) beside a cancel mid-generation."""
    model = load(checkpoint, dtype="float32")[0]
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(10, 40))]
    engine = BatchRounds(model, k=2)
    seqs = [engine.add(p, max_tokens=10) for p in prompts]
    for _ in range(5):
        engine.step()
    engine.cancel(seqs[1])
    while engine.busy:
        engine.step()
    assert seqs[1].finish_reason == "cancelled"
    for i in (0, 2):
        assert seqs[i].tokens == solo(model, prompts[i], 10)


def test_batch_generate_speculates_when_asked(demo32):
    model, tok = demo32
    plain = batch_generate(model, tok, TEXTS[:3], max_tokens=16, max_batch=2)
    mtp = batch_generate(model, tok, TEXTS[:3], max_tokens=16, max_batch=2,
                         speculation=SpecOptions(draft_tokens=2, adaptive=False))
    assert [r.tokens for r in mtp] == [r.tokens for r in plain]
    assert [r.text for r in mtp] == [r.text for r in plain]


def _second_token_distribution(model, prompt: list[int], sampler):
    """The exact distribution of plain sampling's second token (summed over the first), [V]."""
    import numpy as np

    from lattice_mlx.decode import prefill

    def probs(ids):
        logits, _ = prefill(model, mx.array(ids), model.make_cache(trimmable=False))
        return np.array(sampler.probs(logits), dtype=np.float64)

    p1 = probs(prompt)
    return sum(p1[t] * probs([*prompt, t]) for t in range(len(p1)))


@pytest.mark.parametrize("k", [1, 2])
def test_sampled_rounds_keep_the_plain_distribution(tiny_vocab_model, k):
    """A sampled sequence's second token comes from its first round (a draft kept, the residual resample or the
    bonus) beside a batch-mate: its frequencies over 800 seeded rounds fit plain sampling's exact distribution
    (chi-square). Drafts picked by argmax while q is reported as the sampled distribution fail it."""
    import numpy as np
    from scipy.stats import chisquare

    # a high temperature: the random head's q is far from one-hot there, so drafting by argmax would show
    sampler, prompt = Sampler(temp=3.0), [1, 2, 3]
    expected = _second_token_distribution(tiny_vocab_model, prompt, sampler)
    counts = np.zeros(len(expected))
    for i in range(800):
        mx.random.seed(1000 + i)
        engine = BatchRounds(tiny_vocab_model, k=k)
        engine.add([5, 6, 7, 0, 4], max_tokens=10, sampler=Sampler(temp=0.7))
        seq = engine.add(prompt, max_tokens=2, sampler=sampler)
        while not seq.done:
            engine.step()
        counts[seq.tokens[1]] += 1
    keep = expected > 0
    assert chisquare(counts[keep], expected[keep] / expected[keep].sum() * counts.sum()).pvalue > 1e-3


def test_bad_options_are_one_line_errors(no_mtp_checkpoint, demo32):
    with pytest.raises(ValueError, match="MTP head"):
        BatchRounds(load(no_mtp_checkpoint)[0], k=2)
    with pytest.raises(ValueError, match="k must be"):
        BatchRounds(demo32[0], k=0)


@pytest.mark.parametrize("p", [1.0, 0.0])
def test_an_oracle_batch_is_accepted_all_or_nothing_with_the_same_tokens(checkpoint, p):
    """SYNTHETIC drafts (bench/oracles.OracleBatchRounds): the recorded greedy continuation is accepted whole, a
    surely wrong draft never, and the tokens are plain greedy's either way."""
    from lattice_mlx.bench.oracles import OracleBatchRounds

    model = load(checkpoint, dtype="float32")[0]
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(10, 40))]
    refs = {i: solo(model, pr, 16) for i, pr in enumerate(prompts)}
    engine = OracleBatchRounds(model, k=3, references=refs, p_correct=p)
    seqs = [engine.add(pr, max_tokens=12) for pr in prompts]
    while engine.busy:
        engine.step()
    assert [s.tokens for s in seqs] == [refs[i][:12] for i in range(3)]
    assert engine.accepted == (engine.drafted if p == 1.0 else 0) and engine.drafted


@pytest.mark.parametrize("traced", [False, True])
def test_forced_rounds_keep_drafts_at_their_rate_and_verify_for_real(demo32, traced):
    """SYNTHETIC rounds that keep drafts at a set rate (bench/oracles.ForcedBatchRounds, the batch benchmark's MTP
    legs): at p = 0 no draft is kept and every round's token is the target's, so each sequence's tokens are its plain
    greedy ones (the verify, its bonus and the rollback for real); at p = 1 every draft is kept; at p = 0.6 the
    first position is kept at about p and the rounds keep p + p^2 + p^3 drafts on average at K = 3. Two engines of
    other rates on one model in turn: p is an input of the traced round, not a constant of the first trace."""
    from lattice_mlx.bench.oracles import ForcedBatchRounds
    from lattice_mlx.speculative import pipelined

    model, tok = demo32
    prompts = [list(tok.encode(t)) for t in TEXTS[:3]]
    got = {}
    with pipelined.tracing(traced):
        for p in (0.0, 1.0, 0.6):
            engine = ForcedBatchRounds(model, k=3, p_correct=p, seed=1)
            seqs = [engine.add(pr, max_tokens=24 if p < 1 else 12) for pr in prompts]
            while engine.busy:
                engine.step()
            got[p] = (engine, seqs)
    engine, seqs = got[0.0]
    assert engine.drafted and engine.accepted == 0
    assert [s.tokens for s in seqs] == [solo(model, pr, 24) for pr in prompts]
    engine, seqs = got[1.0]
    assert engine.accepted == engine.drafted and all(len(s.tokens) == 12 for s in seqs)
    for s, pr in zip(seqs, prompts):  # each round's last token is the target's after the kept drafts
        logits = model(mx.array(pr + s.tokens)[None])[0, len(pr) - 1 :]
        bonus = mx.argmax(logits, axis=-1).tolist()
        assert [s.tokens[i] for i in (0, 4, 8)] == [bonus[i] for i in (0, 4, 8)]
    st = got[0.6][0].stats  # a (sequence, round) each
    n = st.proposed_at[0]
    mean = sum(m * c for m, c in enumerate(st.accepted_hist)) / st.rounds
    assert n >= 20 and abs(st.accepted_at[0] / n - 0.6) < 4 * (0.24 / n) ** 0.5, (st.accepted_at, n)
    assert abs(mean - (0.6 + 0.36 + 0.216)) < 4 * 1.1 / n**0.5, st.accepted_hist


def test_plain_steps_between_rounds_keep_the_heads_slots(demo32):
    """Plain steps between rounds (the adaptive engine's off state): each sequence's head slots wait and go in with
    the next round's head forward, so drafts after a stretch are as good as before it (a slot lost or misplaced
    would show as acceptance falling), and every sequence's tokens are still its plain greedy ones."""
    model, tok = demo32
    prompts = [list(tok.encode(t)) for t in TEXTS[:3]]
    schedule = iter([2, 2, 0, 0, 0, 0, 0, 3, 3, 0, 1, 0, 0] + [2] * 100)

    class Scripted(BatchRounds):
        def _choose_k(self):
            return next(schedule)

    engine = Scripted(model, k=3, adaptive=True)
    seqs = [engine.add(p, max_tokens=40) for p in prompts]
    while engine.busy:
        engine.step()
        # every verified position but the newest pairs with its successor in a head slot: in the head's cache,
        # or waiting for the next round (the device's count of generated tokens: the host reads a pass late)
        if engine.active:
            written, pending, gen = (a.tolist() for a in (engine.head_cache[0].offset, engine.pn, engine.gen))
            for b, s in enumerate(engine.active):
                assert written[b] + pending[b] == len(s.prompt) + gen[b] - 1
                assert gen[b] >= len(s.tokens)
    for s, p in zip(seqs, prompts):
        assert s.tokens == solo(model, p, 40)
    assert engine.accepted / engine.drafted > 0.6


def test_the_adaptive_engine_keeps_costs_per_batch_size(demo32):
    """The tuner's costs are kept per batch-size bucket: a batch of three and then one sequence alone are tuned
    apart; greedy tokens are plain greedy's whatever it picks."""
    model, tok = demo32
    prompts = [list(tok.encode(t)) for t in TEXTS[:3]]
    engine = BatchRounds(model, k=3, adaptive=True)
    seqs = [engine.add(p, max_tokens=n) for p, n in zip(prompts, [60, 12, 12])]
    while engine.busy:
        engine.step()
    for s, p in zip(seqs, prompts):
        assert s.tokens == solo(model, p, s.max_tokens)
    assert {4, 1} <= set(engine.memories) and 0 in engine.memories[4]["cost"] and 0 in engine.memories[1]["cost"]


def test_the_batch_tuner_leaves_a_depths_first_passes_at_a_size_untimed(demo32, monkeypatch):
    """MLX traces a batched round again for every batch size: the adaptive engine tells its tuner which depths ran a
    trace at this batch-size bucket in the process, and a depth's first passes there (built op by op, the trace
    compiled, the first replays) go untimed, FIRST_TRACE_SKIP more than SKIP; the next engine at that bucket knows
    the trace. Greedy tokens stay plain greedy's; rows that are never traced count as traced."""
    from lattice_mlx.runtime import runtime_of
    from lattice_mlx.speculative import pipelined
    from lattice_mlx.speculative.tuning import FIRST_TRACE_SKIP

    model, tok = demo32
    prompts = [list(tok.encode(t)) for t in TEXTS[:2]]
    changes, real = [], PipelinedTuner.observe

    def observe(self, k, seconds):  # (the untimed passes decided at each change of K)
        changed = k != self.prev
        real(self, k, seconds)
        if changed:
            changes[-1].append((k, self.skip))

    monkeypatch.setattr(PipelinedTuner, "observe", observe)
    runtime_of(model).batch_sizes.clear()
    runtime_of(model).tuner.pop("batch", None)
    with pipelined.tracing(True):
        for _ in range(2):
            changes.append([])
            engine = BatchRounds(model, k=3, adaptive=True)
            seqs = [engine.add(p, max_tokens=48) for p in prompts]
            while engine.busy:
                engine.step()
            for s, p in zip(seqs, prompts):
                assert s.tokens == solo(model, p, 48)
    first = [(k, skip) for k, skip in changes[0] if k]
    assert first and first[0] == (first[0][0], PipelinedTuner.SKIP + FIRST_TRACE_SKIP)
    assert any(key[:2] == (BatchRounds, first[0][0]) and key[-1] == 2 for key in runtime_of(model).batch_sizes)
    again = [(k, skip) for k, skip in changes[1] if k == first[0][0]]
    assert again and again[0][1] == PipelinedTuner.SKIP  # (the same depth at the same size: traced already)
    # rows of several sampler structures are never traced: every depth counts as traced (no compile to wait for)
    mixed = BatchRounds(model, k=3, adaptive=True)
    mixed.add(prompts[0], max_tokens=8)
    mixed.add(prompts[1], max_tokens=8, sampler=Sampler(temp=0.7), seed=1)
    with pipelined.tracing(True):
        mixed.step()  # (the rows join the batch)
        assert len(mixed.active) == 2 and not mixed._replayable() and all(mixed.has_trace(k) for k in range(4))


def test_batch_generate_adaptive_equals_plain(demo32):
    model, tok = demo32
    plain = batch_generate(model, tok, TEXTS, max_tokens=24, max_batch=3)
    adaptive = batch_generate(model, tok, TEXTS, max_tokens=24, max_batch=3, speculation=SpecOptions())
    assert [r.tokens for r in adaptive] == [r.tokens for r in plain]


def test_greedy_sequences_beside_a_sampled_one_stay_exact(demo32):
    """A batch mixing samplers: the greedy sequences' drafts are checked against the argmax, the sampled one's by
    the sampling rule, each row on its own; the greedy ones get their plain greedy tokens."""
    model, tok = demo32
    prompts = [list(tok.encode(t)) for t in TEXTS[:3]]
    engine = BatchRounds(model, k=2)
    greedy = engine.add(prompts[0], max_tokens=16)
    engine.add(prompts[1], max_tokens=16, sampler=Sampler(temp=0.8, top_p=0.9))
    other = engine.add(prompts[2], max_tokens=16)
    while engine.busy:
        engine.step()
    assert greedy.tokens == solo(model, prompts[0], 16) and other.tokens == solo(model, prompts[2], 16)


def test_a_seeded_sequence_samples_its_rounds_whoever_its_batch_mates_are(demo32):
    """With a fixed depth, a seeded sequence's rounds draw from its own PRNG stream (one split per round: its drafts,
    acceptance and residual draws): its tokens are the same alone and beside batch-mates (sampled and greedy,
    joining after it); another seed gives other tokens."""
    model, tok = demo32
    prompts = [list(tok.encode(t)) for t in TEXTS]
    hot = Sampler(temp=1.5)

    def run(seed: int, mates: list[tuple[Sampler, int | None]]) -> list[int]:
        mx.random.seed(len(mates))
        engine = BatchRounds(model, k=2)
        seq = engine.add(prompts[0], max_tokens=24, sampler=hot, seed=seed)
        for n, (sampler, mate_seed) in enumerate(mates):
            engine.step()
            engine.add(prompts[1 + n], max_tokens=10 + 3 * n, sampler=sampler, seed=mate_seed)
        while engine.busy:
            engine.step()
        return seq.tokens

    alone = run(5, [])
    assert len(alone) == 24
    assert run(5, [(Sampler(temp=0.8, top_p=0.9), None), (Sampler(), None), (Sampler(temp=1.0), 9)]) == alone
    assert run(6, []) != alone


def test_dead_columns_are_compacted_and_every_sequence_stays_exact(checkpoint, monkeypatch):
    """A random head (its drafts are mostly rejected: each round leaves K dead columns per row) with 8-column
    blocks, so buffers fill with dead columns and are compacted again and again (cache.RoundKVCache) while
    sequences join, leave and are cancelled: every sequence's tokens are its plain greedy ones. Compaction that
    dropped a live column or kept a dead one would change them."""
    from lattice_mlx import cache as caches

    monkeypatch.setattr(caches.RoundKVCache, "GROW", 8)
    compactions = []
    real = caches.RoundKVCache.compact

    def counted(self):
        before = self._idx
        real(self)
        compactions.append(before - self._idx)

    monkeypatch.setattr(caches.RoundKVCache, "compact", counted)
    model = load(checkpoint, dtype="float32")[0]
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(10, 40)), [3] * 9]
    engine = BatchRounds(model, k=3, max_batch=3)
    seqs = [engine.add(p, max_tokens=n) for p, n in zip(prompts[:3], [30, 12, 24])]
    for _ in range(4):
        engine.step()
    engine.cancel(seqs[1])
    late = engine.add(prompts[3], max_tokens=20)
    while engine.busy:
        engine.step()
    assert seqs[1].finish_reason == "cancelled"
    for s, p in zip([seqs[0], seqs[2], late], [prompts[0], prompts[2], prompts[3]]):
        assert s.tokens == solo(model, p, s.max_tokens)
    assert engine.accepted < engine.drafted / 2 and sum(c > 0 for c in compactions) >= 3, compactions


def test_traced_rounds_replay_exactly(checkpoint, monkeypatch):
    """Steady-state greedy rounds replay one trace per depth and batch shape (RoundKVCache with `whole`: writes and
    the mask at the device's write column); with 8-column blocks the buffers compact between replays and the
    traces are made again for each capacity. Every sequence's tokens are its plain greedy ones, and the trace ran."""
    from lattice_mlx import cache as caches
    from lattice_mlx.runtime import runtime_of
    from lattice_mlx.speculative import pipelined

    monkeypatch.setattr(caches.RoundKVCache, "GROW", 8)
    model = load(checkpoint, dtype="float32")[0]
    runtime_of(model).traces.pop("batch_rounds", None)
    replays = []
    real = BatchRounds._replay
    monkeypatch.setattr(BatchRounds, "_replay", lambda self, K: replays.append(K) or real(self, K))
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(10, 40))]
    with pipelined.tracing(True):
        engine = BatchRounds(model, k=2, max_batch=3)
        seqs = [engine.add(p, max_tokens=n) for p, n in zip(prompts, [40, 20, 33])]
        while engine.busy:
            engine.step()
    for s, p in zip(seqs, prompts):
        assert s.tokens == solo(model, p, s.max_tokens)
    assert len(replays) > 10 and runtime_of(model).traces["batch_rounds"]


def test_traced_sampled_rounds_draw_what_rounds_built_op_by_op_draw(demo32):
    """Seeded sampled sequences (one sampler structure, each its own temperature and top-p: numbers that are an
    input of the trace) take the same tokens from traced rounds and plain steps (the adaptive engine's off state,
    scripted here) as from rounds and steps built op by op: same keys, same draws."""
    from lattice_mlx import decode
    from lattice_mlx.runtime import runtime_of
    from lattice_mlx.speculative import pipelined

    model, tok = demo32
    prompts = [list(tok.encode(t)) for t in TEXTS[:3]]
    samplers = [Sampler(temp=0.7, top_p=0.9), Sampler(temp=1.2, top_p=0.8), Sampler(temp=0.9, top_p=0.95)]

    class Scripted(BatchRounds):
        def _choose_k(self):
            return next(self.schedule)

    def run(traced: bool):
        with pipelined.tracing(traced), decode.tracing(traced):
            engine = Scripted(model, k=2, adaptive=True)
            engine.schedule = iter([2, 2, 2, 0, 0, 0, 2, 2, 2, 0, 0] + [2] * 100)
            seqs = [engine.add(p, max_tokens=30, sampler=s, seed=i) for i, (p, s) in enumerate(zip(prompts, samplers))]
            while engine.busy:
                engine.step()
        return [s.tokens for s in seqs]

    runtime_of(model).traces.pop("batch_rounds", None)
    traced = run(True)
    made = runtime_of(model).traces.get("batch_rounds", {})
    assert {(0, False), (2, False)} <= {(key[1], key[2][0]) for key in made}  # sampled traces: plain steps, K = 2
    assert traced == run(False)


def test_cancels_after_a_pass_that_failed_when_read_empty_the_batch(demo32):
    """A queued pass whose evaluation fails (out of memory, a kernel's error) raises from the step that reads it;
    cancelling every sequence afterwards (what the server does with a failed batch) does not read it again and
    empties the batch, and the engine then runs new sequences exactly."""
    model, tok = demo32
    prompts = [list(tok.encode(t)) for t in TEXTS[:2]]
    engine = BatchRounds(model, k=2)
    seqs = [engine.add(p, max_tokens=20) for p in prompts]
    engine.step()
    real = engine._read

    def failing(*args):
        raise RuntimeError("[eval] the pass failed")

    engine._read = failing
    with pytest.raises(RuntimeError, match="the pass failed"):
        engine.step()
    for s in seqs:
        engine.cancel(s)
    assert not engine.busy and all(s.finish_reason == "cancelled" for s in seqs)
    engine._read = real
    again = engine.add(prompts[0], max_tokens=12)
    while engine.busy:
        engine.step()
    assert again.tokens == solo(model, prompts[0], 12)


def test_an_oracle_engine_replays_its_own_acceptance_not_the_trace_makers(checkpoint):
    """The traced round is kept with the model: a second oracle engine of another p on the same model (same shapes)
    accepts at its own p (p is state of the trace, not a constant of the first engine's)."""
    from lattice_mlx.bench.oracles import OracleBatchRounds

    model = load(checkpoint, dtype="float32")[0]
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    refs = {i: solo(model, pr, 40) for i, pr in enumerate(prompts)}
    rates = []
    for p in (1.0, 0.0):
        engine = OracleBatchRounds(model, k=3, references=refs, p_correct=p)
        seqs = [engine.add(pr, max_tokens=32) for pr in prompts]
        while engine.busy:
            engine.step()
        assert [s.tokens for s in seqs] == [refs[i][:32] for i in range(2)]
        rates.append(engine.accepted / engine.drafted)
    assert rates == [1.0, 0.0]


@pytest.mark.kernels
def test_the_gdn_kernel_reads_each_rows_pick_and_every_sequence_stays_exact(tmp_path, monkeypatch):
    """Rounds leave the GDN caches as the verify's whole conv input and per-step states, and the next verify's
    kernel reads each row's window and state at its own [n_b + 1, n_b] in place (no gather): with the kernels on
    (the CPU render where no GPU is), oracle drafts kept at 0.6 (each row keeping its own count), a sequence joining
    and one leaving mid-generation, every sequence's tokens are its plain greedy ones. A kernel reading one row's
    pick for every row, or the pick of the wrong row after a join or a leave, would change them."""
    from lattice_mlx.bench.oracles import OracleBatchRounds
    from lattice_mlx.bench.synthetic import random_checkpoint
    from lattice_mlx.metal import gated_delta
    from lattice_mlx.models import compiled
    from lattice_mlx.speculative import pipelined

    picks = []
    real = gated_delta.gated_delta_conv_kernel

    def counted(*args, pick=None, **kwargs):
        out = real(*args, pick=pick, **kwargs)  # (raises where the kernel cannot run: the test then fails below)
        picks.append(None if pick is None else pick.shape)
        return out

    monkeypatch.setattr(gated_delta, "gated_delta_conv_kernel", counted)
    # (the tiny shape's key heads of 16 take the reference: the fused kernel needs multiples of 32)
    path = random_checkpoint(tmp_path / "ckpt", seed=5, linear_key_head_dim=32, linear_value_head_dim=32)
    model = load(path, dtype="float32")[0]
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(10, 30)), [3] * 6]
    budgets = [20, 8, 16, 12]
    with compiled.forced(False), pipelined.tracing(False):  # (the render runs eagerly: no traces)
        refs = {i: solo(model, p, n) for i, (p, n) in enumerate(zip(prompts, budgets))}
        engine = OracleBatchRounds(model, k=3, references=refs, p_correct=0.6, max_batch=3)  # (uids in add order)
        seqs = [engine.add(p, max_tokens=n) for p, n in zip(prompts[:3], budgets[:3])]
        while engine.busy:
            engine.step()
            if len(seqs) == 3 and not engine.full:  # the second's budget ended: the fourth joins the running rows
                seqs.append(engine.add(prompts[3], max_tokens=budgets[3]))
    assert [s.tokens for s in seqs] == [refs[i] for i in range(4)]
    assert 0 < engine.accepted < engine.drafted
    assert (3, 2) in picks and (2, 2) in picks, set(picks)  # rows' own picks, in batches of three and of two
