"""Pipelined MTP rounds (speculative/pipelined.py): device-side acceptance and cache advance give the synchronous
loop's results. Greedy identity with plain decoding for K = 1..4 and the oracle extremes are in test_chain.py."""

import gc
import itertools
import weakref

import mlx.core as mx
import numpy as np
import pytest
from conftest import exact_plain_joint, fit_pvalues

from lattice_mlx import cache as caches
from lattice_mlx import decode, load, sample
from lattice_mlx.bench import oracles
from lattice_mlx.bench.oracles import OracleDrafter
from lattice_mlx.decode import generate_step, prefill
from lattice_mlx.metal.gated_delta import picked
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import SpecOptions, SpecStats, check_split_model, speculate, tuning
from lattice_mlx.speculative import pipelined as rounds

PROMPT = [3, 3, 3, 3, 17, 17, 2, 8, 64, 128, 256, 12, 13]


def spec_tokens(model, prompt, n, *, verify, k=3, sampler=None, drafter=None):
    options = SpecOptions(draft_tokens=k, verify=verify, adaptive=False)
    stats = SpecStats.of(options)
    gen = speculate(model, mx.array(prompt), sampler=sampler or Sampler(), options=options, stats=stats,
                           drafter=drafter)
    return [next(gen) for _ in range(n)], stats


def test_partial_acceptance_matches_the_synchronous_loop_round_for_round(checkpoints):
    """Oracle drafts at p = 0.7 with one seed: both loops accept the same drafts in every round they read (the
    pipelined loop has read one round fewer when the consumer stops)."""
    model, tok = load(checkpoints["pattern"])
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(130))]
    sync, s1 = spec_tokens(model, PROMPT, 110, verify="batched", drafter=OracleDrafter(model, Sampler(), plain, 0.7,
                                                                                       seed=3))
    pipe, s2 = spec_tokens(model, PROMPT, 110, verify="pipelined",
                           drafter=oracles.DeviceOracle(plain, 0.7, model.args.vocab_size, 3, seed=3))
    assert sync == pipe == plain[:110]
    assert s2.rounds >= s1.rounds - 1 and s2.rounds > 20
    h1, h2 = s1.accepted_hist, s2.accepted_hist
    assert sum(abs(a - b) for a, b in zip(h1 + [0] * 4, h2 + [0] * 4)) <= 1, (h1, h2)
    rates = s2.accepted_per_position()
    assert 0.5 < rates[0] < 0.9 and rates[0] >= rates[1] >= rates[2] > 0


def test_long_prompt_and_cache_growth_stay_exact(checkpoints):
    """A prompt longer than a prefill chunk (the head's prefill runs in chunks too) and a generation that crosses the
    KV buffers' growth step (FixedKVCache.GROW rows)."""
    model, tok = load(checkpoints["tied"])
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, model.args.vocab_size, size=600).tolist()
    old = caches.FixedKVCache.GROW
    try:
        caches.FixedKVCache.GROW = 16  # grows every few rounds
        plain = [t for t, _ in zip(generate_step(model, mx.array(prompt), sampler=Sampler()), range(70))]
        pipe, _ = spec_tokens(model, prompt, 70, verify="pipelined", k=2,
                              drafter=oracles.DeviceOracle(plain + [0] * 8, 0.8, model.args.vocab_size, 2, seed=1))
    finally:
        caches.FixedKVCache.GROW = old
    assert pipe == plain


def test_fixed_kv_cache_writes_at_its_device_offset_and_grows():
    c = caches.FixedKVCache.from_kv(caches.KVCache())
    assert c.keys is None and c.offset.item() == 0
    rows = lambda n, base: mx.arange(base, base + n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 2, n, 4))  # noqa: E731
    k, v = c.update_and_fetch(rows(3, 0), rows(3, 0))
    assert k.shape == (1, 2, 3, 4) and c.length.item() == 3 and c.keys.shape[2] == caches.FixedKVCache.GROW
    c.advance(mx.array(2))  # the third row is rejected
    c.bound = 3
    k, _ = c.update_and_fetch(rows(3, 10), rows(3, 10))  # written from row 2, over the rejected one
    assert c.length.item() == 5 and k.shape[2] == 6
    assert k[0, 0, :5, 0].tolist() == [0, 1, 10, 11, 12]
    c.advance(mx.array(3))
    c.bound = caches.FixedKVCache.GROW - 1  # near the capacity: the next write grows the buffers, rows kept
    c.update_and_fetch(rows(3, 20), rows(3, 20))
    assert c.keys.shape[2] == 2 * caches.FixedKVCache.GROW
    assert c.keys[0, 0, :8, 0].tolist() == [0, 1, 10, 11, 12, 20, 21, 22]


def test_fixed_kv_cache_clamps_an_out_of_range_offset():
    """MLX does not bounds-check a dynamic slice_update: the start is clamped on the device, never written past."""
    c = caches.FixedKVCache(mx.zeros((1, 1, 8, 2)), mx.zeros((1, 1, 8, 2)), 0)
    c.offset = mx.array(100, dtype=mx.int32)  # a broken loop's offset
    c.update_and_fetch(mx.ones((1, 1, 2, 2)), mx.ones((1, 1, 2, 2)))
    assert c.keys.shape[2] == 8 and c.keys[0, 0, :, 0].tolist() == [0] * 6 + [1, 1]


def test_gdn_pick_equals_rollback(checkpoints):
    """Keeping n of a recorded forward's steps by device index (read in place by the next forward: `picked` is what
    its kernel reads) gives what rollback's host-side slices give."""
    model, _ = load(checkpoints["untied"])
    for keep in range(1, 5):
        a, b = model.make_cache(trimmable=False), model.make_cache(trimmable=False)
        for c in (a, b):
            prefill(model, mx.array(PROMPT), c)
            caches.begin(c)
            model(mx.array([[40, 41, 42, 43]]), c)
        for ca, cb in zip(a, b):
            if isinstance(ca, caches.GDNCache):
                ca.pick(mx.array([keep, keep - 1], dtype=mx.int32))
                cb.rollback(4 - keep)
                conv, ssm = picked(ca.conv, ca.ssm, ca.window_pick, cb.conv.shape[1])
                assert mx.array_equal(conv, cb.conv).item() and mx.array_equal(ssm, cb.ssm).item()


def _self_drafts(model, temp: float = 0.3):
    """A draft source (a DraftOverride) that drafts with the target itself at a lower temperature, on scratch copies
    of the round's caches, on the device: q is sharper than p, so drafts are accepted often but with p/q < 1, where
    each position's own uniform matters."""
    sampler = Sampler(temp=temp)

    def override(drafts, q, state, r):
        scratch = []
        for c in state.cache:  # the caches' arrays are immutable: a scratch cache never changes the round's
            if isinstance(c, caches.FixedKVCache):
                s = caches.FixedKVCache(c.keys, c.values, 0)
                s.offset, s.bound = c.offset, c.bound
            else:
                s = caches.GDNCache()
                s.conv, s.ssm, s.window_pick = c.conv, c.ssm, c.window_pick
            scratch.append(s)
        tok, out, qs = state.y, [], []
        for _ in range(drafts.shape[0]):
            row = sampler.probs(model(tok.reshape(1, 1), scratch)[0, -1])
            tok = mx.random.categorical(mx.log(row)).astype(mx.int32)
            out.append(tok)
            qs.append(row)
            for s in scratch:
                if isinstance(s, caches.FixedKVCache):
                    s.advance(mx.array(1))
                    s.bound += 1
        return mx.stack(out) + 0 * drafts, mx.stack(qs)
    return override


