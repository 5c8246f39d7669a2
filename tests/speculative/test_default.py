"""speculation="auto" ([spec-default]): the API's and generate's default, what it resolves to, the flags around it;
and the pipelined tuner's decisions where drafts are poor or no depth can pay."""

import json
import os
import subprocess
import sys
import types

import pytest
from conftest import load_script

from lattice_mlx import SpecStats, generate, load, settings
from lattice_mlx.speculative import auto_applies
from lattice_mlx.speculative.tuning import (
    MAX_OFF_TOKENS,
    MIN_OFF_ROUNDS,
    MIN_POSITION_ROUNDS,
    OFF_CONFIRM,
    OFF_HOPE,
    SPECULATE_MIN_GAIN,
    PipelinedTuner,
)


def run_cli(*args, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "lattice_mlx.generate", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})

PROMPT = "def fibonacci(n):\n"


def test_auto_speculates_where_it_applies_and_decodes_plainly_elsewhere(checkpoints, no_mtp_checkpoint):
    """The API's default: MTP (adaptive, K up to 4) with a head where LATTICE_MTP=1; plain decoding by default (off
    until the default's H200 evidence holds: docs/adr/0008), with LATTICE_MTP=0, or on a checkpoint without a head
    (no error). Greedy tokens are plain decoding's either way."""
    model, tok = load(checkpoints["tied"])
    plain = generate(model, tok, PROMPT, max_tokens=24, speculation=None)
    assert plain.speculation is None
    for mtp, on in [(None, False), (True, True), (False, False)]:
        with settings.override(mtp=mtp):
            assert auto_applies(model) == on
            got = generate(model, tok, PROMPT, max_tokens=24)  # speculation="auto"
        assert got.tokens == plain.tokens
        assert (got.speculation is not None) == on, mtp
        if on:
            assert got.speculation["draft"] == "mtp" and got.speculation["verify"] == "pipelined"
            assert got.speculation["draft_tokens"] == 4
    bare, tok2 = load(no_mtp_checkpoint)
    with settings.override(mtp=True):
        assert not auto_applies(bare)
        assert generate(bare, tok2, PROMPT, max_tokens=8).speculation is None
        # what the caller asked for beside it rules speculation out: plain, no error
        assert generate(model, tok, PROMPT, max_tokens=8, max_kv_size=64).speculation is None
    with pytest.raises(ValueError, match="'auto', a SpecOptions or None"):
        generate(model, tok, PROMPT, max_tokens=8, speculation="on")
    with pytest.raises(ValueError, match="'auto', a SpecOptions or None"):
        generate(model, tok, PROMPT, max_tokens=8, speculation=True)


def test_generate_tells_the_loop_its_budget_and_the_process_pays_its_first_rounds_once(checkpoints, monkeypatch):
    """Through the API: a short first generation of a freshly loaded model stays in plain steps
    (tuning.FIRST_ROUNDS_S: its rest cannot repay the process's first rounds), its tokens plain decoding's; with the
    rental off the same generation speculates, and the model's runtime records that its first rounds are paid, after
    which nothing is held back."""
    from lattice_mlx import SpecOptions
    from lattice_mlx.speculative import tuning

    model, tok = load(checkpoints["tied"])
    plain = generate(model, tok, PROMPT, max_tokens=24, speculation=None)
    got = generate(model, tok, PROMPT, max_tokens=24, speculation=SpecOptions())
    assert got.tokens == plain.tokens and got.speculation["rounds"] == 0
    # (the loop is told 23 tokens after the prefill's; the baseline ran 10 of them)
    assert any("last 13 tokens" in d and "would not pay yet" in d for d in got.speculation["decisions"])
    assert not model.runtime.rounds_run
    monkeypatch.setattr(tuning, "FIRST_ROUNDS_S", 0.0)
    got = generate(model, tok, PROMPT, max_tokens=24, speculation=SpecOptions())
    assert got.tokens == plain.tokens and got.speculation["rounds"] > 0 and model.runtime.rounds_run
    # a sampled generation weighs them at its own price (FIRST_ROUNDS_SAMPLED_S): the greedy one's off holds nothing
    # there (a fresh model: the one above has paid)
    fresh, _ = load(checkpoints["tied"])
    got = generate(fresh, tok, PROMPT, max_tokens=24, temp=0.7, seed=3, speculation=SpecOptions())
    assert got.speculation["rounds"] == 0 and not fresh.runtime.rounds_run
    assert any(f"~{1e3 * tuning.FIRST_ROUNDS_SAMPLED_S:.0f} ms" in d for d in got.speculation["decisions"])
    monkeypatch.setattr(tuning, "FIRST_ROUNDS_SAMPLED_S", 0.0)
    got = generate(fresh, tok, PROMPT, max_tokens=24, temp=0.7, seed=3, speculation=SpecOptions())
    assert got.speculation["rounds"] > 0 and fresh.runtime.rounds_run
    monkeypatch.undo()
    fresh, _ = load(checkpoints["tied"])
    fresh.runtime.rounds_run = True  # (as after a warm-up or an earlier generation's rounds)
    got = generate(fresh, tok, PROMPT, max_tokens=24, speculation=SpecOptions())
    assert got.tokens == plain.tokens and got.speculation["rounds"] > 0


def test_cli_default_mtp_and_no_mtp(checkpoints):
    """generate's CLI: neither flag is speculation="auto" (on with LATTICE_MTP=1); --mtp speculates; --no-mtp decodes
    plainly whatever LATTICE_MTP says; the two flags together are a one-line usage error."""
    base = ["--model", str(checkpoints["tied"]), "--prompt", "hello", "--max-tokens", "12", "--json"]

    def run(*flags, env=None):
        out = run_cli(*base, *flags, env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])

    default, forced, plain = run(env={"LATTICE_MTP": ""}), run("--mtp"), run("--no-mtp", env={"LATTICE_MTP": "1"})
    assert "speculation" not in default and "speculation" in forced and "speculation" not in plain
    assert forced["speculation"]["draft_tokens"] == 4 and forced["tokens"] == plain["tokens"] == default["tokens"]
    by_env = run("--draft-tokens", "2", env={"LATTICE_MTP": "1"})
    assert by_env["speculation"]["draft_tokens"] == 2 and by_env["tokens"] == plain["tokens"]
    both = run_cli(*base, "--mtp", "--no-mtp")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr and "Traceback" not in both.stderr
    tree = run_cli(*base, "--no-mtp", "--tree", "2-1")
    assert tree.returncode == 1 and "contradict" in tree.stderr and "Traceback" not in tree.stderr


class _Costs(PipelinedTuner):
    """A tuner whose passes cost what it is told (no clock)."""

    def run(self, costs: dict[int, float], rates: list[float], passes: int) -> list[int]:
        ks = []
        for _ in range(passes):
            k = self.next_k(rates, lambda: rates)
            self.observe(k, costs[k])
            ks.append(k)
        return ks


@pytest.mark.parametrize("passes", [1, 5, 40])
def test_a_plain_stretch_reported_at_once_is_its_passes_one_by_one(passes):
    """PipelinedTuner.plain_ran (the loop's plain stretch run as plain decoding's own loop) leaves the tuner as the
    same passes decided and timed one by one would: the stretch's count and carried rest, the pass clock, plain's
    cost (its window: the last COST_WINDOW passes, a stall among them not timed) and when it was last read."""
    seconds = [1.0 + 0.01 * (i % 7) for i in range(passes)]
    if passes > 5:
        seconds[-3] = 9.0  # a stall: not timed either way
    tuners = []
    for at_once in (False, True):
        memory = {"cost": {0: 1.0, 3: 1.5}, "k": 3}
        tuner = PipelinedTuner(4, memory, lag=2)
        tuner.observe(3, 1.5)
        tuner.k, tuner.left = 0, 50  # an off decision's stretch
        memory["off"], memory["stretch"] = 50, 64
        if at_once:
            tuner.plain_ran(seconds)
        else:
            for s in seconds:
                assert tuner.next_k([0.0]) == 0
                tuner.observe(0, s)
        tuners.append(tuner)
    one, all_ = tuners
    for name in ("left", "since", "prev", "cost", "window", "at", "memory", "rejected"):
        assert getattr(one, name) == getattr(all_, name), name
    assert list(one.after) == list(all_.after) and all_.plain_left() == 50 - passes


