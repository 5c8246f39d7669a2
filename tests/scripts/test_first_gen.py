"""scripts/bench/first_gen.py's pairing: each repetition's plain process against its other legs, first and second
generations and whole processes apart, and whether greedy tokens matched."""

from conftest import load_script


def _run(leg: str, rep: int, first: float, second: float, process: float, tokens: list[int]) -> dict:
    return {"leg": leg, "rep": rep, "process_s": process,
            "generations": [{"wall_s": first, "token_ids": tokens}, {"wall_s": second, "token_ids": tokens}]}


def test_ratios_are_plains_time_over_the_legs_per_repetition_then_the_median():
    fg = load_script("bench/first_gen.py")
    runs = [_run("plain", 0, 1.0, 1.0, 4.0, [1, 2]), _run("default", 0, 2.0, 0.5, 5.0, [1, 2]),
            _run("plain-aa", 0, 1.0, 1.0, 4.0, [1, 2]),
            _run("plain", 1, 3.0, 1.0, 6.0, [3]), _run("default", 1, 1.0, 0.25, 3.0, [4]),
            _run("plain-aa", 1, 2.0, 2.0, 3.0, [3]),
            _run("default", 2, 1.0, 1.0, 1.0, [5])]  # no plain process in repetition 2: not paired
    s = fg.summarize(runs, list(fg.LEGS))
    d = s["default"]
    assert d["first_gen"] == {"median": 1.75, "min": 0.5, "max": 3.0, "n": 2}
    assert d["second_gen"] == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 2}
    assert d["process"] == {"median": 1.4, "min": 0.8, "max": 2.0, "n": 2}
    assert d["all_gens"] == {"median": 2.0, "min": 0.8, "max": 3.2, "n": 2}  # (2 / 2.5 and 4 / 1.25)
    assert d["last_gen"] == d["second_gen"]  # (two generations per process: the last is the second)
    assert d["identical_tokens"] == 1
    assert s["plain-aa"]["first_gen"]["median"] == 1.25 and s["plain-aa"]["identical_tokens"] == 2
    assert "plain" not in s