def _round_tokens(model, seeds, *, spec: bool, k: int = 3, head: bool = False) -> list[tuple[int, ...]]:
    """The first 5 tokens (the first from the prefill): with spec, a K=k round and its bonus when all drafts are
    kept, then the next rounds; drafts from the target at a lower temperature, or with `head` the MTP head's own."""
    sampler, out = Sampler(temp=1.0), []
    for seed in seeds:
        mx.random.seed(seed)
        if spec:
            gen = iter(spec_tokens(model, [1, 2, 1, 2, 1], 5, verify="pipelined", sampler=sampler, k=k,
                                   drafter=None if head else _self_drafts(model))[0])
        else:
            gen = generate_step(model, mx.array([1, 2, 1, 2, 1]), sampler=sampler)
        out.append(tuple(next(gen) for _ in range(5)))
    return out


GROUPS = ((1, 2), (2, 3), (3, 4), (4,))  # token 0 comes from the prefill in both


@pytest.fixture(scope="module")
def plain_joint(tiny_vocab_model):
    """The exact distribution of plain sampling's first 5 tokens at temperature 1 after _round_tokens' prompt."""
    return exact_plain_joint(tiny_vocab_model, [1, 2, 1, 2, 1], 5, Sampler(temp=1.0))


def test_the_exact_reference_is_plain_sampling(tiny_vocab_model, plain_joint):
    """The reference the sampled tests fit against: plain sampling's own tokens fit it, and a joint of the wrong
    temperature does not (so the fit can fail)."""
    plain = _round_tokens(tiny_vocab_model, range(10, 310), spec=False)
    assert min(fit_pvalues(plain_joint, plain, GROUPS).values()) > 1e-3
    hot = exact_plain_joint(tiny_vocab_model, [1, 2, 1, 2, 1], 5, Sampler(temp=1.5))
    assert min(fit_pvalues(hot, plain, GROUPS).values()) < 1e-4


def test_sampled_pipelined_round_keeps_the_joint_distribution_and_planted_bugs_fail(tiny_vocab_model, plain_joint,
                                                                                     monkeypatch):
    """Device-side sampled acceptance: every position of a K=3 round and its bonus, in adjacent pairs, against plain
    sampling; the same check catches a bonus drawn from the last draft's row and one uniform shared by all drafts."""
    seeds = range(700_000, 700_000 + 300)
    right = fit_pvalues(plain_joint, _round_tokens(tiny_vocab_model, seeds, spec=True), GROUPS)
    assert min(right.values()) > 1e-3, right
    uniform = mx.random.uniform
    planted = {
        "bonus_from_wrong_row": lambda m: m.setattr(sample, "bonus_row", lambda p, K: p[K - 1 : K]),
        "one_shared_uniform": lambda m: m.setattr(
            mx.random, "uniform", lambda shape, key=None: mx.broadcast_to(uniform(shape=(1,), key=key), shape)),
    }
    for name, plant in planted.items():
        with monkeypatch.context() as m:
            plant(m)
            wrong = fit_pvalues(plain_joint, _round_tokens(tiny_vocab_model, seeds, spec=True), GROUPS)
        assert min(wrong.values()) < 1e-4, (name, wrong)


def test_sampled_pipelined_rounds_with_the_heads_own_drafts_keep_the_distribution(tiny_vocab_model, plain_joint,
                                                                                    monkeypatch):
    """The default sampled path: the MTP head's own drafts at K = 1..3, every position and the bonus in adjacent
    pairs against plain sampling. Drafts drawn by argmax while q is reported as their distribution fail it (every
    other sampled pipelined test replaces the head's drafts)."""
    from lattice_mlx.metal.argmax import argmax
    from lattice_mlx.speculative import pipelined

    seeds = range(900_000, 900_000 + 300)
    tiny_vocab_model.runtime.traces.clear()  # traces built on another test's drafts are not this test's
    for k in (1, 2, 3):
        right = fit_pvalues(plain_joint, _round_tokens(tiny_vocab_model, seeds, spec=True, k=k, head=True), GROUPS)
        assert min(right.values()) > 1e-3, (k, right)
    real = pipelined._pick

    def argmax_drafts(sampler, logits, values=None):
        _, q = real(sampler, logits, values)
        return argmax(logits), q

    with monkeypatch.context() as m:
        m.setattr(pipelined, "_pick", argmax_drafts)
        tiny_vocab_model.runtime.traces.clear()
        wrong = fit_pvalues(plain_joint, _round_tokens(tiny_vocab_model, seeds, spec=True, k=2, head=True), GROUPS)
    tiny_vocab_model.runtime.traces.clear()
    assert min(wrong.values()) < 1e-4, wrong


@pytest.mark.parametrize("kw, flag", [({"tree": "2-1"}, "--tree"), ({"draft": "ngram"}, "--draft ngram")])
def test_pipelined_refuses_what_it_cannot_run(kw, flag):
    with pytest.raises(ValueError, match=flag):
        SpecOptions(**{"verify": "pipelined", "adaptive": False, **kw})


def test_split_model_refuses_pipelined_rounds():
    class Split:
        sharding_group = object()

    with pytest.raises(ValueError, match="--verify pipelined"):
        check_split_model(Split(), SpecOptions(verify="pipelined", adaptive=False))


def test_real_head_drafts_as_the_synchronous_loop():
    """The demo's own MTP head drafting (no oracle): the pipelined loop's head writes each draft step's row where the
    synchronous loop's head does (a row off shifts its RoPE position and lets a stale row into its attention), so
    both accept the same drafts round for round (fp32; the pipelined loop may have read one round fewer)."""
    model, tok = load(dtype="float32")
    for text in ("def fibonacci(n):\n    if n < 2:\n        return n\n    return",
                 "import os\nimport sys\n\n\ndef main(argv):\n    parser = "):
        prompt = tok.encode(text)
        sync, s1 = spec_tokens(model, prompt, 90, verify="batched", k=3)
        pipe, s2 = spec_tokens(model, prompt, 90, verify="pipelined", k=3)
        assert sync == pipe
        assert s1.rounds > 15 and s1.accepted_per_position()[1] > 0, s1.accepted_hist
        h1, h2 = s1.accepted_hist, s2.accepted_hist
        assert sum(abs(a - b) for a, b in zip(h1 + [0] * 4, h2 + [0] * 4)) <= 1, (text, h1, h2)


# --- adaptive depth (PipelinedTuner): rounds of varying K, K = 0 being a plain step -----------------------------------

# plain stretches of 3, 11 (a backlog piece of 8 and a remainder of 3), 8 (exactly one piece) and 1 between rounds of
# depth 1..3: every way the head's backlog is fed
SCHEDULE = [0] * 3 + [2, 2] + [0] * 11 + [3, 1] + [0] * 8 + [2] + [0] + [3] * 3 + [0] * 16 + [1, 2, 3]


def _scheduled(monkeypatch, schedule):
    ks = itertools.cycle(schedule)
    monkeypatch.setattr(rounds.PipelinedTuner, "next_k", lambda self, rates, hopeful=None: next(ks))
    # every pass as the schedule says: no plain stretch run as plain decoding's loop, past the schedule
    monkeypatch.setattr(rounds.PipelinedTuner, "plain_left", lambda self: 0)


def adaptive_tokens(model, prompt, n, *, k=3, sampler=None, drafter=None):
    options = SpecOptions(draft_tokens=k, verify="pipelined", adaptive=True)
    stats = SpecStats.of(options)
    gen = speculate(model, mx.array(prompt), sampler=sampler or Sampler(), options=options, stats=stats,
                           drafter=drafter)
    return [next(gen) for _ in range(n)], stats