def test_tuner_goes_plain_for_the_longest_stretch_where_no_depth_can_pay():
    """Rounds that cost what K + 1 plain steps cost (MLX's CPU backend, by measurement) cannot pay even when every
    draft is kept: the tuner turns speculation off for the longest stretch at its first decision, and the next
    generation in the process continues with that stretch's rest (after one probe that confirms it: the first verdict
    takes the ordinary stretch). Where rows are cheap (a GPU) the same acceptance keeps it speculating."""
    linear = {k: 1.0 * (k + 1) for k in range(5)}
    memory: dict = {}
    tuner = _Costs(4, memory)
    ks = tuner.run(linear, [0.95, 0.9, 0.85, 0.8], 150)
    assert ks.count(0) >= 120 and memory["hopeless"] and tuner.left > MAX_OFF_TOKENS - 150
    assert len(tuner.decisions) == 2 and all("every draft kept" in d for d in tuner.decisions)
    assert f"off for {MAX_OFF_TOKENS} tokens" in tuner.decisions[1]
    nxt = _Costs(4, memory)
    assert nxt.run(linear, [0.95], 40) == [0] * 40
    cheap = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}
    memory = {}
    ks = _Costs(4, memory).run(cheap, [0.95, 0.9, 0.85, 0.8], 60)
    assert ks[-20:].count(0) == 0 and not memory.get("hopeless") and max(ks) == 4
    # acceptance 0: off, but not for good (the head may draft better later in the text)
    memory = {}
    _Costs(4, memory).run(cheap, [0.0], 60)
    assert memory["hopeless"] is False
    assert SPECULATE_MIN_GAIN > 1


def _generation(memory: dict, costs: dict, accepted, passes: int = 256) -> list[int]:
    """One generation's depths on a tuner with `memory`, its rounds accepting `accepted(k)` drafts each."""
    tuner, stats, ks = _Costs(4, memory), SpecStats(), []
    for _ in range(passes):
        k = tuner.next_k(stats.accepted_per_position(MIN_POSITION_ROUNDS),
                         lambda: stats.accepted_per_position(MIN_POSITION_ROUNDS, OFF_HOPE))
        tuner.observe(k, costs[k])
        if k:
            stats.record(k, accepted(k))
        ks.append(k)
    return ks


def _probes(ks: list[int]) -> int:
    return sum(1 for a, b in zip(ks, ks[1:]) if a == 0 and b > 0)


def test_tuner_at_acceptance_zero_probes_rarely_and_never_deeper():
    """Drafts never accepted (a random head, oracle p = 0): hope for more accepted rounds keeps the tuner at its depth
    or takes it shallower, never deeper (on the H200 it went K 1 -> 2 'hoping 1.25' at acceptance 0); the plain
    stretches grow 64 -> 256 -> 1024 tokens, so a 256-token generation probes at most twice after its first rounds;
    and a plain stretch is the process's, not the generation's: the next generation probes its own text first (a
    new text drafts as it does: on the H100 two poor texts at temperature 0.7 held three good ones after them in
    plain steps, docs/adr/0008 'Runs K and L'), finding nothing it runs the stretch's rest, then probes, and the
    schedule goes on growing (on the H200, halving the carried stretch per generation made every other generation
    probe, at 6-20% of its time: docs/adr/0008 'Run F'), until POOR_TEXTS texts in a row found no gain. A text's
    probe is 8 rounds at the depth the last one found best."""
    from lattice_mlx.speculative.tuning import PIPELINED_FIRST_OFF, PIPELINED_OFF_GROWTH, POOR_TEXTS

    costs = {0: 1.6, 1: 2.0, 2: 2.3, 3: 2.6, 4: 2.9}  # ms per pass at the H200's 0.8B shape
    memory: dict = {}
    ks = _generation(memory, costs, lambda k: 0)
    for i in range(1, len(ks)):
        assert ks[i] <= max(ks[:i]) or ks[i - 1] == 0  # deeper only when a stretch ends
    assert _probes(ks) <= 2 and ks.count(0) > 220
    stretch = PIPELINED_FIRST_OFF * PIPELINED_OFF_GROWTH
    assert memory["stretch"] == stretch and 0 < memory["off"] < stretch
    # the next generation probes its text (8 rounds, the stretch's schedule untouched), runs the stretch's rest,
    # probes once more, and goes off for the next length of the schedule
    rest = memory["off"]
    ks = _generation(memory, costs, lambda k: 0)
    assert all(ks[:8]) and ks[8 : 8 + rest] == [0] * rest and ks[8 + rest] > 0 and _probes(ks) == 1
    assert memory["stretch"] == MAX_OFF_TOKENS == stretch * PIPELINED_OFF_GROWTH
    # ... which the generations after it run out: a probe of each text until POOR_TEXTS texts in a row found no gain
    # (the second generation's was the first), then none (at acceptance 0 a probe per text cost plain's GPU time per
    # token plus 2.7% on an H100, docs/adr/0008 'Runs P, Q and R'), and one more per MAX_OFF_TOKENS tokens of the
    # process
    later = [_generation(memory, costs, lambda k: 0) for _ in range(8)]
    assert [ks.index(0) for ks in later] == [8] * (POOR_TEXTS - 1) + [0] * (9 - POOR_TEXTS)
    assert sum(map(_probes, later)) == 2 and memory["poor_texts"] == POOR_TEXTS
    # a stretch's probe that pays (a text that drafts well) resets both: the next text is probed first again
    good_rates = [0.95, 0.9, 0.85, 0.8]
    for _ in range(8):
        ks = _generation(memory, costs, lambda k: k)
        if ks[-1]:
            break
    assert ks[-1] and memory["poor_texts"] == 0 and memory["off"] is False
    memory.update(off=100, stretch=MAX_OFF_TOKENS)  # (as if that text had ended in a plain stretch)
    assert _generation(memory, costs, lambda k: 0).index(0) == 8
    # a generation that speculates and pays resets it
    good = {}
    _Costs(4, good).run(costs, good_rates, 40)
    assert good.get("off") in (None, False) and good.get("stretch") in (None, False)
    # the H200's case: at K=1 with K=2's cost known, hope favouring K=2 keeps K=1
    tuner = PipelinedTuner(4, {"cost": {0: 1.6, 1: 2.0, 2: 2.3}, "k": 1})
    tuner.left = 0
    assert tuner.k == 1 and tuner.next_k([0.0], lambda: [0.4, 0.35]) == 1 and not tuner.decisions


