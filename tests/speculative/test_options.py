"""Speculation options are validated once, for the API and the CLI alike; statistics add up and derive their rates."""

import pytest

from lattice_mlx.speculative import SpecOptions, SpecStats, parse_tree
from lattice_mlx.speculative.tuning import expected_tokens


@pytest.mark.parametrize("kwargs, message", [
    (dict(draft="bogus"), "unknown draft source"),
    (dict(draft_tokens=0), "draft_tokens"),
    (dict(draft_tokens=9), "draft_tokens"),
    (dict(draft_tokens=2.5), "draft_tokens"),
    (dict(verify="tree"), "unknown verifier"),
    (dict(tree="2-0"), "bad tree shape"),
    (dict(tree="2-1", draft="ngram"), "MTP head"),
])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecOptions(**kwargs)


def test_options_are_frozen_and_name_what_they_need():
    options = SpecOptions()
    assert (options.draft, options.draft_tokens, options.verify, options.adaptive, options.tree) == \
        ("mtp", 4, "auto", True, None)
    assert SpecOptions(adaptive=False).draft_tokens == 3 and SpecOptions(draft_tokens=2).draft_tokens == 2
    with pytest.raises(AttributeError):
        options.draft_tokens = 3
    assert options.needs_mtp and SpecOptions(draft="mtp+ngram").needs_mtp
    assert not SpecOptions(draft="self:first:2").needs_mtp and not SpecOptions(draft="ngram").needs_mtp
    assert parse_tree("2-2-1") == (2, 2, 1)


def test_auto_verifier_is_pipelined_for_mtp_chains_only():
    assert SpecOptions().resolved().verify == "pipelined"
    assert SpecOptions(verify="batched").resolved().verify == "batched"  # an explicit choice stays
    for options, kw in [(SpecOptions(draft="ngram"), {}), (SpecOptions(draft="mtp+ngram"), {}),
                        (SpecOptions(draft="self:first:2"), {}), (SpecOptions(tree="2-1"), {}),
                        (SpecOptions(), dict(split=True)), (SpecOptions(), dict(host_drafter=True))]:
        assert options.resolved(**kw).verify == "batched", (options, kw)


def test_stats_record_sum_and_rates():
    a = SpecStats.of(SpecOptions(draft_tokens=3))
    a.record(3, 3)
    a.record(3, 1)
    a.draft_time_s = 0.5
    b = SpecStats.of(SpecOptions(draft_tokens=3))
    b.record(2, 0)  # an adaptive round with K=2
    b.decisions.append("x")
    a.tuner_log.append("K 2 -> 3")
    b.tuner_log.append("slow pass")
    s = (a + b).to_dict()
    assert s["tuner_log"] == ["K 2 -> 3", "slow pass"]
    assert s["rounds"] == 3 and s["proposed_at"] == [3, 3, 2] and s["accepted_at"] == [2, 1, 1]
    assert s["accepted_hist"] == [1, 1, 0, 1] and s["decisions"] == ["x"] and s["draft_time_s"] == 0.5
    assert s["acceptance_rate"] == pytest.approx(4 / 8)
    assert s["accepted_per_position"] == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    assert s["mean_accepted_length"] == pytest.approx(4 / 3)
    assert a.to_dict()["rounds"] == 2  # + makes a new object


def test_rates_for_the_tuner_need_rounds_at_a_position_and_can_hope():
    """min_rounds: the first position always, deeper ones only once that many rounds drafted them (the rest is
    expected_tokens' extrapolation); hope adds accepted rounds at every position."""
    s = SpecStats.of(SpecOptions(draft_tokens=3))
    for n in [2, 2, 1, 2, 0, 2, 2, 1, 2, 2]:
        s.record(2, n)
    s.record(3, 2)  # one round at K=3, its third draft rejected
    assert s.accepted_per_position() == pytest.approx([10 / 11, 8 / 11, 0.0])
    assert s.accepted_per_position(8) == pytest.approx([10 / 11, 8 / 11])
    assert s.accepted_per_position(12) == pytest.approx([10 / 11])  # the first position even under min_rounds
    assert s.accepted_per_position(8, 2.0) == pytest.approx([12 / 13, 10 / 13])
    assert SpecStats.of(SpecOptions()).accepted_per_position(8) == []
    assert expected_tokens(3, s.accepted_per_position(8)) > expected_tokens(3, s.accepted_per_position()) + 0.4


def test_rates_for_the_tuner_leave_out_a_position_not_drafted_lately():
    """accepted_per_position(fresh=n): a position after the first is read only while one of the last n rounds
    drafted it (the tuner continues it as one never read); `+` keeps each position's last round in the sum's count;
    to_dict leaves the bookkeeping out."""
    s = SpecStats(draft_tokens=2)
    for i in range(20):  # a start at K=2: the second draft mostly rejected
        s.record(2, 2 if i < 4 else 1)
    for _ in range(40):  # then K=1, every draft kept
        s.record(1, 1)
    assert s.last_drafted == [60, 20]
    assert s.accepted_per_position(8) == pytest.approx([1.0, 4 / 20])
    assert s.accepted_per_position(8, fresh=41) == pytest.approx([1.0, 4 / 20])
    assert s.accepted_per_position(8, fresh=40) == pytest.approx([1.0])
    assert (s + s).last_drafted == [120, 80] and (SpecStats() + s).last_drafted == [60, 20]
    assert "last_drafted" not in s.to_dict()


def test_tree_stats_keep_child_ranks_per_depth():
    t = SpecStats.of(SpecOptions(tree="3-2"))
    assert t.draft_tokens == 2 and t.tree == "3-2"
    t.record(2, 2, [2, 1])
    t.record(2, 1, [0])
    assert t.branch_hist == [[1, 0, 1], [0, 1]]
    assert (t + t).branch_hist == [[2, 0, 2], [0, 2]]
    fresh = SpecStats.of(SpecOptions(tree="3-2"))
    fresh.record(2, 0)
    d = fresh.to_dict()
    assert d["branch_hist"] == [[0, 0, 0], [0, 0]] and d["tree_nodes"] == 3 + 6 and d["verify"] == "tree"