@pytest.mark.parametrize("name", ["untied", "pattern"])
def test_traced_rounds_after_plain_steps_and_changes_of_depth_replay_their_traces(checkpoints, monkeypatch, name):
    """Traced (rounds and plain steps), greedy, K moving between 0 and 3 with oracle drafts: plain decoding's
    tokens, the acceptance of the same schedule built op by op, and no round built op by op: the first round after
    plain steps or after another depth replays its depth's trace (PipelinedRounds._settle), one trace per depth. The
    settling itself is one-off work: it compiles no per-layer traces of the head (on a GPU, seconds each)."""
    from lattice_mlx.runtime import runtime_of

    model, _ = load(checkpoints[name])
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(140))]
    verify = rounds.PipelinedRounds.verify
    eager = []
    monkeypatch.setattr(rounds.PipelinedRounds, "verify", lambda self, *a: (eager.append(not any(
        slot.owner is not None for _, slot in model.runtime.traces.get("rounds", {}).values())), verify(self, *a))[1])
    out = {}
    for on in (False, True):
        _scheduled(monkeypatch, SCHEDULE)
        model.runtime.traces.pop("rounds", None)
        runtime_of(model.mtp).compiled = None
        eager.clear()
        with rounds.tracing(on), decode.tracing(on):
            out[on] = adaptive_tokens(model, PROMPT, 120,
                                      drafter=oracles.DeviceOracle(plain, 0.7, model.args.vocab_size, 3, seed=6))
        out[on] = (*out[on], sum(eager))
    (built, s0, e0), (traced, s1, e1) = out[False], out[True]
    assert built == traced == plain[:120]
    assert s0.accepted_hist == s1.accepted_hist and s0.rounds == s1.rounds > 10
    assert e0 >= s0.rounds and e1 == 0, (e0, e1)
    assert sorted(key[0] for key in model.runtime.traces["rounds"]) == [1, 2, 3]
    assert runtime_of(model.mtp).compiled is None


@pytest.mark.parametrize("name", ["untied", "pattern"])
def test_adaptive_pipelined_rounds_switching_depth_are_exact(checkpoints, monkeypatch, name):
    """Greedy: rounds whose K moves between 0 (plain steps) and 3 give plain decoding's tokens, with oracle drafts
    (mostly accepted) and with the model's own head; the head's statistics count only the speculative rounds."""
    model, _ = load(checkpoints[name])
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(140))]
    _scheduled(monkeypatch, SCHEDULE)
    oracle, stats = adaptive_tokens(model, PROMPT, 120,
                                    drafter=oracles.DeviceOracle(plain, 0.9, model.args.vocab_size, 3, seed=2))
    assert oracle == plain[:120]
    assert stats.rounds > 10 and stats.accepted_per_position()[0] > 0.6
    assert sum(stats.proposed_at) < 3 * stats.rounds  # rounds of K < 3 were among them
    head, _ = adaptive_tokens(model, PROMPT, 120)
    assert head == plain[:120]
    monkeypatch.undo()  # the tuner's own decisions (this machine's timings): whatever they are, plain's tokens
    tuned, _ = adaptive_tokens(model, PROMPT, 120, drafter=oracles.DeviceOracle(plain, 0.9, model.args.vocab_size, 3))
    assert tuned == plain[:120]


@pytest.mark.parametrize("first_k", [0, 2])
def test_the_first_pass_is_queued_before_the_first_token_is_read(checkpoints, monkeypatch, first_k):
    """As plain decoding queues its first step behind the prefill's token: when the loop hands out its first token,
    the first pass (a plain step, or a round) has been dispatched already, and no pass more; the tokens stay plain
    decoding's."""
    model, _ = load(checkpoints["untied"])
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(12))]
    _scheduled(monkeypatch, [first_k, 0, 1])
    passes = []
    round_ = rounds.PipelinedRounds.round
    monkeypatch.setattr(rounds.PipelinedRounds, "round", lambda self, r, k: passes.append(k) or round_(self, r, k))
    options = SpecOptions(draft_tokens=3, verify="pipelined", adaptive=True)
    gen = speculate(model, mx.array(PROMPT), sampler=Sampler(), options=options, stats=SpecStats.of(options))
    assert next(gen) == plain[0] and passes == [first_k]
    assert [next(gen) for _ in range(11)] == plain[1:]


@pytest.mark.parametrize("tokens", [20, 60])
def test_a_plain_stretch_runs_as_plain_decodings_loop_and_counts_as_its_passes(checkpoints, monkeypatch, tokens):
    """An off decision's plain stretch runs as plain decoding's own loop, with no decision, rates or timing per pass
    (PipelinedTuner.plain_ran takes its passes at the stretch's end, or where the generation stops inside it: 20
    tokens). Against the same stretch decided pass by pass: plain decoding's tokens both ways, and the tuner's memory
    after it the same (the stretch's rest carried to the next generation, the pass clock, plain's cost measured);
    the tuner is asked for a depth once for the stretch, not per pass."""
    from lattice_mlx.runtime import runtime_of

    model, _ = load(checkpoints["untied"])
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(tokens))]
    init, asked = rounds.PipelinedTuner.__init__, []

    def off(self, *a, **kw):  # as an off decision leaves it: a stretch of 30 passes, its rest carried
        init(self, *a, **kw)
        self.k, self.left = 0, 30
        self.memory["off"], self.memory["stretch"] = 30, 64

    next_k, observe = rounds.PipelinedTuner.next_k, rounds.PipelinedTuner.observe
    monkeypatch.setattr(rounds.PipelinedTuner, "__init__", off)
    # passes timed at fixed costs per depth: the two loops' decisions then follow from their bookkeeping alone
    monkeypatch.setattr(rounds.PipelinedTuner, "observe", lambda self, k, s: observe(self, k, 1e-3 * (1 + 0.4 * k)))
    monkeypatch.setattr(rounds.PipelinedTuner, "next_k", lambda self, *a: asked.append(1) or next_k(self, *a))
    memories = {}
    for loop in ("plain's", "pass by pass"):
        if loop == "pass by pass":
            monkeypatch.setattr(rounds.PipelinedTuner, "plain_left", lambda self: 0)
        runtime_of(model).tuner.clear()
        asked.clear()
        options = SpecOptions(draft_tokens=3, verify="pipelined", adaptive=True)
        gen = speculate(model, mx.array(PROMPT), sampler=Sampler(), options=options, stats=SpecStats.of(options))
        assert [next(gen) for _ in range(tokens)] == plain, loop
        gen.close()
        memory = runtime_of(model).tuner[True]
        memories[loop] = (memory["off"], memory["clock"], 0 in memory["cost"], len(asked))
    ours, theirs = memories["plain's"], memories["pass by pass"]
    assert ours[:3] == theirs[:3] and ours[2], memories
    if tokens < 30:  # stopped inside the stretch: its rest carried (the first pass yields the prefill's token)
        assert ours[0] == 30 - tokens
    assert theirs[3] >= min(tokens, 30) and ours[3] <= max(tokens - 30, 0) + 2, memories


# run in a process of its own, MLX's CPU kernels kept under a fresh TMPDIR: the fused kernels each pass compiles
_NEW_KERNELS = """
import glob, json, os
import mlx.core as mx
mx.set_default_device(mx.cpu)  # (MLX's CPU backend writes the kernels it builds where this test counts them)
from lattice_mlx.bench.run import load_target
from lattice_mlx.decode import resume
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative.pipelined import PipelinedRounds
folder = os.path.join(os.environ["TMPDIR"], "mlx", mx.__version__, "cpu")
sources = lambda: set(glob.glob(folder + "/*.cpp"))
model = load_target("tiny", bits=4, group_size=64, dtype="bfloat16", seed=0, stock=False).model
ids = mx.array([(7 * i + 3) % model.args.vocab_size for i in range(1000)])
cache, _, logits, hidden, _ = resume(model, ids, None, return_hidden=True)
first = Sampler()(logits).item()
rounds = PipelinedRounds(model, Sampler(), 4, ids.tolist(), first, hidden, cache)
verified = r = 0
for phase in ([0] * 4 + [2] * 4 + [0] * 3, [1] * 4 + [0] * 2 + [3] * 4 + [4] * 4 + [0] * 4 + [2] * 4 + [3] * 4):
    before = sources()
    for k in phase:
        rounds.bounds(r, verified)
        out = rounds.round(r, k)
        mx.eval(out[0], out[1]) if k else mx.eval(out[0])
        verified, r = verified + (out[1].item() if k else 0) + 1, r + 1
    print(json.dumps({"before": len(before), "new": sorted(os.path.basename(f) for f in sources() - before),
                      "capacity": rounds.kv[0].capacity()}))
from lattice_mlx.speculative.batched import BatchRounds
for depths in ([3], [4, 5]):  # a batch's rounds: K=3, then K = 4 and 5 (K = 1 and 2 are rounds of other forms)
    before = sources()
    for k in depths:
        engine = BatchRounds(model, k=k, max_batch=3)
        for j in range(3):
            engine.add([(7 * i + 3 + j) % model.args.vocab_size for i in range(40 + 9 * j)], max_tokens=24)
        while engine.busy:
            engine.step()
    print(json.dumps({"before": len(before), "new": sorted(os.path.basename(f) for f in sources() - before)}))
"""