def test_the_plain_stretch_schedule_restarts_where_speculation_paid():
    """Stretches grow (64 -> 256 -> 1,024 tokens) only while speculation still cannot pay: a probe that pays (the
    text drafts well again) restarts the schedule, so the next poor stretch of text goes off for 64 tokens, not for
    the grown length; within a generation and in one whose carried schedule had grown. Replayed with texts three in
    ten of which draft at half the rate (replay_tuner.py --vary 0.3,0.5), a good text that dipped once went off for
    1,024 tokens, the rest of its generation, where it paid (docs/adr/0008, 'Run Y')."""
    from lattice_mlx.speculative.tuning import PIPELINED_FIRST_OFF, PIPELINED_OFF_GROWTH

    costs, good = {0: 1.0, 1: 1.3, 2: 1.5, 3: 1.7, 4: 1.9}, [0.95, 0.9, 0.85, 0.8]
    rates = [[0.0]]
    memory: dict = {}
    tuner = _Costs(4, memory)

    def run(passes: int) -> list[int]:
        ks = []
        for _ in range(passes):
            k = tuner.next_k(rates[0], lambda: rates[0])
            tuner.observe(k, costs[k])
            ks.append(k)
        return ks

    run(400)  # drafts never pass: the schedule grows past its first stretch
    assert [d.split(":")[0] for d in tuner.decisions[:2]] == [
        f"speculation off for {PIPELINED_FIRST_OFF} tokens", f"speculation off for "
        f"{PIPELINED_FIRST_OFF * PIPELINED_OFF_GROWTH} tokens"]
    rates[0] = good
    ks = run(2 * MAX_OFF_TOKENS)  # the stretch ends, its probe pays, speculation stays on
    assert ks[-1] and memory["stretch"] is False
    rates[0], seen = [0.0], len(tuner.decisions)
    run(200)
    assert tuner.decisions[seen].startswith(f"speculation off for {PIPELINED_FIRST_OFF} tokens"), tuner.decisions
    # a later generation whose carried schedule had grown: its text probe pays, then its text turns poor
    memory.update(off=100, stretch=MAX_OFF_TOKENS, poor_texts=0, hopeless=False)
    tuner, rates[0] = _Costs(4, memory), good
    assert tuner.resume == 100 and run(40)[-1]
    rates[0] = [0.0]
    run(200)
    assert tuner.decisions[0].startswith(f"speculation off for {PIPELINED_FIRST_OFF} tokens"), tuner.decisions


def test_tuner_recovers_from_a_wrong_off_decision_in_later_generations():
    """One poor start (acceptance 0 over a probe's rounds) turns speculation off, and later generations draft well:
    the next generation probes its own text first, finds the drafts good and speculates from its first round, the
    stretch's rest dropped (on the H200 the demo at temperature 0.7 stayed in plain steps for eight generations after
    one such start when each generation carried the stretch's whole length: docs/adr/0008 'Run E'; carrying its rest
    before a probe, three generations after two poor texts on an H100: 'Runs K and L')."""
    costs, good = {0: 0.9, 1: 1.3, 2: 1.6, 3: 1.9, 4: 2.2}, [0.85, 0.7, 0.6, 0.5]  # the demo's sampled costs, in ms
    memory: dict = {}
    first = _Costs(4, memory)
    assert 0 in first.run(costs, [0.0], 256) and memory["off"]  # the poor start: off, its rest carried on
    ks = _Costs(4, memory).run(costs, good, 256)
    assert ks.count(0) == 0
    assert memory["off"] is False and memory["stretch"] is False and memory["k"] >= 2
    ks = _Costs(4, memory).run(costs, good, 64)
    assert ks.count(0) == 0  # and the generation after that speculates from its first round


def _carried(**kw) -> dict:
    """A tuner memory after a generation that ended 50 tokens into a 64-token plain stretch (ms costs)."""
    costs = kw.pop("costs", {0: 1.0, 1: 1.3, 2: 1.5, 3: 1.7})
    return {"cost": dict(costs), "window": {k: [c] for k, c in costs.items()}, "at": {k: 100 for k in costs},
            "clock": 110, "k": 3, "stretch": 64, "off": 50, "hopeless": False, **kw}


def test_a_carried_stretch_waits_for_a_probe_of_the_new_text():
    """The generation after one that ended in a plain stretch probes its own text first. Finding no gain (and not
    hopeless) it runs the carried rest, the schedule as it was; a stale-plain check inside that probe leaves the
    carried rest alone; a hopeless verdict takes its own stretch, and a later ordinary one the schedule's, not the
    carried rest; the verdict after it is recorded as not hopeless (the next generation probes first again)."""
    memory = _carried()
    tuner = _Costs(3, memory, lag=2)
    ks = tuner.run({0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9}, [0.0], 120)
    assert ks[0] == 3 and ks.count(0) >= 50
    assert tuner.decisions[0].startswith("speculation off for the carried stretch's 50 more tokens")
    # ... and the probe after the rest takes the schedule's next stretch (64 -> 256)
    assert tuner.decisions[1].startswith("speculation off for 256 tokens")
    assert memory["stretch"] == 256 and memory["hopeless"] is False
    # plain's cost read long ago: the probe reads it again (6 plain steps), the carried rest stays 50 meanwhile
    memory = _carried(at={0: 10, 1: 100, 2: 100, 3: 100})
    tuner, offs = _Costs(3, memory, lag=2), []
    for _ in range(60):
        k = tuner.next_k([0.0], lambda: [0.0])
        tuner.observe(k, {0: 1.0, 1: 1.3, 2: 1.6, 3: 1.9}[k])
        offs.append(memory["off"])
        if tuner.decisions:
            break
    assert any("plain's cost is stale" in line for line in tuner.log) and set(offs[:-1]) == {50}
    assert tuner.decisions == [tuner.decisions[0]] and "carried stretch's 50" in tuner.decisions[0]
    # rounds that cost K + 1 plain steps (hopeless), then cheap rounds that still find no gain
    memory = _carried(costs={0: 1.0, 1: 2.4, 2: 3.6, 3: 4.8})
    tuner, ks = _Costs(3, memory, lag=2), []
    for i in range(700):
        k = tuner.next_k([0.0], lambda: [0.0])
        tuner.observe(k, 1.0 if k == 0 else (k + 1) * 1.2 if i < 40 else 1.0 + 0.3 * k)
        ks.append(k)
    assert "every draft kept" in tuner.decisions[0] and len(tuner.decisions) >= 2
    assert not any("carried" in d for d in tuner.decisions) and memory["hopeless"] is False
    assert not _Costs(3, memory, lag=2).log[-1].startswith("plain steps for")


def test_tuner_takes_a_new_depth_for_a_clear_gain_and_probes_at_the_best_depth():
    """A depth's first round in a process traces its round: the tuner moves up to a depth without a trace only for
    NEW_DEPTH_MIN_GAIN, to a traced one for SWITCH_MIN_GAIN. Its kernels are those every depth shares (the depth is
    in no fused kernel's name: test_pipelined's test_a_new_depth_or_capacity_compiles_no_kernel), so after a plain
    stretch it probes at the best depth, traced or not: probes held at a traced K=3 where drafts fail cost every
    generation more per round than K=2's (run M), and a shallower depth on hope may be a new one too."""
    from lattice_mlx.speculative.tuning import NEW_DEPTH_MIN_GAIN, SWITCH_MIN_GAIN

    costs, rates = {0: 1.0, 2: 1.5, 3: 1.75, 4: 2.05}, [0.9, 0.85, 0.8, 0.78]

    def at3(traced):
        tuner = PipelinedTuner(4, {"cost": dict(costs), "k": 3}, traced)
        tuner.left = 0
        return tuner, tuner.next_k(rates)

    tuner, k = at3(lambda d: True)
    gain = tuner.speedup(4, rates) / tuner.speedup(3, rates)
    assert SWITCH_MIN_GAIN < gain < NEW_DEPTH_MIN_GAIN and k == 4
    assert at3(lambda d: d != 4)[1] == 3
    costs[4] = 1.95  # (a gain past NEW_DEPTH_MIN_GAIN: the new depth is taken)
    assert at3(lambda d: d != 4)[1] == 4
    # off at acceptance 0, the best depth (K=2) untraced: the next probe is at K=2 all the same
    fresh = {"cost": dict(costs), "k": 3, "at": {d: 0 for d in costs}, "clock": 1}  # (plain's cost just read)
    for traced in (lambda d: d == 3, None):
        tuner = PipelinedTuner(4, {**fresh, "cost": dict(costs)}, traced)
        tuner.left, tuner.dispatched, tuner.below = 0, MIN_OFF_ROUNDS, OFF_CONFIRM - 1
        assert tuner.next_k([0.0]) == 0 and tuner.probe_k == 2
    # ... and where a new text's probe finds no gain, the carried stretch goes on and the next probe is at K=2 too
    carried = {**fresh, "cost": dict(costs), "stretch": 256, "off": 100}
    tuner = PipelinedTuner(4, carried, lambda d: d == 3, lag=2)
    assert tuner.resume == 100 and tuner.k == 3
    tuner.left, tuner.dispatched, tuner.below = 0, MIN_OFF_ROUNDS, OFF_CONFIRM - 1
    tuner.after.extend([MIN_OFF_ROUNDS] * 2)
    assert tuner.next_k([0.0]) == 0 and "carried stretch" in tuner.decisions[-1] and tuner.probe_k == 2
    # few rounds read, hope alone keeps speculating: at a shallower depth, traced or not
    tuner = PipelinedTuner(4, {**fresh, "cost": dict(costs)}, lambda d: d == 3)
    tuner.left, tuner.dispatched = 0, 2
    assert tuner.next_k([0.3], lambda: [0.45]) == 2


