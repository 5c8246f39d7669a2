"""Benchmark statistics: slope rates, spread (CV), ABBA leg order, acceptance estimates, and the speculative speedup
model of docs (E = (1 - a^(K+1)) / (1 - a); speedup = E / (v(K+1) + K c + r)) with its break-even acceptance."""

import statistics
from collections.abc import Sequence

CV_LIMIT = 0.20


def slope_rate(n1: int, t1: float, n2: int, t2: float) -> float:
    """Tokens per second between two generation lengths: prefill and warm-up cancel in the difference."""
    assert n2 > n1, "the second length must be the longer one"
    return (n2 - n1) / (t2 - t1) if t2 > t1 else float("inf")


def summarize(values: Sequence[float]) -> dict:
    """min / median / max / mean and the coefficient of variation (population std / mean); flagged above CV_LIMIT."""
    if not values:
        return {"n": 0}
    mean = statistics.fmean(values)
    cv = statistics.pstdev(values) / mean if len(values) > 1 and mean > 0 else 0.0
    return {
        "n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values), "mean": mean,
        "cv": cv, "cv_flag": cv > CV_LIMIT,
    }


def abba_order(legs: Sequence, rep: int) -> list:
    """Leg order of repetition `rep`: forward on even, reversed on odd (A B C, C B A, A B C, ...), so over every pair
    of repetitions each leg sits at the same mean position and slow drift cancels."""
    return list(legs) if rep % 2 == 0 else list(reversed(legs))


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> dict:
    """Ratios of two legs measured in the same repetitions (same prompt, adjacent in time), summarized."""
    return summarize([a / b for a, b in zip(num, den) if b > 0])


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per round with K drafts and per-position acceptance alpha (accepted prefix plus the free token)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def model_speedup(alpha: float, k: int, costs: dict) -> float:
    """Predicted speedup over plain decode. costs, in plain decode steps: c (one draft), r (rollback per round) and
    either v (one batched verify of K+1 tokens) or v1 (one sequential verify step, run once per emitted token)."""
    e = expected_tokens(alpha, k)
    verify = e * costs["v1"] if "v1" in costs else costs["v"]
    return e / (verify + k * costs["c"] + costs.get("r", 0.0))


def break_even(k: int, costs: dict, *, tol: float = 1e-4) -> float | None:
    """Smallest per-position acceptance at which MTP matches plain decode; None when even alpha = 1 loses."""
    if model_speedup(0.0, k, costs) >= 1.0:
        return 0.0
    if model_speedup(1.0, k, costs) < 1.0:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if model_speedup(mid, k, costs) < 1.0 else (lo, mid)
    return hi


def acceptance_estimates(accepted_at: Sequence[int], rounds: int, k: int) -> dict:
    """For fixed K: the conditional acceptance at each draft position (accepted at i given all before accepted) and
    the pooled per-position alpha = successes / trials, the maximum-likelihood estimate under the speedup model."""
    reached = [rounds, *accepted_at[: k - 1]]
    conditional = [a / r if r else 0.0 for a, r in zip(accepted_at, reached)]
    trials = sum(reached)
    return {"alpha": sum(accepted_at) / trials if trials else 0.0, "conditional_per_position": conditional,
            "trials": trials}


def measured_costs(stats: dict, step_s: float) -> dict:
    """Draft / verify / rollback costs per round in plain decode steps, from summed SpecStats of one fixed-K leg."""
    rounds, k = stats["rounds"], stats["draft_tokens"]
    if not rounds or step_s <= 0 or stats["draft_time_s"] + stats["verify_time_s"] <= 0:
        return {}  # (mlx-lm's loop reports no times: no cost model for it)
    costs = {"c": stats["draft_time_s"] / (rounds * k) / step_s, "r": stats["rollback_time_s"] / rounds / step_s}
    if stats["verify"] == "sequential":
        emitted = sum(stats["accepted_at"]) + rounds  # one target step per emitted token
        costs["v1"] = stats["verify_time_s"] / emitted / step_s
    else:
        costs["v"] = stats["verify_time_s"] / rounds / step_s
    return costs