def test_a_new_depth_or_capacity_compiles_no_kernel(tmp_path):
    """Traced rounds (CPU, tiny shape): after plain steps and rounds at K=2, rounds at K = 1, 3, 4 and the buffers'
    growth past 1,024 rows build no fused kernel MLX has not built already; a batch's traced rounds at K = 4 and 5
    none after K=3's. MLX names a fused kernel by its scalar constants' values, and a depth's or a capacity's in the
    rounds' index arithmetic compiled new kernels inside a generation: 3.4-3.7 s per depth on a fresh H100
    (docs/results/code_measurements.md, 'First use of a depth')."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path), "LATTICE_TRACE_ROUNDS": "1", "LATTICE_TRACE_STEPS": "1",
           "LATTICE_COMPILE": "1"}
    out = subprocess.run([sys.executable, "-c", _NEW_KERNELS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    warm, then, batch_warm, batch_then = [json.loads(line) for line in out.stdout.splitlines()[-4:]]
    assert len(warm["new"]) > 20 and then["before"] > 20  # (the warm-up's kernels, kept under TMPDIR: counted)
    assert then["new"] == []
    assert warm["capacity"] == 1024 and then["capacity"] == 2048  # (the buffers grew during the second phase)
    assert batch_warm["new"] and batch_then["new"] == []


@pytest.mark.parametrize("k_max", [1, 2, 4])
def test_the_warm_up_runs_every_kind_of_pass(k_max):
    """warm_passes: each depth as a generation's first pass, plain steps, every depth after plain steps and plain
    steps after it, every change from one depth to another, each depth replayed after its first round."""
    gens = rounds.warm_passes(k_max)
    assert {seq[0] for seq in gens} == set(range(k_max + 1))
    changes = {pair for seq in gens for pair in zip(seq, seq[1:])}
    kinds = range(k_max + 1)
    assert {(a, b) for a in kinds for b in kinds} <= changes, sorted(changes)


def test_the_warm_up_drafts_through_a_benchmarks_override(checkpoints):
    """warm_rounds(override=...): every round's drafts go through the override, as the generations' to come will (a
    benchmark's oracle adds work of its own to each kind of pass; in run Q a generation's first round at K=1 with
    oracle drafts built kernels for 1.9 s after a warm-up with the head's drafts)."""
    model, _ = load(checkpoints["pattern"])
    depths = []

    def override(drafts, q, rounds_, r):
        depths.append(drafts.shape[0])
        return drafts, q

    with rounds.tracing(False):
        rounds.warm_rounds(model, 2, (Sampler(),), override)
    assert len(depths) == sum(1 for seq in rounds.warm_passes(2) for k in seq if k) and set(depths) == {1, 2}


def _pass_kinds(monkeypatch) -> set:
    """Records each pass's kind: (the depth of the pass before it, None for a generation's first; its depth)."""
    seen, real = set(), rounds.PipelinedRounds.round

    def spy(self, r, k):
        seen.add((self.last_k if r else None, k))
        return real(self, r, k)

    monkeypatch.setattr(rounds.PipelinedRounds, "round", spy)
    return seen


def test_the_warm_up_runs_every_kind_of_pass_generations_run(checkpoints, monkeypatch):
    """warm_rounds on scratch caches (traced rounds and steps): a trace per depth, greedy and sampled, the PRNG's
    key left as it was; every kind of pass (which pass came before it) that adaptive generations run with random
    depths, a process's later generations starting at any depth, was among the warm-up's; and the model's
    generations after it are what they were before (greedy: plain decoding's tokens, adaptive and fixed). Run O
    found a generation's first round, at the depth a previous generation left, compiling 2.8 s on an H100 after a
    warm-up without it."""
    model, _ = load(checkpoints["pattern"])
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(60))]
    with rounds.tracing(True), decode.tracing(True):
        warmed = _pass_kinds(monkeypatch)
        mx.random.seed(11)
        assert not model.runtime.rounds_run
        assert rounds.warm_rounds(model, 3) == 2 * sum(map(len, rounds.warm_passes(3)))
        assert model.runtime.rounds_run  # (the process's first rounds paid: tuning.FIRST_ROUNDS_S holds nothing back)
        after = mx.random.uniform(shape=(4,)).tolist()
        mx.random.seed(11)
        assert after == mx.random.uniform(shape=(4,)).tolist()  # (the PRNG's key as before: seeded runs sample alike)
        monkeypatch.undo()
        keys = {(key[0], key[1][0]) for key in model.runtime.traces["rounds"]}
        assert keys == {(k, greedy) for k in (1, 2, 3) for greedy in (True, False)}
        assert {key[0][0] for key in model.runtime.traces["steps"]} == {True, False}
        tuned, _ = adaptive_tokens(model, PROMPT, 40)
        fixed = spec_tokens(model, PROMPT, 40, verify="pipelined", k=2)[0]
        assert tuned == fixed == plain[:40]
        rng = np.random.default_rng(0)
        for start in (1, 2, 3):
            seen = _pass_kinds(monkeypatch)
            schedule = [start, *rng.integers(0, 4, size=60).tolist()]
            _scheduled(monkeypatch, schedule)
            assert adaptive_tokens(model, PROMPT, 60, k=3)[0] == plain
            monkeypatch.undo()
            assert seen and seen <= warmed, sorted(seen - warmed, key=str)


def test_head_catches_up_in_forwards_of_one_row_count(checkpoints, monkeypatch):
    """Plain stretches of 5, 6, 70 and 2 steps: the head runs no forward during them, and when a round follows it
    takes the stretch's slots in forwards of CATCH_UP_PIECE rows, the last padded (a new row count compiles new
    kernels on a GPU, inside the generation: every catch-up has the one count). The prompt's slots wait for the first
    round too. The tokens stay plain decoding's."""
    from lattice_mlx.speculative.pipelined import CATCH_UP_PIECE

    model, _ = load(checkpoints["untied"])
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(200))]
    rows = []
    head_call = type(model.mtp).__call__
    monkeypatch.setattr(type(model.mtp), "__call__", lambda self, e, h, *a, **kw: (
        rows.append(e.shape[1]), head_call(self, e, h, *a, **kw))[1])
    _scheduled(monkeypatch, [0] * 5 + [2] + [0] * 6 + [3] + [0] * 70 + [1, 2] + [0] * 2 + [3, 3])
    got, stats = adaptive_tokens(model, PROMPT, 100,
                                 drafter=oracles.DeviceOracle(plain, 0.7, model.args.vocab_size, 3, seed=4))
    assert got == plain[:100]
    assert stats.rounds >= 5
    # a round's rows (K + 1 <= 4), one row per draft step, the catch-up pieces: nothing else
    assert set(rows) == {1, 2, 3, 4, CATCH_UP_PIECE}, rows
    # the first forward: the prompt's slots and the first 5 plain steps' together (none fed before); one piece per
    # stretch a round ends, two for the 70 steps' (71 slots)
    assert rows[0] == CATCH_UP_PIECE and rows.count(CATCH_UP_PIECE) >= 1 + 1 + 2 + 1, rows