def test_a_depth_read_long_ago_in_a_slow_spell_is_read_again():
    """Run M's demo at 0.7: K=2 read at 3.37 ms in one slow spell (twice its cost), the tuner went to K=1 (1.19 ms,
    plain 1.15) and stayed there for six generations where K=3 paid. A depth's reading REREAD_PASSES passes old
    while the tuner sits at another costs at most the line through plain's and the current depth's cost: the tuner
    goes to K=2 to read it again. A recent reading still rules (K=1 stays)."""
    from lattice_mlx.speculative.tuning import REREAD_PASSES

    rates = [0.85, 0.71, 0.56, 0.44]  # (P(drafts 1..i accepted), the demo's at 0.7)
    costs = {0: 1.15e-3, 1: 1.19e-3, 2: 3.37e-3, 3: 2.47e-3, 4: 2.62e-3}

    def at_k1(age: int) -> int:
        clock = 10_000
        memory = {"cost": dict(costs), "k": 1, "clock": clock,
                  "at": {0: clock - 5, 1: clock - 1, 2: clock - age, 3: clock - age, 4: clock - age}}
        tuner = PipelinedTuner(4, memory)
        tuner.k, tuner.left, tuner.prev, tuner.since = 1, 0, 1, 50
        return tuner.next_k(rates, lambda: rates)

    assert at_k1(REREAD_PASSES - 1) == 1
    assert at_k1(REREAD_PASSES) == 2
    # the line through plain's and the current depth's cost never prices a depth below a shallower one's: a K=1 read
    # below plain (1.10 against 1.15 ms) made the line slope down, K=4 cost 0.95 ms on it, and at acceptance 0 the
    # tuner went to K=4 instead of off
    clock = 10_000
    memory = {"cost": {0: 1.15e-3, 1: 1.10e-3, 2: 1.9e-3, 3: 2.47e-3, 4: 2.62e-3}, "k": 1, "clock": clock,
              "at": {0: clock - 5, 1: clock - 1, 2: clock - 300, 3: clock - 300, 4: clock - 300}}
    tuner = PipelinedTuner(4, memory)
    tuner.k, tuner.left, tuner.prev, tuner.since = 1, 0, 1, 50
    tuner.dispatched, tuner.below = MIN_OFF_ROUNDS, OFF_CONFIRM - 1
    assert all(tuner.estimate(d) >= 1.10e-3 for d in range(1, 5))
    assert tuner.next_k([0.0], lambda: [0.0]) == 0


def test_a_depth_read_in_the_processs_first_generation_is_read_again_in_the_second(monkeypatch):
    """Run Z's 0.8B shape at oracle 0.5: K=2 read 3.25 ms a pass in the process's first generation (its fixed leg:
    2.29 ms a round), and the tuner sat at K=3 for seven generations. From the second generation a reading the first
    one took is priced as one REREAD_PASSES old (at most the line through plain's and the current depth's cost):
    the tuner goes to K=2 to read it again. Off, or the reading taken in the second generation, K=2 keeps its cost."""
    from lattice_mlx.speculative import tuning

    rates = [0.5, 0.25, 0.125, 0.0625]

    def second(rule: int, taken_at: int = 150) -> int:
        monkeypatch.setattr(tuning, "FIRST_GEN_REREAD", rule)
        memory = tuning.fresh_memory()
        PipelinedTuner(4, memory, lag=2)  # the first generation's tuner marks its memory
        assert memory["first_gen"]
        memory.update(cost={0: 1.62e-3, 2: 3.25e-3, 3: 2.61e-3, 4: 3.46e-3}, k=3, clock=300,
                      at={0: 290, 2: 150, 3: 299, 4: 200})  # what it measured
        tuner = PipelinedTuner(4, memory, lag=2)  # the second generation's
        assert "first_gen" not in memory and memory.get("first_end") == (300 if rule else None)
        memory["at"][2] = taken_at
        tuner.k, tuner.left, tuner.prev, tuner.since = 3, 0, 3, 50
        return tuner.next_k(rates, lambda: rates)

    assert second(1) == 2
    assert second(0) == 3
    assert second(1, taken_at=301) == 3  # (read again since: its reading rules)


def test_a_neighbour_read_in_a_slower_spell_is_read_again_when_the_host_speeds_up(monkeypatch):
    """Run V's 0.8B shape at oracle 0.8: K=3 read at 3.74 ms and K=4 at 4.10 in a slow spell, the tuner sat at K=4
    as its cost fell to 3.47 (a sixth) and never read K=3 again, where K=3 ran 2.6 ms per round. With REVISIT_DRIFT
    the tuner goes back to K=3 once K=4's cost falls by that share below its reading on arrival, and the re-read
    replaces K=3's window (its slow readings are not averaged in); a smaller fall, or the rule off, stays."""
    from lattice_mlx.speculative import tuning

    rates = [0.82, 0.72, 0.5, 0.35]
    costs = {0: 2.65e-3, 3: 3.74e-3, 4: 4.10e-3}

    def after_fall(fall: float) -> PipelinedTuner:
        memory = {"cost": dict(costs), "k": 4, "clock": 1_000, "at": {0: 10, 3: 200, 4: 990},
                  "window": {3: [3.74e-3] * 7, 4: [4.10e-3] * 7}, "arrival": {4: (4.10e-3, 300)}}
        tuner = PipelinedTuner(4, memory, lag=2)
        assert tuner.k == 4 and tuner.judged == 4  # (its arrival was marked in an earlier generation)
        tuner.left = 0
        for _ in range(tuner.SKIP + tuning.COST_WINDOW):  # K=4's passes now, on a faster host
            tuner.observe(4, 4.10e-3 * fall)
            if tuner.next_k(rates, lambda: rates) != 4:
                break
        return tuner

    monkeypatch.setattr(tuning, "REVISIT_DRIFT", 0.15)
    assert after_fall(0.90).k == 4  # a tenth: not yet
    tuner = after_fall(0.84)
    assert tuner.k == 3 and tuner.reread == 3 and "read again" in tuner.log[-1]
    for s in (2.6e-3,) * (tuner.SKIP + 1):
        tuner.observe(3, s)
    assert tuner.window[3] == [2.6e-3] and tuner.cost[3] == 2.6e-3 and tuner.reread is None
    monkeypatch.setattr(tuning, "REVISIT_DRIFT", 1.0)  # off
    assert after_fall(0.84).k == 4


def _replay_module():
    return load_script("bench/replay_tuner.py")


