"""mlx-lm's own speculative loop (`mlx_lm.stream_generate(..., draft_model=...)`) on lattice models: the GDN cache is
trimmable in mlx-lm's sense (cache.GDNCache, Model.make_cache), so a lattice target with a lattice draft model runs
there, greedy identical to plain and sampled with plain's distribution; trimming past what was recorded raises."""

import importlib
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler

from lattice_mlx import load
from lattice_mlx.cache import TRIM_WINDOW, GDNCache
from lattice_mlx.synthetic import random_checkpoint

mlx_lm_generate = importlib.import_module("mlx_lm.generate")  # the package re-exports a function of that name


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlxspec")
    target, tok = load(random_checkpoint(root / "target", seed=0))
    draft, _ = load(random_checkpoint(root / "draft", seed=1, num_hidden_layers=2))
    return target, draft, tok


def _tokens(model, tok, prompt, n, **kw):
    return [r.token for r in mlx_lm_generate.stream_generate(model, tok, prompt, max_tokens=n, **kw)]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_a_lattice_draft_model_equals_plain(pair, k, compile_mode):
    target, draft, tok = pair
    prompt = tok.encode("the cat sat")
    assert _tokens(target, tok, prompt, 40, draft_model=draft, num_draft_tokens=k) == _tokens(target, tok, prompt, 40)


def test_demo_drafting_for_itself_accepts_everything_and_equals_plain():
    target, tok = load()
    draft, _ = load()
    prompt = tok.encode("def add(a, b):\n")
    out = list(mlx_lm_generate.stream_generate(target, tok, prompt, max_tokens=48, draft_model=draft,
                                               num_draft_tokens=3))
    assert [r.token for r in out] == _tokens(target, tok, prompt, 48)
    assert sum(r.from_draft for r in out) >= 30  # all drafts match: 3 of every 4 tokens come from the draft


def _sampled(model, tok, draft, seeds, n=4):
    out = []
    for seed in seeds:
        mx.random.seed(seed)
        kw = dict(draft_model=draft, num_draft_tokens=3) if draft is not None else {}
        toks = _tokens(model, tok, [1, 2, 1, 2, 1], n, sampler=make_sampler(temp=1.0), **kw)
        out.append(tuple(toks + [-1] * (n - len(toks)))[1:])  # -1 after an end of sequence (id 0 here)
    return out


def _min_pvalue(a_runs, b_runs) -> float:
    from scipy.stats import chi2_contingency

    out = []
    for idx in ((0, 1), (1, 2), (2,)):
        a, b = Counter(tuple(t[i] for i in idx) for t in a_runs), Counter(tuple(t[i] for i in idx) for t in b_runs)
        keys = sorted(set(a) | set(b))
        out.append(chi2_contingency(np.array([[a[k] for k in keys], [b[k] for k in keys]]))[1])
    return min(out)


def test_sampled_speculation_keeps_the_distribution_and_a_no_op_trim_fails(tmp_path, monkeypatch):
    """Vocabulary 8, temperature 1: tokens 2..4 through mlx-lm's speculative loop follow plain sampling (mlx-lm's
    rule: a draft is kept when the target's own sample equals it); with trim() doing nothing, rejected tokens stay
    in the GDN state and the same check fails."""
    target, tok = load(random_checkpoint(tmp_path / "t8", seed=6, vocab_size=8, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=4))
    draft, _ = load(random_checkpoint(tmp_path / "d8", seed=7, vocab_size=8, hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=2))
    trials = 500
    plain = _sampled(target, tok, None, range(10, 10 + trials))
    seeds = range(500_000, 500_000 + trials)
    assert _min_pvalue(plain, _sampled(target, tok, draft, seeds)) > 1e-3
    monkeypatch.setattr(GDNCache, "trim", lambda self, n: n)
    assert _min_pvalue(plain, _sampled(target, tok, draft, seeds)) < 1e-4


def test_trim_is_exact_and_bounded(pair):
    target, _, _ = pair
    cache = target.make_cache()
    assert can_trim_prompt_cache(cache) and not can_trim_prompt_cache(target.make_cache(trimmable=False))
    ids = mx.array([[3, 1, 4, 1, 5, 9]])
    target(ids[:, :2], cache)
    target(ids[:, 2:], cache)  # a 4-token "verify"
    assert trim_prompt_cache(cache, 3) == 3
    got = target(mx.array([[7]]), cache)
    fresh = target.make_cache()
    target(ids[:, :3], fresh)
    assert mx.allclose(got, target(mx.array([[7]]), fresh), atol=1e-5).item()
    # one-token steps: the latest TRIM_WINDOW stay undoable, no more
    for t in range(TRIM_WINDOW + 2):
        target(mx.array([[t % 7 + 1]]), cache)
    assert trim_prompt_cache(cache, TRIM_WINDOW) == TRIM_WINDOW
    with pytest.raises(ValueError, match="cannot trim 1 tokens from a GDN cache"):
        trim_prompt_cache(cache, 1)