def test_adaptive_pipelined_plain_steps_sample_as_plain_decoding(checkpoints, monkeypatch):
    """Sampled, the tuner keeping K = 0: one draw per token from the same logits as generate_step's, so under one seed
    the very same tokens; the plain steps are plain decoding's own traced step (decode.TracedSteps, returning the
    hidden too), with no round traced and no head forward (its slots wait for a round that never comes)."""
    model, _ = load(checkpoints["untied"])
    sampler = Sampler(temp=0.8)
    mx.random.seed(5)
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=sampler), range(40))]
    _scheduled(monkeypatch, [0])
    heads = []
    head_call = type(model.mtp).__call__
    monkeypatch.setattr(type(model.mtp), "__call__", lambda self, *a, **kw: (heads.append(1),
                                                                               head_call(self, *a, **kw))[1])
    mx.random.seed(5)
    spec, stats = adaptive_tokens(model, PROMPT, 40, sampler=sampler)
    assert spec == plain and stats.rounds == 0 and not heads
    # (plain decoding's trace leaves the hidden out, one more output it does not need; the plain stretches' keeps it,
    # before the final norm: the catch-up norms a stretch's rows at once)
    assert not model.runtime.traces.get("rounds") and [key[1] for key in model.runtime.traces["steps"]] == [False, "pre"]
    with rounds.tracing(False), decode.tracing(False):
        mx.random.seed(5)
        built, _ = adaptive_tokens(model, PROMPT, 40, sampler=sampler)
    assert built == plain


@pytest.mark.parametrize("traced, pad", [(False, 1), (True, 1), (True, 0)])
def test_head_cache_after_plain_stretches_equals_one_prefill(checkpoints, monkeypatch, traced, pad):
    """The head's KV cache after plain steps (their slots and the prompt's caught up when a round follows), rounds of
    K = 2 and changes of depth holds, row for row, what one forward of the head over all the verified slots writes
    (fp32): the drafts after a plain stretch see the right past. Traced, each round after another kind of pass
    replays its depth's trace (PipelinedRounds._settle: the slots but the newest fed first, the newest pending
    alone; after a shallower round, PAD_UPWARD, its pending rows padded to the new depth); built op by op, the
    first round after plain steps takes the slots with its draft's forward."""
    from lattice_mlx.speculative.pipelined import CATCH_UP_PIECE

    monkeypatch.setattr(rounds, "PAD_UPWARD", pad)
    model, _ = load(checkpoints["untied"])
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(200))]
    cache = model.make_cache()
    logits, hidden = prefill(model, mx.array(PROMPT), cache, return_hidden=True)
    first = mx.argmax(logits).item()
    # oracle drafts (mostly accepted: rounds keep several rows, so a change of depth finds pending rows past the
    # first); the head's cache holds the verified slots whatever the drafts were
    oracle = oracles.DeviceOracle(plain, 0.95, model.args.vocab_size, 3, seed=4)
    with rounds.tracing(traced), decode.tracing(traced):
        pr = rounds.PipelinedRounds(model, Sampler(), 2, PROMPT, first, hidden, cache, oracle)
    schedule = [0] * (CATCH_UP_PIECE + 5) + [2, 0, 0, 2, 2, 3, 3, 1, 0, 2, 1, 1, 3, 3, 1, 2, 3, 2]
    verified, out_tokens, accepted = 0, [first], []
    for r, k in enumerate(schedule + [0]):
        pr.bounds(r, verified)
        with rounds.tracing(traced), decode.tracing(traced):
            tokens, n = pr.round(r, k)
        n = n.item() if k else 0
        out_tokens += tokens.reshape(-1).tolist()[: n + 1]  # (a plain step returns a scalar)
        verified += n + 1
        accepted.append(n)
    # the reference: the target's hiddens over the whole sequence, every slot (token t+1, hidden t) through the head
    ids = PROMPT + out_tokens
    _, h_all = prefill(model, mx.array(ids), model.make_cache(), return_hidden=True)
    ref = model.mtp.make_cache()
    head = model.mtp
    head(model.model.embed_tokens(mx.array(ids[1:]))[None], head.from_target(h_all[:-1])[None], ref)
    assert out_tokens == plain[: len(out_tokens)]
    # changes to a deeper depth after rounds that kept drafts
    ks = schedule + [0]
    assert sum(1 for i in range(1, len(ks)) if 0 < ks[i - 1] < ks[i] and accepted[i - 1] > 0) >= 2
    got = pr.mcache[0]
    rows = got.offset.item()  # the head's true rows: every slot but the last plain step's, still pending
    assert rows == len(ids) - 2
    # (fp32: verify forwards of up to four rows against one forward over the sequence differ by ~1e-4 where rounds
    # kept drafts; a row from the wrong slot differs by ~1)
    assert mx.allclose(got.keys[..., :rows, :], ref[0].keys[..., :rows, :], atol=1e-3, rtol=1e-3).item()
    assert mx.allclose(got.values[..., :rows, :], ref[0].values[..., :rows, :], atol=1e-3, rtol=1e-3).item()


def _tune(tuner, rates, cost_of, n):
    """n passes of the pipelined loop with the tuner deciding: the depths it picked."""
    ks = []
    for _ in range(n):
        k = tuner.next_k(rates)
        tuner.observe(k, cost_of(k))
        ks.append(k)
    return ks


def test_pipelined_tuner_decides_from_round_costs():
    """cost(K) from the loop's passes (not the first SKIP after a change), tokens(K) from acceptance: a round
    that costs 1.5 plain steps and yields 2.7 tokens keeps speculating; one that yields ~1.1 turns it off for 64
    plain steps, then probes again, and the next stretch is 4 times longer."""
    from lattice_mlx.speculative.tuning import (
        ADAPTIVE_WARMUP_ROUNDS,
        OFF_CONFIRM,
        PIPELINED_FIRST_OFF,
        PIPELINED_OFF_GROWTH,
        PIPELINED_START_K,
        PLAIN_TIMED_STEPS,
        PLAIN_WARMUP_STEPS,
    )

    cost = lambda k: 1.0 + 0.25 * k  # noqa: E731
    tuner = rounds.PipelinedTuner(3)
    baseline = PLAIN_WARMUP_STEPS + PLAIN_TIMED_STEPS
    ks = _tune(tuner, [0.9, 0.8, 0.7], cost, baseline + ADAPTIVE_WARMUP_ROUNDS + 6)
    assert ks[:baseline] == [0] * baseline and ks[baseline] == PIPELINED_START_K == 3
    assert tuner.cost[0] == pytest.approx(1.0) and tuner.estimate(2) == pytest.approx(1.5)
    assert ks[-1] == 3 and not tuner.decisions  # 3.4 tokens for 1.75 steps beats 2.7 for 1.5
    first, c = PIPELINED_FIRST_OFF, OFF_CONFIRM - 1  # (off after OFF_CONFIRM decisions in a row find no gain)
    ks = _tune(tuner, [0.05, 0.0, 0.0], cost, c + 1 + first + ADAPTIVE_WARMUP_ROUNDS + c + 1)
    assert ks[:c] == [3] * c and ks[c] == 0 and f"off for {first} tokens" in tuner.decisions[0]
    assert ks[c + 1:c + first] == [0] * (first - 1) and ks[c + first] > 0  # probed again
    assert ks[-2] > 0 and ks[-1] == 0 and len(tuner.decisions) == 2
    assert f"off for {first * PIPELINED_OFF_GROWTH} tokens" in tuner.decisions[1]
    # the log (forwarded to SpecStats.tuner_log): both off decisions, with the costs behind them
    assert [e.split(";")[0] for e in tuner.log] == tuner.decisions
    assert "K=0 1000.00" in tuner.log[-1] and "K=3 1750.00" in tuner.log[-1]