@pytest.mark.parametrize("case, floor, probe, drift", [
    ("demo 0.7", 0.9, 0, None), ("0.8B p=0.5", 0.9, 0, None), ("0.8B p=0", 0.96, 0, None), ("demo greedy", 0.92, 0, None),
    ("0.8B p=0", 0.97, 80, None), ("demo 0.7", 0.94, 15, (0.2, 0.99)), ("0.8B p=0.5", 0.94, 15, (0.3, 0.98))])
def test_tuner_replayed_on_run_e_costs_keeps_what_a_fixed_depth_gets(case, floor, probe, drift):
    """The tuner against run E's per-pass costs and acceptance (noisy passes, Bernoulli acceptance, the pipelined
    loop's two-pass lag, ten generations per process on one memory): the median generation keeps at least `floor` of
    the best fixed depth's speedup (of plain's at acceptance 0). The tuner that ran in run E kept 0.81 (the demo at
    0.7) and 0.85 (oracle 0.5) of it in this replay, as on the H200 (0.95x and 1.03x plain against 1.24x and 1.26x).
    `probe`: ms each switch from plain steps to rounds adds (run F's oracle 0 lost 46-106 ms per probing generation);
    run F's tuner, which halved the carried plain stretch per generation, replays at 0.94 of plain there, as
    measured. `drift`: a host speed drifting over the process (run G): a tuner that compared rounds with a plain cost
    read long before kept 0.91 and 0.84 of the best fixed depth here."""
    import statistics

    replay = _replay_module()
    cond, costs = replay.CASES[case]
    best = max(replay.fixed(cond, costs, k) for k in range(1, 5))
    # (20 processes: the median of 7 moved by 0.02 of the best fixed depth with the seeds)
    got = statistics.median(replay.replay(cond, costs, seeds=20, probe=probe, drift=drift or (0.0, 0.0)))
    assert got >= floor * max(best, 1.0), (got, best)


def test_a_fixed_depth_replayed_on_a_steady_host_gets_its_expected_speedup():
    """replay_tuner.py --realized runs each fixed depth through the default's simulated processes (`fixed_k`): on a
    host with no spells, drift or switch costs, a depth's median generation is its expected speedup (fixed()), within
    the per-pass noise's spread; and a slower second pass after each change of depth costs the fixed leg nothing
    after its first round, where it costs the default each switch."""
    import statistics

    replay = _replay_module()
    cond, costs = replay.CASES["demo 0.7 H100"]
    for k in (1, 3):
        got = statistics.median(replay.replay(cond, costs, seeds=10, fixed_k=k))
        assert abs(got / replay.fixed(cond, costs, k) - 1) < 0.04, (k, got)
    settled = statistics.median(replay.replay(cond, costs, seeds=10, fixed_k=3, settle=(2.0, 2.0)))
    assert settled < got and settled / got > 0.95  # (only the generation's first two passes pay it)


@pytest.mark.parametrize("case, floor", [("demo greedy", 0.85), ("demo 0.7", 0.85)])
def test_tuner_replayed_over_texts_that_draft_unequally_probes_each_text(case, floor):
    """A process's texts draft unequally: three in ten at 0.55 times the case's rates (the demo at temperature 0.7 on
    an H100 drafted at acceptance 0.41-0.95 over ten prompts, docs/adr/0008 'Runs K and L'). A stretch a poor text
    began is not the next text's verdict: each generation probes its own text first, and the median generation keeps
    `floor` of the best fixed depth (at the uniform rates). Carrying the stretch's rest before any probe kept 0.68
    (demo greedy) and 0.79 (demo at 0.7) in this replay."""
    import statistics

    replay = _replay_module()
    cond, costs = replay.CASES[case]
    best = max(replay.fixed(cond, costs, k) for k in range(1, 5))
    got = statistics.median(replay.replay(cond, costs, seeds=20, probe=18, vary=(0.3, 0.55)))
    assert got >= floor * best, (got, best)


def test_tuner_reads_a_stale_plain_cost_again_before_going_off():
    """Speculation goes off on a plain cost read STALE_PASSES passes or more ago only after CHECK_PASSES plain steps
    read it again: a host that slowed down since made every round look dear against the old plain cost (run G).
    Where the fresh plain cost shows the rounds paying, the tuner speculates on; where it confirms the loss, it goes
    off without another check."""
    from lattice_mlx.speculative.tuning import CHECK_PASSES, STALE_PASSES

    rates = [0.8, 0.64, 0.5, 0.4]
    memory: dict = {}
    tuner = _Costs(4, memory)
    tuner.run({0: 1.0, 1: 1.4, 2: 1.7, 3: 2.0, 4: 2.3}, rates, STALE_PASSES + 40)  # baseline, then rounds that pay
    assert not tuner.decisions and tuner.k > 0 and tuner.stale(0)
    slow = {0: 1.6, 1: 2.2, 2: 2.7, 3: 3.2, 4: 3.7}  # the host 1.6x slower: rounds lose against the old plain cost
    ks = tuner.run(slow, rates, 60)
    first = ks.index(0)
    assert ks[first : first + CHECK_PASSES] == [0] * CHECK_PASSES and any(ks[first + CHECK_PASSES :])
    assert not tuner.decisions and "plain's cost is stale" in " ".join(tuner.log)
    assert tuner.cost[0] == pytest.approx(1.6)  # read afresh, not averaged with the old 1.0
    # a real loss: a check (if plain's cost went stale again meanwhile) confirms it, and speculation goes off
    checks = sum("stale" in line for line in tuner.log)
    tuner.run({0: 1.6, 1: 3.0, 2: 4.0, 3: 5.0, 4: 6.0}, [0.1, 0.01, 0.0, 0.0], 80)
    assert tuner.decisions and sum("stale" in line for line in tuner.log) - checks == 1


def test_a_depths_first_traced_passes_are_not_its_cost():
    """The first passes at a depth with no trace in the process (its round built op by op, the trace compiled, the
    first replays: up to three times the later passes on the H100) are not timed: the demo at temperature 0.7 read its
    K=3 rounds from them, went off as hopeless at its first decision and never speculated again in that process
    (docs/adr/0008, 'Run H'). Here a depth's first six passes cost three times the rest."""
    from lattice_mlx.speculative.tuning import FIRST_TRACE_SKIP

    costs, seen = {0: 0.85, 1: 1.4, 2: 1.8, 3: 2.1, 4: 2.5}, {}
    # (a depth's trace compiles at its second round; plain steps have theirs)
    tuner = PipelinedTuner(4, {}, lambda k: k == 0 or seen.get(k, 0) >= 2)
    rates = [0.85, 0.7, 0.56, 0.44]
    ks, timed = [], []
    for _ in range(300):
        k = tuner.next_k(rates, lambda: rates)
        seen[k] = seen.get(k, 0) + 1
        seconds, before = costs[k] * (3.0 if k and seen[k] <= FIRST_TRACE_SKIP else 1.0), tuner.at.get(k)
        tuner.observe(k, seconds)
        if tuner.at.get(k) != before:  # (a timed pass: its depth's clock moved)
            timed.append((k, seconds))
        ks.append(k)
    assert not tuner.decisions and ks[-100:].count(0) == 0 and tuner.cost[3] == pytest.approx(2.1)
    assert all(seconds == costs[k] for k, seconds in timed) and sum(k == 0 for k, _ in timed) == 8


