"""Every draft source through the same loop: exact greedy output, exact sampling, and target caches left untouched."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import two_token_pvalue

from lattice_mlx import load
from lattice_mlx.decode import generate_step, prefill
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import SpecOptions, SpecStats, speculate
from lattice_mlx.speculative.drafters import NgramDrafter, SelfSpecDrafter, parse_layers

# A prompt that repeats itself, so prompt lookup finds matches (copy-heavy workload).
COPY_PROMPT = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8, 9]


def spec_tokens(model, prompt, n, draft, *, sampler=None, **options):
    options = SpecOptions(draft=draft, **{"draft_tokens": 3, "adaptive": False, **options})
    stats = SpecStats.of(options)
    gen = speculate(model, mx.array(prompt), sampler=sampler or Sampler(), options=options, stats=stats)
    return [next(gen) for _ in range(n)], stats.to_dict()


@pytest.mark.parametrize("draft", ["self", "self:first:2", "self:every:2", "self:0,3", "ngram", "mtp+ngram"])
@pytest.mark.parametrize("verify", ["batched", "sequential"])
def test_every_source_is_exact_under_greedy(checkpoints, draft, verify):
    for name in ("tied", "pattern"):
        model, tok = load(checkpoints[name])
        for prompt in (COPY_PROMPT, [5, 9, 33, 21, 7, 100]):
            steps = generate_step(model, mx.array(prompt), sampler=Sampler())
            plain = [next(steps) for _ in range(40)]
            spec, stats = spec_tokens(model, prompt, 40, draft, verify=verify)
            assert spec == plain, (name, draft, prompt)
            assert stats["draft"] == draft


def test_ngram_proposes_on_repeated_text_and_stays_exact(checkpoints):
    model, _ = load(checkpoints["untied"])
    steps = generate_step(model, mx.array(COPY_PROMPT), sampler=Sampler())
    prompt = COPY_PROMPT + [next(steps) for _ in range(40)]  # the model's own text, which repeats some bigrams
    steps = generate_step(model, mx.array(prompt), sampler=Sampler())
    ref = [next(steps) for _ in range(30)]
    spec, stats = spec_tokens(model, prompt, 30, "ngram")
    assert spec == ref
    # The repeated prompt gives lookup matches, so drafts were proposed (random weights rarely accept them).
    assert len(stats["accepted_per_position"]) >= 2


def test_self_spec_leaves_target_caches_as_plain_decoding_does(checkpoints):
    model, _ = load(checkpoints["pattern"])
    prompt = mx.array([5, 9, 33, 21, 7, 100])
    cache = model.make_cache()
    prefill(model, prompt, cache)
    before = [tuple(np.array(a) for a in c.state[:2] if a is not None) for c in cache]
    offsets = [c.offset for c in cache]
    drafter = SelfSpecDrafter(model, Sampler(), "first:4")  # GDN and attention layers both drafted
    drafter.start(prompt.tolist(), 3, None, cache)
    drafts, _ = drafter.propose(prompt.tolist() + [3], 4)
    mx.eval(drafts)  # drafts are lazy: evaluate them, so that any write into the target's buffers would happen
    assert drafts.shape == (4,)
    assert [c.offset for c in cache] == offsets
    for c, b in zip(cache, before):
        for arr, ref in zip(c.state[:2], b):
            assert np.array_equal(np.array(arr), ref)


@pytest.mark.parametrize("draft", ["self", "ngram", "mtp+ngram"])
def test_sampling_with_each_source_keeps_the_distribution(draft, tiny_vocab_model):
    sampler, prompt = Sampler(temp=1.0), [1, 2, 1, 2, 1]
    pvalue = two_token_pvalue(tiny_vocab_model, prompt, sampler, lambda: spec_tokens(
        tiny_vocab_model, prompt, 2, draft, sampler=sampler, draft_tokens=2)[0])
    assert pvalue > 0.01


def test_ngram_lookup():
    d = NgramDrafter(100, max_n=3, min_n=2)
    assert d.lookup([1, 2, 3, 4, 1, 2], 2) == [3, 4]
    assert d.lookup([1, 2, 3, 9, 2, 3, 7, 2, 3], 3) == [7, 2, 3]  # most recent earlier match wins
    assert d.lookup([5, 1, 2, 3, 6, 9, 1, 2, 3], 2) == [6, 9]  # longest n first
    assert d.lookup([1, 2, 3, 4], 3) == []
    assert d.lookup([4, 4], 2) == []  # n=2 needs an earlier occurrence; n=1 is below min_n


def test_layer_specs(checkpoints):
    model, _ = load(checkpoints["pattern"])  # full, linear, linear, full, linear
    assert parse_layers("gdn", model) == [1, 2, 4]
    assert parse_layers("first:2", model) == [0, 1]
    assert parse_layers("every:2", model) == [0, 2, 4]
    assert parse_layers("3,0", model) == [0, 3]
    with pytest.raises(ValueError):
        parse_layers("9", model)


def test_cli_draft_sources(checkpoints):
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "lattice_mlx.generate", "--model", str(checkpoints["tied"]), "--prompt", "a b a b",
            "--max-tokens", "12", "--json", "--no-chat-template"]
    plain = json.loads(subprocess.run(base, capture_output=True, text=True).stdout.splitlines()[-1])["tokens"]
    for draft in ("mtp+ngram", "self"):
        out = subprocess.run(base + ["--draft", draft, "--no-adaptive"], capture_output=True, text=True)
        result = json.loads(out.stdout.splitlines()[-1])
        assert result["tokens"] == plain and result["speculation"]["draft"] == draft
    bad = subprocess.run(base + ["--draft", "self:99"], capture_output=True, text=True)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1


def test_ngram_index_grows_with_the_history_like_a_full_scan():
    """The incremental index gives what a scan of the whole history gives, as the same list grows round by round."""

    def scan(seq, k, max_n=4, min_n=2):
        for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == seq[-n:]:
                    return seq[start + n : start + n + k]
        return []

    rng = np.random.default_rng(0)
    d, history = NgramDrafter(100), list(rng.integers(0, 6, 20))
    for _ in range(50):
        assert d.lookup(history, 3) == scan(history, 3)
        history += list(rng.integers(0, 6, int(rng.integers(1, 4))))