def test_pipelined_tuner_margins_near_break_even_and_between_depths():
    """Speculation that predicts less than SPECULATE_MIN_GAIN goes off (a change of K costs passes the tuner does not
    time); a neighbouring depth predicting less than SWITCH_MIN_GAIN more than the current one is not taken, one
    clearly better is."""
    from lattice_mlx.speculative.tuning import (
        ADAPTIVE_WARMUP_ROUNDS,
        PLAIN_TIMED_STEPS,
        PLAIN_WARMUP_STEPS,
        SPECULATE_MIN_GAIN,
    )

    start = PLAIN_WARMUP_STEPS + PLAIN_TIMED_STEPS + ADAPTIVE_WARMUP_ROUNDS
    # K=1 yields 1.2 tokens for 1.16 steps, K=2 1.3 for 1.26: 1.03x predicted, under the margin: plain steps
    tuner = rounds.PipelinedTuner(2)
    ks = _tune(tuner, [0.2, 0.1], lambda k: {0: 1.0, 1: 1.16, 2: 1.26}[k], start + 16)  # (K=1 is tried first: its
    # estimate from the line through cost(0) and cost(2) is 1.06x)
    assert 1.0 < tuner.speedup(2, [0.2, 0.1]) < SPECULATE_MIN_GAIN and 1.0 < 1.2 / 1.16 < SPECULATE_MIN_GAIN
    assert ks[-1] == 0 and "off for 64 tokens" in tuner.decisions[0]
    # K=3 predicts ~1.01x K=2's (3.4 tokens for 1.87 steps against 2.7 for 1.5) and each pass's cost swings +-6%:
    # K settles instead of following the noise
    tuner, passes = rounds.PipelinedTuner(3), itertools.count()
    noisy = lambda k: (1.0 + 0.25 * k + (0.12 if k == 3 else 0.0)) * (1.06 if next(passes) % 2 else 0.94)  # noqa: E731
    ks = _tune(tuner, [0.9, 0.8, 0.7], noisy, start + 60)
    changes = sum(a != b for a, b in zip(ks[start:], ks[start + 1:]))
    assert changes <= 1 and not tuner.decisions and set(ks[start:]) <= {2, 3}, ks[start:]
    # the current depth under the threshold and a neighbour over it by less than the switch margin: move, not off
    tuner = rounds.PipelinedTuner(3)
    tuner.k, tuner.left, tuner.cost = 2, 0, {0: 1.0, 1: 1.9, 2: 2.7 / 1.04, 3: 3.4 / 1.06}
    assert tuner.next_k([0.9, 0.8, 0.7]) == 3 and not tuner.decisions


def test_pipelined_tuner_does_not_time_the_passes_after_a_change_of_depth():
    """The first SKIP passes at a new K (a new verify shape compiling: seconds on a GPU; the pipeline refilling) are
    not timed: a 100x spike there leaves the costs as the steady passes say, and speculation stays on."""
    tuner = rounds.PipelinedTuner(2)
    ks, since_change = [], 0
    for _ in range(40):
        k = tuner.next_k([0.9, 0.8])
        since_change = since_change + 1 if ks and k == ks[-1] else 0
        tuner.observe(k, (100.0 if since_change == 0 else 1.0) * (1.0 + 0.25 * k))
        ks.append(k)
    assert tuner.cost[0] == pytest.approx(1.0) and tuner.cost[2] == pytest.approx(1.5)
    assert not tuner.decisions and ks[-1] == 2
    # the spikes (compiles inside a generation) are logged with the depths around them: the first is K=2's start
    slow = [e for e in tuner.log if e.startswith("slow pass")]
    assert slow and slow[0].startswith("slow pass: 150000 ms at K=2 after K=0") and len(slow) <= tuner.LOGGED_SWITCHES


@pytest.mark.parametrize("name,k", [("pattern", 3), ("tied", 2)])
def test_traced_rounds_replay_one_trace_and_stay_exact(checkpoints, monkeypatch, name, k):
    """Steady-state rounds replay one mx.compile trace (the Python round is built only when MLX traces it) and give
    the tokens, acceptance and round count of rounds built op by op, and plain decoding's tokens; across a KV buffer
    growth (a new shape: one more trace) too. The first round replays the trace as well: the prompt's slots go to
    the head before it, and its pending rows and GDN states are a round's (PipelinedRounds._settle)."""
    model, _ = load(checkpoints[name])
    n = 150
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(n + 10))]
    built = {"traced": 0, "eager": 0}
    draft = rounds.PipelinedRounds.draft

    def counting(self, r, k=None):
        built["traced" if isinstance(self.y, mx.array) and _tracing() else "eager"] += 1
        return draft(self, r, k)

    def _tracing():  # a draft built while MLX traces a round has a slot's rounds set
        return any(slot.owner is not None for _, slot in model.runtime.traces.get("rounds", {}).values())

    monkeypatch.setattr(rounds.PipelinedRounds, "draft", counting)
    monkeypatch.setattr(caches.FixedKVCache, "GROW", 64)  # PROMPT + 150 tokens crosses 128 rows
    out = {}
    for on in (False, True):
        model.runtime.traces.pop("rounds", None)
        built.update(traced=0, eager=0)
        with rounds.tracing(on):
            out[on] = spec_tokens(model, PROMPT, n, verify="pipelined", k=k,
                                  drafter=oracles.DeviceOracle(plain, 0.7, model.args.vocab_size, k, seed=5))
        out[on] = (*out[on], dict(built))
    (eager, s0, b0), (traced, s1, b1) = out[False], out[True]
    assert eager == traced == plain[:n]
    assert s0.accepted_hist == s1.accepted_hist and s0.rounds == s1.rounds > 20
    assert b0["traced"] == 0 and b0["eager"] >= s0.rounds
    # traced: no round built op by op, one trace per buffer capacity (the head's buffer and the target's grow
    # together; apart, they grew at different rounds: 3 traces). Before _settle the first round was built op by op.
    assert b1["eager"] == 0 and b1["traced"] == 2, b1


def test_sampled_traced_rounds_draw_what_rounds_built_op_by_op_draw(checkpoints):
    """Sampled rounds trace too: the PRNG key goes in and out of the trace, so under one seed the traced loop draws
    the very tokens of the loop built op by op (and so keeps its distribution, tested on that loop)."""
    model, _ = load(checkpoints["pattern"])
    sampler = Sampler(temp=0.8, top_p=0.95)
    out = {}
    for on in (False, True):
        model.runtime.traces.pop("rounds", None)
        mx.random.seed(11)
        with rounds.tracing(on):
            out[on] = spec_tokens(model, PROMPT, 60, verify="pipelined", k=3, sampler=sampler)
    (eager, s0), (traced, s1) = out[False], out[True]
    assert eager == traced and s0.accepted_hist == s1.accepted_hist
    assert len(model.runtime.traces["rounds"]) == 1  # the sampled round was traced (one K, one sampler)


def test_one_round_trace_serves_every_temperature_top_p_and_min_p(checkpoints):
    """The sampler's numbers are inputs of a round's trace: samplers that differ only in them share one trace, and
    each draws under its seed the tokens of rounds built op by op."""
    model, _ = load(checkpoints["pattern"])
    model.runtime.traces.pop("rounds", None)
    for sampler in (Sampler(temp=0.8, top_p=0.95), Sampler(temp=1.2, top_p=0.6), Sampler(temp=0.4, top_p=0.9)):
        out = {}
        for on in (False, True):
            mx.random.seed(21)
            with rounds.tracing(on):
                out[on] = spec_tokens(model, PROMPT, 40, verify="pipelined", k=2, sampler=sampler)
        (eager, s0), (traced, s1) = out[False], out[True]
        assert eager == traced and s0.accepted_hist == s1.accepted_hist, sampler
    assert len(model.runtime.traces["rounds"]) == 1