def test_one_slow_spell_of_rounds_is_not_hopeless_for_good():
    """A first hopeless verdict takes the ordinary plain stretch; only the probe after it, finding speculation hopeless
    again on costs read afresh, takes the longest one. The demo's second greedy generation read its K=3 rounds at
    twice their cost for a few passes, went off for the longest stretch on them and decoded four whole generations
    plainly where a fixed K=3 ran at 1.8x plain (docs/adr/0008, 'Run I'). Rounds that stay dear (the CPU) still get
    the longest stretch, after one probe."""
    from lattice_mlx.speculative.tuning import PIPELINED_FIRST_OFF

    rates, costs = [0.95, 0.9, 0.85, 0.8], {0: 0.68, 1: 0.9, 2: 1.1, 3: 1.36, 4: 1.6}
    memory: dict = {}
    traced = lambda k: k <= 3  # noqa: E731  (K=4 has no trace: the tuner stays at K=3, as the demo's did)
    _Costs(4, memory, traced, lag=2).run(costs, rates, 256)  # a first generation at K=3
    assert sorted(memory["cost"]) == [0, 3] and memory["k"] == 3 and not memory.get("stretch")
    tuner, ks = _Costs(4, memory, traced, lag=2), []
    for n in range(256):  # the next generation's first rounds at twice their cost (not stalls: under SPIKE)
        k = tuner.next_k(rates, lambda: rates)
        tuner.observe(k, costs[k] * (2.0 if k and n < 12 else 1.0))
        ks.append(k)
    assert len(tuner.decisions) == 1 and f"off for {PIPELINED_FIRST_OFF} tokens" in tuner.decisions[0]
    assert "every draft kept" in tuner.decisions[0]  # (hopeless on the slow spell's costs)
    assert ks.count(0) == PIPELINED_FIRST_OFF and ks[-100:].count(0) == 0 and not memory["stretch"]
    # the same within one generation whose schedule an earlier poor stretch of text had grown: once speculation paid
    # again, a slow spell's first hopeless verdict takes the schedule's first stretch, not the grown one
    one = _Costs(4, {}, traced, lag=2)
    one.run(costs, [0.0], 900)  # drafts never right: ordinary stretches, growing
    assert one.off_tokens == MAX_OFF_TOKENS and one.decisions
    one.run(costs, rates, 1400)  # then drafts pay
    assert not one.memory["stretch"] and one.k > 0
    seen, ks = len(one.decisions), []
    for n in range(400):
        k = one.next_k(rates, lambda: rates)
        one.observe(k, costs[k] * (2.0 if k and n < 40 else 1.0))
        ks.append(k)
    assert one.decisions[seen:] and all(f"off for {PIPELINED_FIRST_OFF} tokens" in d for d in one.decisions[seen:])
    assert ks[-100:].count(0) == 0
    # rounds dear for good (K + 1 plain steps each): the probe after the ordinary stretch confirms, then the longest
    linear, memory = {k: 1.0 * (k + 1) for k in range(5)}, {}
    dear = _Costs(4, memory, lag=2)
    ks = dear.run(linear, rates, 200)
    assert [d.split(" tokens")[0].split()[-1] for d in dear.decisions] == [str(PIPELINED_FIRST_OFF),
                                                                          str(MAX_OFF_TOKENS)]
    assert all("every draft kept" in d for d in dear.decisions) and memory["stretch"] == MAX_OFF_TOKENS
    assert 200 - ks.count(0) < 40  # (two probes of a few rounds each)


def test_a_hopeless_stretch_is_carried_from_generation_to_generation():
    """Plain steps taken because no depth could pay are counted in the process's tokens like any other stretch: the
    next generation gets its rest, then a probe. Restarting the whole stretch in every generation never probed again
    in generations shorter than it (run H), so a process that once read its rounds wrong decoded plainly for good."""
    memory: dict = {}
    _Costs(4, memory).run({k: 1.0 * (k + 1) for k in range(5)}, [0.95, 0.9, 0.85, 0.8], 150)  # hopeless, confirmed
    assert memory["hopeless"] and 0 < memory["off"] < MAX_OFF_TOKENS
    rest, ks = memory["off"], []
    cheap = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}
    for _ in range(16):  # generations of 256 passes where rounds are cheap now
        ks += _Costs(4, memory).run(cheap, [0.95, 0.9, 0.85, 0.8], 256)
    assert ks[:rest] == [0] * rest and ks[rest] > 0  # the stretch's rest, then a probe
    assert ks[-256:].count(0) == 0


def test_one_hopeless_verdict_does_not_skip_the_next_texts_probe():
    """A stretch's rest goes to the next generation without a probe of its text only after two hopeless verdicts in
    a row (MLX's CPU backend, where no depth can pay, gives them every time). One verdict can be a slow spell's: on
    the GPU's costs the demo at temperature 0.7 read a depth at twice its cost in one, found no depth able to pay,
    and held its next three texts in plain steps, two of them good ones (replay_tuner.py --vary 0.3,0.5; docs/adr/
    0008, 'Run Y')."""
    cheap, good = {0: 1.0, 1: 1.3, 2: 1.5, 3: 1.7}, [0.95, 0.9, 0.85]
    memory = _carried(hopeless=True, confirmed=False)
    tuner = _Costs(3, memory, lag=2)
    assert tuner.resume == 50 and tuner.log[-1].startswith("a probe of this text first")
    assert tuner.run(cheap, good, 40)[0] == 3 and memory["off"] is False  # the text drafts well: speculation on
    # the text's probe finds no depth able to pay either: the verdict is confirmed, and the next text goes on with
    # that stretch's rest first
    linear = {k: 1.0 * (k + 1) for k in range(4)}
    memory = _carried(hopeless=True, confirmed=False, costs=linear)
    tuner = _Costs(3, memory, lag=2)
    tuner.run(linear, good, 40)
    assert "every draft kept" in tuner.decisions[0] and memory["hopeless"] and memory["confirmed"]
    nxt = _Costs(3, memory, lag=2)
    assert nxt.resume == 0 and nxt.k == 0 and nxt.log[-1].startswith("plain steps for")
    # a verdict after speculation paid is a first one again, whatever came before
    memory = _carried(hopeless=True, confirmed=False)
    tuner = _Costs(3, memory, lag=2)
    tuner.run(cheap, good, 40)
    assert memory["hopeless"] is False and memory["off"] is False
    tuner.run(linear, good, 60)
    assert "every draft kept" in tuner.decisions[-1] and memory["hopeless"] and not memory["confirmed"]


def test_a_hopeless_stretch_found_hopeless_again_grows():
    """Where no depth can pay (rounds cost K + 1 plain steps: MLX's CPU backend), each probe after a hopeless stretch
    that finds it hopeless again makes the next stretch PIPELINED_OFF_GROWTH times longer, up to HOPELESS_MAX_OFF:
    a probe per MAX_OFF_TOKENS cost long generations on the CPU more than plain decoding. A probe that pays ends it."""
    from lattice_mlx.speculative.tuning import HOPELESS_MAX_OFF, PIPELINED_FIRST_OFF, PIPELINED_OFF_GROWTH

    memory: dict = {}
    tuner = _Costs(4, memory, lag=2)  # (the pipelined loop's lag: a round's acceptance is read two passes on)
    passes = 2 * HOPELESS_MAX_OFF
    ks = tuner.run({k: 1.0 * (k + 1) for k in range(5)}, [0.95, 0.9, 0.85, 0.8], passes)
    lengths = [int(d.split(" tokens")[0].split()[-1]) for d in tuner.decisions]
    grown = [PIPELINED_FIRST_OFF] + [MAX_OFF_TOKENS * PIPELINED_OFF_GROWTH ** i for i in range(3)]
    assert lengths[:4] == grown and set(lengths[4:]) == {HOPELESS_MAX_OFF} and grown[-1] == HOPELESS_MAX_OFF
    assert passes - ks.count(0) < 100  # (the baseline's plain steps count as plain; every probe is a few rounds)
    cheap = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}
    ks = _Costs(4, memory, lag=2).run(cheap, [0.95, 0.9, 0.85, 0.8], memory["off"] + 200)
    assert ks[-100:].count(0) == 0 and memory["stretch"] is False  # (a probe that pays ends the growth)
    # a stretch taken for another reason restarts the growth: the next hopeless verdict takes the ordinary schedule's
    # stretch, the one confirming it grows from there. Here the next generation probes its text first, on the cheap
    # costs remembered for K=1 (its window), which pay for its first decision: the schedule restarts there
    # (PIPELINED_FIRST_OFF), the next probe confirms (MAX_OFF_TOKENS), and the stretches grow from it
    poor = _Costs(4, memory, lag=2)
    poor.run(cheap, [0.0], 400)
    assert poor.decisions and "every draft kept" not in poor.decisions[0] and memory["hopeless"] is False
    again = _Costs(4, memory, lag=2)
    again.run({k: 1.0 * (k + 1) for k in range(5)}, [0.95, 0.9, 0.85, 0.8], memory["off"] + 1600)
    assert again.log[1].startswith("a probe of this text first")
    assert [int(d.split(" tokens")[0].split()[-1]) for d in again.decisions][:3] == [
        PIPELINED_FIRST_OFF, MAX_OFF_TOKENS, PIPELINED_OFF_GROWTH * MAX_OFF_TOKENS]
    assert all("every draft kept" in d for d in again.decisions)