def test_traced_rounds_follow_the_switch(checkpoints, monkeypatch):
    model, _ = load(checkpoints["pattern"])
    seen = []
    real = rounds.PipelinedRounds.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        seen.append(self.traced)

    monkeypatch.setattr(rounds.PipelinedRounds, "__init__", spy)
    monkeypatch.setenv("LATTICE_TRACE_ROUNDS", "0")
    spec_tokens(model, PROMPT, 8, verify="pipelined", k=2)
    monkeypatch.setenv("LATTICE_TRACE_ROUNDS", "1")
    spec_tokens(model, PROMPT, 8, verify="pipelined", k=2)
    with rounds.tracing(False):
        spec_tokens(model, PROMPT, 8, verify="pipelined", k=2)
    # a host-side override (no device_inputs/apply) cannot go into a trace
    spec_tokens(model, PROMPT, 8, verify="pipelined", k=2, drafter=lambda d, q, rr, r: (d, q))
    assert seen == [False, True, False, False]
    monkeypatch.setenv("LATTICE_TRACE_ROUNDS", "2")
    with pytest.raises(ValueError, match="LATTICE_TRACE_ROUNDS"):
        rounds.tracing_enabled()


def test_traced_rounds_see_replaced_and_edited_weights(checkpoints):
    """The weights are captured inputs of a round's trace, read at every call: a weight replaced, or changed in place
    (the same array object), is what the next traced round computes with (fails with weights as trace constants)."""
    model, _ = load(checkpoints["pattern"])

    def both():
        plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(40))]
        spec, _ = spec_tokens(model, PROMPT, 40, verify="pipelined", k=2,
                              drafter=oracles.DeviceOracle(plain, 0.9, model.args.vocab_size, 2, seed=2))
        return plain, spec

    first, spec = both()
    assert spec == first
    norm = model.model.norm
    norm.weight = norm.weight * -1.5  # a new array: another model, other greedy tokens
    second, spec = both()
    assert second != first and spec == second
    w = norm.weight
    w *= -0.5  # in place: the same array object
    assert norm.weight is w
    third, spec = both()
    assert third != second and spec == third
    assert len(model.runtime.traces["rounds"]) == 1  # one trace served all three


def test_a_failing_trace_leaves_the_model_and_the_prng_usable(checkpoints, monkeypatch):
    """MLX puts a trace's captured inputs (the weights, the PRNG key) back only when the traced function returns; a
    round that raises while it is traced must not leave them as placeholders (plain sampling failed after one)."""
    model, _ = load(checkpoints["pattern"])
    verify = rounds.PipelinedRounds.verify

    def failing(self, drafts, q):
        if any(slot.owner is self for _, slot in model.runtime.traces.get("rounds", {}).values()):
            raise RuntimeError("planted")
        return verify(self, drafts, q)

    monkeypatch.setattr(rounds.PipelinedRounds, "verify", failing)
    with pytest.raises(RuntimeError, match="planted"):
        spec_tokens(model, PROMPT, 30, verify="pipelined", k=2)
    assert not model.runtime.traces["rounds"]  # the failed trace is not kept
    monkeypatch.setattr(rounds.PipelinedRounds, "verify", verify)
    mx.random.seed(3)
    sampled = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler(temp=1.0)), range(8))]
    mx.random.seed(3)
    assert sampled == [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler(temp=1.0)), range(8))]
    plain = [t for t, _ in zip(generate_step(model, mx.array(PROMPT), sampler=Sampler()), range(30))]
    assert spec_tokens(model, PROMPT, 30, verify="pipelined", k=2)[0] == plain


def test_traced_round_is_reused_across_generations_and_prompt_lengths(checkpoints):
    model, _ = load(checkpoints["tied"])
    for n in (13, 5, 9, 13):
        prompt = PROMPT[:n]
        plain = [t for t, _ in zip(generate_step(model, mx.array(prompt), sampler=Sampler()), range(30))]
        spec, _ = spec_tokens(model, prompt, 30, verify="pipelined", k=2,
                              drafter=oracles.DeviceOracle(plain, 0.8, model.args.vocab_size, 2, seed=n))
        assert spec == plain
    assert len(model.runtime.traces["rounds"]) == 1


def test_pipelined_tuner_starts_from_the_costs_measured_before():
    """A tuner given the memory an earlier generation filled skips the plain baseline: it starts at the depth picked
    last, from those costs, and keeps writing what it measures; an empty memory means the baseline. The memory is the
    process's, per model and greedy/sampled, and goes with the model."""
    from lattice_mlx.speculative.tuning import ADAPTIVE_WARMUP_ROUNDS, PLAIN_TIMED_STEPS, PLAIN_WARMUP_STEPS

    cost = lambda k: 1.0 + 0.25 * k  # noqa: E731
    memory = {}
    first = rounds.PipelinedTuner(3, memory)
    ks = _tune(first, [0.9, 0.8, 0.7], cost, PLAIN_WARMUP_STEPS + PLAIN_TIMED_STEPS + ADAPTIVE_WARMUP_ROUNDS + 8)
    assert ks[0] == 0 and ks[-1] == 3
    assert memory["k"] == 3 and memory["cost"][0] == pytest.approx(1.0) and memory["cost"][3] == pytest.approx(1.75)
    second = rounds.PipelinedTuner(3, memory)
    ks = _tune(second, [0.9, 0.8, 0.7], lambda k: 1.1 * cost(k), 12)
    assert ks == [3] * 12 and second.log[0].startswith("start at K=3 from the costs measured before")
    assert memory["cost"][3] > 1.76  # its own passes (10% dearer) moved the shared costs
    # a tuner for a smaller K cap starts within it; without costs of rounds (or none at all) the baseline comes first
    assert rounds.PipelinedTuner(2, memory).next_k([0.9, 0.8]) == 2
    assert rounds.PipelinedTuner(3, {"cost": {0: 1.0}, "k": 3}).next_k([0.9]) == 0
    assert rounds.PipelinedTuner(3).next_k([0.9]) == 0
    model, other = sample.Sampler(), sample.Sampler()  # (any objects that take weak references)
    m = rounds.tuner_memory(model, True)
    assert rounds.tuner_memory(model, True) is m and rounds.tuner_memory(model, False) is not m
    assert rounds.tuner_memory(other, True) is not m
    kept = weakref.ref(model.runtime)  # the memory lives on the model, so it goes with it
    del model
    gc.collect()
    assert kept() is None


def test_pipelined_tuner_does_not_stop_speculating_on_a_few_unlucky_rounds():
    """Four rounds that read acceptance 0.25 predict no gain, but with spec.OFF_HOPE more accepted rounds they would:
    the tuner keeps speculating (a wrong plain stretch costs 64+ tokens at plain speed) until its rounds tell; rates
    as low as the hopeful ones still turn it off. And none of it before MIN_OFF_ROUNDS rounds were read in the
    generation: in the pipelined loop (lag 2) the first decision read two rounds, and two rejected first drafts
    turned the demo at temperature 0.7 off where a fixed K paid 1.25x (H200)."""
    from lattice_mlx.speculative.tuning import (
        ADAPTIVE_WARMUP_ROUNDS,
        MIN_OFF_ROUNDS,
        OFF_CONFIRM,
        OFF_HOPE,
        PLAIN_TIMED_STEPS,
        PLAIN_WARMUP_STEPS,
    )

    cost = lambda k: 1.0 + 0.2 * k  # noqa: E731
    start = PLAIN_WARMUP_STEPS + PLAIN_TIMED_STEPS + ADAPTIVE_WARMUP_ROUNDS
    stats = SpecStats.of(SpecOptions(draft_tokens=2))
    for n in [0, 1, 0, 0]:
        stats.record(2, n)
    rates, hopeful = stats.accepted_per_position(8), stats.accepted_per_position(8, OFF_HOPE)
    early = MIN_OFF_ROUNDS - ADAPTIVE_WARMUP_ROUNDS
    assert early > 0
    plain = rounds.PipelinedTuner(2)
    _tune(plain, rates, cost, start)
    assert plain.speedup(1, rates) < 1.05 and plain.speedup(1, hopeful) >= 1.05
    # too few rounds read yet, then OFF_CONFIRM decisions in a row that find no gain
    assert all(_tune(plain, rates, cost, early + OFF_CONFIRM - 1)) and not plain.decisions
    assert plain.next_k(rates) == 0 and "off for 64 tokens" in plain.decisions[0]  # (without the hopeful rates)
    hoping = rounds.PipelinedTuner(2)
    _tune(hoping, rates, cost, start + early)
    assert hoping.next_k(rates, lambda: hopeful) > 0 and not hoping.decisions
    low = [hoping.next_k([0.05], lambda: [0.08]) for _ in range(OFF_CONFIRM)]
    assert low[-1] == 0 and all(low[:-1]) and hoping.decisions  # hopeless even with hope
    # the pipelined loop's lag: the warm-up and the rounds before an off decision are counted as read, two passes on
    lagged = rounds.PipelinedTuner(2, lag=2)
    ks = []
    for _ in range(PLAIN_WARMUP_STEPS + PLAIN_TIMED_STEPS + MIN_OFF_ROUNDS + 1 + OFF_CONFIRM):  # (the baseline, the
        ks.append(lagged.next_k([0.0], lambda: [0.0]))  # rounds read before a decision and the one dispatched but
        lagged.observe(ks[-1], cost(ks[-1]))  # not read yet, the decisions that confirm it)
    assert ks[-3:] == [2, 2, 0] and len(lagged.decisions) == 1