def test_a_process_second_generation_starts_from_the_first_ones_costs():
    """A process's tuner memory (tuner_memory: fresh_memory) keeps its first generation's readings: the second starts
    at the depth the first picked last, from its costs, with no plain baseline. Second generations that started
    afresh instead ran at 0.79 of the best of plain and the fixed depths on average in run P, against 0.91-0.94 in
    runs N, O and Q (docs/adr/0008, 'Runs P, Q and R')."""
    from lattice_mlx.runtime import runtime_of
    from lattice_mlx.speculative.tuning import fresh_memory, tuner_memory

    rates = [0.85, 0.7, 0.6, 0.5]
    costs = {0: 0.9, 1: 1.3, 2: 1.6, 3: 1.9, 4: 2.2}  # the demo's sampled rounds (ms): K=3 or K=4 pays
    model = types.SimpleNamespace()
    memory = tuner_memory(model, False)
    assert memory == fresh_memory() and tuner_memory(model, False) is memory
    assert runtime_of(model).tuner[False] is memory and tuner_memory(model, True) is not memory
    first = _Costs(4, memory, lag=2)
    assert first.run(costs, rates, 256)[0] == 0  # the process's first generation: the plain baseline first
    second = _Costs(4, memory, lag=2)
    assert second.log[0].startswith(f"start at K={memory['k']} from the costs measured before")
    assert second.run(costs, rates, 64).count(0) == 0


def test_a_processs_first_rounds_wait_until_plain_decoding_has_forgone_what_they_cost():
    """tuning.FIRST_ROUNDS_S (a ski rental): where the process has run no round yet, a generation too short to repay
    the first rounds' cost (the demo: ~0.2 s of kernel loads and traces against ~1 ms plain steps) stays in plain
    steps, counted as forgone; the first generation whose rest together with what was forgone covers the cost
    speculates, and from then on nothing is held back. Told no budget, or with the rounds paid, it speculates at
    once; a larger model's steps repay it in its first generation."""
    from lattice_mlx.speculative import tuning

    rates = [0.9, 0.8, 0.7, 0.6]
    costs = {0: 1e-3, 1: 1.2e-3, 2: 1.35e-3, 3: 1.5e-3, 4: 1.65e-3}  # seconds: every depth pays
    baseline = tuning.PLAIN_WARMUP_STEPS + tuning.PLAIN_TIMED_STEPS
    gain = (255 - baseline) * 1e-3 * (1 - 1 / tuning.FIRST_ROUNDS_PRIOR)  # what a generation's rest could gain
    assert gain < tuning.FIRST_ROUNDS_S < 3 * gain  # (the constants this test's schedule rests on)
    memory: dict = {}
    runs = []
    for _ in range(3):  # three 256-token generations (255 after the prefill's token) in one process
        tuner = _Costs(4, memory, lag=2, budget=255, first_rounds=True)
        runs.append(tuner.run(costs, rates, 255))
    need = int(tuning.FIRST_ROUNDS_S // gain)  # generations held in plain steps before one speculates
    assert all(ks == [0] * 255 for ks in runs[:need]) and runs[need].count(0) < 40
    assert memory["forgone"] == pytest.approx(need * gain)
    held = _Costs(4, {}, lag=2, budget=255, first_rounds=True)
    held.run(costs, rates, 255)
    assert len(held.decisions) == 1 and "would not pay yet" in held.decisions[0]
    # not told the budget, or the rounds already paid in this process: rounds from the baseline's end
    for kw in ({"budget": None, "first_rounds": True}, {"budget": 255, "first_rounds": False}):
        ks = _Costs(4, {}, lag=2, **kw).run(costs, rates, 255)
        assert ks[baseline:].count(0) < 30, kw
    # a model whose plain step costs 3 ms: its first generation repays the rounds
    dear = {k: 3 * c for k, c in costs.items()}
    assert _Costs(4, {}, lag=2, budget=255, first_rounds=True).run(dear, rates, 255)[baseline:].count(0) < 30
    # held to its end, past its budget too: a round dispatched there (the loop runs a pass ahead of the tokens read)
    # would pay the first uses for nothing
    assert _Costs(4, {}, lag=2, budget=100, first_rounds=True).run(costs, rates, 200) == [0] * 200
    # a held generation that stops early (an end-of-sequence token) forwent only the passes it ran
    memory = {}
    _Costs(4, memory, lag=2, budget=255, first_rounds=True).run(costs, rates, baseline + 40)
    assert memory["forgone"] == pytest.approx(40 * 1e-3 * (1 - 1 / tuning.FIRST_ROUNDS_PRIOR))
    # decided once per generation: the generation that pays for its first rounds, where drafts then fail and plain
    # stretches follow, is not held at a stretch's end
    tuner = _Costs(4, {}, lag=2, budget=1500, first_rounds=True)  # (its whole rest repays them; a later rest not)
    ks = tuner.run(costs, [0.0], 1500)
    assert ks.count(0) > 1000 and max(ks) > 0 and not any("would not pay" in d for d in tuner.decisions)
    assert tuner.decisions and ks[-200:].count(0) < 200  # (off stretches, and a probe after the last one)


def test_a_sampled_generation_weighs_its_first_rounds_at_the_sampled_price_and_prior():
    """tuning.FIRST_ROUNDS_SAMPLED_S / _PRIOR: a sampled generation's first rounds cost more and its rounds gain less
    (the demo at 0.7, docs/adr/0008 'Run AF'), so at the same plain cost a process holds its sampled generations in
    plain steps for more generations than its greedy ones, each by its own price and prior."""
    from lattice_mlx.speculative import tuning

    rates = [0.9, 0.8, 0.7, 0.6]
    costs = {0: 1e-3, 1: 1.2e-3, 2: 1.35e-3, 3: 1.5e-3, 4: 1.65e-3}
    rest = 255 - tuning.PLAIN_WARMUP_STEPS - tuning.PLAIN_TIMED_STEPS
    need = {greedy: int(price // (rest * 1e-3 * (1 - 1 / prior))) for greedy, price, prior in (
        (True, tuning.FIRST_ROUNDS_S, tuning.FIRST_ROUNDS_PRIOR),
        (False, tuning.FIRST_ROUNDS_SAMPLED_S, tuning.FIRST_ROUNDS_SAMPLED_PRIOR))}
    assert need[False] > need[True] + 1 and need[False] < 12  # (the constants this test rests on)
    for greedy in (True, False):
        memory: dict = {}
        runs = [_Costs(4, memory, lag=2, budget=255, first_rounds=True, greedy=greedy).run(costs, rates, 255)
                for _ in range(need[greedy] + 1)]
        assert all(ks == [0] * 255 for ks in runs[:-1]) and runs[-1].count(0) < 40, greedy
    held = _Costs(4, {}, lag=2, budget=255, first_rounds=True, greedy=False)
    held.run(costs, rates, 255)
    assert f"~{1e3 * tuning.FIRST_ROUNDS_SAMPLED_S:.0f} ms" in held.decisions[0]


def test_a_probe_at_acceptance_zero_ends_soon_where_plain_read_dear():
    """Run O's 0.8B shape with the random head, its third generation: plain's cost carried from a slow spell (2.26 ms,
    1.65 afresh) put K=2 (2.33) and K=3 (2.51) near break-even at acceptance 0, and hope for more accepted rounds
    held the probe until a stale-plain check, then a second probe ran: 60 rounds. Hope holds only at the depth the
    tuner keeps (or shallower ones) and for HOPE_ROUNDS rounds read, and the check's fresh reading decides at once."""
    from lattice_mlx.speculative.tuning import CHECK_PASSES

    old = {0: 2.26, 1: 3.01, 2: 2.66, 3: 2.51}
    memory = _carried(costs=old, k=2, stretch=256, off=800)
    costs = {0: 1.65, 1: 2.1, 2: 2.33, 3: 2.5, 4: 2.8}
    ks = _generation(memory, costs, lambda k: 0)
    rounds = ks.index(0)
    assert rounds <= 36, ks[:80]
    stale = ks[rounds : rounds + CHECK_PASSES] == [0] * CHECK_PASSES and ks[rounds + CHECK_PASSES] > 0
    assert not stale and all(k == 0 for k in ks[rounds:]), ks[:80]  # no second probe after a check
    # where a round costs a plain step and 3% (the readings of another spell of the host), hope at the current depth
    # fades: HOPE_ROUNDS rounds read at acceptance 0 and a rate that would pay at that cost is not hoped for
    near = {0: 2.26, 1: 2.3, 2: 2.33, 3: 2.6, 4: 2.9}
    ks = _generation(_carried(costs=near, k=2, stretch=256, off=800), near, lambda k: 0)
    assert ks.index(0) <= 36 and not any(ks[ks.index(0):]), ks[:80]
    # hope at a depth beside the current one, which it would not go to, holds nothing: K=3 at a plain step's cost
    # predicts 1.0 at acceptance 0 and more with any hope; the tuner at K=2 (dear) goes off after its confirmations
    tuner = PipelinedTuner(4, {"cost": {0: 2.0, 1: 2.4, 2: 2.6, 3: 2.0}, "at": {d: 0 for d in range(4)}, "clock": 1,
                               "k": 2})
    tuner.left, tuner.dispatched = 0, MIN_OFF_ROUNDS
    ks = [tuner.next_k([0.0, 0.0], lambda: [0.1, 0.01]) for _ in range(OFF_CONFIRM)]
    assert ks[-1] == 0 and tuner.decisions, (ks, tuner.log)


def test_a_depth_left_early_is_tried_again_when_the_first_draft_keeps_passing():
    """Run Q's demo at 0.7 over 1,024 tokens: K=2's second draft read at 0.35 in the generation's first rounds, the
    tuner went to K=1, and 460-500 rounds later, its first draft passing at 0.92-0.94, it was still there (the stale
    rate predicted K=2 below K=1) where K=3 ran at 1.5-1.7x plain. A position no round drafted in the last
    FRESH_POSITION_ROUNDS is continued as one never read: the tuner goes back to K=2."""
    from lattice_mlx.speculative.tuning import FRESH_POSITION_ROUNDS, tuner_rates

    costs = {0: 0.65, 1: 1.08, 2: 1.38, 3: 1.55}  # run Q's readings (ms)
    stats = SpecStats(draft_tokens=3)
    for i in range(30):
        stats.record(2, 2 if i % 3 == 0 else 1)  # the start: the second draft at 1 in 3
    for _ in range(FRESH_POSITION_ROUNDS + 10):
        stats.record(1, 1)
    memory = {"cost": dict(costs), "window": {k: [c] for k, c in costs.items()}, "at": {k: 0 for k in costs},
              "clock": 1, "k": 1}
    tuner = PipelinedTuner(3, memory)
    tuner.left, tuner.dispatched = 0, 200
    assert tuner.next_k(tuner_rates(stats), lambda: tuner_rates(stats, OFF_HOPE)) == 2, tuner.log


@pytest.mark.parametrize("rule", [True, False])
def test_a_deeper_depth_waits_for_the_generations_rates_at_every_drafted_position(monkeypatch, rule):
    """Run Z's 0.8B shape at oracle 0.5: a generation started at K=3 from the process's costs, its first rounds
    accepted their first drafts, and with only that position in the rates (the deeper ones read in too few rounds)
    their continuation predicted every draft kept: K 3 -> 4 at a predicted 3.32x. The tuner now moves deeper only on
    rates read at every position the current depth drafts, or after DEEPER_MIN_ROUNDS rounds; shallower moves and
    staying are as before, and rates read at every position still take it deeper where that pays."""
    from lattice_mlx.speculative import tuning
    from lattice_mlx.speculative.tuning import DEEPER_MIN_ROUNDS, MIN_POSITION_ROUNDS, tuner_rates

    if not rule:
        monkeypatch.setattr(tuning, "DEEPER_MIN_ROUNDS", 0)
    costs = {0: 2.16, 1: 2.31, 2: 2.9, 3: 2.95, 4: 3.25}  # run Z's readings at oracle 0.5 (ms; K=4 on the line)

    def tuner_after(record: list[tuple[int, int]], dispatched: int, costs: dict = costs) -> tuple[PipelinedTuner,
                                                                                                   SpecStats]:
        stats = SpecStats(draft_tokens=4)
        for k, n in record:
            stats.record(k, n)
        memory = {"cost": dict(costs), "window": {k: [c] for k, c in costs.items()}, "at": {k: 0 for k in costs},
                  "clock": 1, "k": 3}
        tuner = PipelinedTuner(4, memory)
        tuner.left, tuner.dispatched = 0, dispatched
        return tuner, stats

    # three rounds read, each keeping its first draft (the second and third not read in MIN_POSITION_ROUNDS rounds)
    tuner, stats = tuner_after([(3, 1)] * 3, 3)
    assert len(tuner_rates(stats)) == 1
    k = tuner.next_k(tuner_rates(stats), lambda: tuner_rates(stats, OFF_HOPE))
    assert k == (3 if rule else 4), tuner.log
    # a shallower move on the same few rounds, rule or not: one first draft in three kept, and K=2 read cheap
    tuner, stats = tuner_after([(3, 0), (3, 1), (3, 0)], 3, {**costs, 2: 2.4})
    assert tuner.next_k(tuner_rates(stats), lambda: tuner_rates(stats, OFF_HOPE)) == 2, tuner.log
    # every drafted position read in enough rounds, all kept: deeper pays, and the tuner goes there
    tuner, stats = tuner_after([(3, 3)] * MIN_POSITION_ROUNDS, MIN_POSITION_ROUNDS)
    assert len(tuner_rates(stats)) == 3
    assert tuner.next_k(tuner_rates(stats), lambda: tuner_rates(stats, OFF_HOPE)) == 4, tuner.log
    # past DEEPER_MIN_ROUNDS rounds the first position's rate alone may take it deeper (rounds of one draft that
    # all passed, the deeper positions never drafted)
    tuner, stats = tuner_after([(1, 1)] * DEEPER_MIN_ROUNDS, DEEPER_MIN_ROUNDS)
    assert len(tuner_rates(stats)) == 1
    assert tuner.next_k(tuner_rates(stats), lambda: tuner_rates(stats, OFF_HOPE)) == 4, tuner.log