def test_the_pipelined_tuner_counts_the_rounds_its_rates_hold(checkpoints, monkeypatch):
    """In a real pipelined generation (adaptive, the head's own drafts, speculation switching on and off), at every
    decision the tuner's count of rounds read (`read()`, from `lag=2`) is the number of rounds the acceptance it is
    given holds: a lag of 0 read rounds not recorded yet (the first decision saw two rounds where it counted four)."""
    seen = []

    class Counting(rounds.PipelinedTuner):
        def next_k(self, rates, hopeful=None):
            seen.append((self.read(), hopeful.args[0].rounds))  # (hopeful: tuning.tuner_rates on the stats)
            return super().next_k(rates, hopeful)

    monkeypatch.setattr(rounds, "PipelinedTuner", Counting)
    # passes timed at fixed costs per depth: the decisions (how many rounds, how long a stretch) are then the same on
    # a loaded machine as on an idle one
    observe = rounds.PipelinedTuner.observe
    monkeypatch.setattr(Counting, "observe", lambda self, k, s: observe(self, k, 1e-3 * (1 + 0.4 * k)))
    model, _ = load(checkpoints["pattern"])
    _, stats = adaptive_tokens(model, PROMPT, 120)  # (the probe after the first plain stretch included: a stretch
    # runs as plain decoding's loop, with no decision per pass, PipelinedTuner.plain_ran)
    assert stats.rounds >= 16 and len(seen) > 20, (stats.rounds, len(seen))
    assert all(counted == recorded for counted, recorded in seen), seen


def test_pipelined_tuner_keeps_compiles_and_stalls_out_of_its_costs():
    """H200 (b257909): a 2.4 s compile among the baseline's plain steps made cost(0) 478 ms; kept in the memory, every
    later generation predicted huge gains, never ran plain steps again and never left K=2 (the line through cost(0)
    put K=3 at a negative cost). Now such passes are logged and not timed: over SLOW_PASS times the cheapest cost,
    over SPIKE times their own depth's; a first measurement that was a spike gives way to the next ordinary pass; and
    an estimate is never below a shallower depth's cost."""
    tuner = rounds.PipelinedTuner(3, memory := {})
    passes = itertools.count()
    ks = _tune(tuner, [0.8, 0.64, 0.51], lambda k: 478.0 if next(passes) == 6 else 1.0 + 0.25 * k, 30)
    assert tuner.cost[0] == pytest.approx(1.0) and memory["cost"][0] == pytest.approx(1.0)
    assert tuner.log[0].startswith("slow pass: 478000 ms at K=0")
    assert 3 in ks and ks[-1] == 3
    tuner = rounds.PipelinedTuner(2)
    for s in [1.0, 1.0, 9.0, 1.0, 1.1]:  # (the first two after the start are not timed)
        tuner.observe(0, s)
    assert tuner.cost[0] == pytest.approx(1.0)  # the 9 s pass gave way to the first ordinary one (median of 1, 1.1)
    tuner.observe(0, 30.0)  # a compile: logged, not timed
    assert tuner.cost[0] == pytest.approx(1.0) and tuner.log[-1].startswith("slow pass: 30000 ms at K=0")
    tuner.observe(0, 3.0)  # 3x: timed (a round may cost 3 plain steps); over SPIKE times the cost so far is not
    tuner.observe(0, 6.0)  # (> 4 x 1.1)
    assert tuner.cost[0] == pytest.approx(1.1)  # the median of 1.0, 1.1, 3.0: one dear pass does not move it
    for s in [1.2, 1.3, 1.3, 1.3, 1.3]:  # the window keeps the last COST_WINDOW passes
        tuner.observe(0, s)
    assert tuner.cost[0] == pytest.approx(1.3) and len(tuner.window[0]) == tuning.COST_WINDOW
    tuner.cost = {0: 2.0, 1: 1.5, 2: 1.6}  # noisy costs: the line through cost(0) and cost(2) falls to 1.4 at K=3
    assert tuner.estimate(3) == pytest.approx(2.0) and tuner.estimate(1) == 1.5  # not below a plain step's cost
    tuner.cost = {0: 1.0, 1: 2.0, 2: 1.2}
    assert tuner.estimate(3) == pytest.approx(2.0)  # nor below K=1's (the line: 1.3)
    # a lone fast pass is averaged in (it replaced the cost once, and every ordinary pass after it was a "stall")
    tuner = rounds.PipelinedTuner(2)
    for s in [1.7, 1.7, 1.7, 1.7, 0.4] + [1.7] * 50:
        tuner.observe(0, s)
    assert tuner.cost[0] == pytest.approx(1.7, rel=1e-3)
    # costs that really rise past SPIKE times (a longer context, a slower machine than the memory's) are taken after
    # REJECTS passes in a row, not rejected for good
    tuner = rounds.PipelinedTuner(2, {"cost": {0: 1.0, 2: 1.5}, "k": 2})
    for _ in range(2 + tuner.REJECTS + 10):
        tuner.observe(2, 7.5)
    assert tuner.cost[2] == pytest.approx(7.5) and any(e.startswith("stall: 7500 ms at K=2") for e in tuner.log)


def test_pipelined_tuner_turns_off_when_nothing_is_accepted_even_if_its_plain_steps_are_dear():
    """Its plain steps measured dearer than its rounds (run 22, H200: built plain steps 2.26 ms, traced K=1 rounds
    1.83-2.21 ms) made a round that accepts nothing predict 1.19x, so speculation never went off (simulated: 1000 of
    1000 passes at K=1, about 0.75x true plain). A plain cost above a round's reads as that round's."""
    from lattice_mlx.speculative.tuning import OFF_HOPE

    tuner = rounds.PipelinedTuner(2, {"cost": {0: 2.26, 1: 1.9, 2: 2.5}, "k": 1})
    stats, ks = SpecStats.of(SpecOptions(draft_tokens=2)), []
    for _ in range(200):
        k = tuner.next_k(stats.accepted_per_position(8), lambda: stats.accepted_per_position(8, OFF_HOPE))
        tuner.observe(k, {0: 2.26, 1: 1.9, 2: 2.5}[k])
        if k:
            stats.record(k, 0)
        ks.append(k)
    assert tuner.speedup(1, [0.0]) == pytest.approx(1.0)
    assert tuner.decisions and ks[-50:].count(0) > 45, ks
