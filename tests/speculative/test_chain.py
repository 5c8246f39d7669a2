"""MTP speculative decoding is exact: greedy equals plain greedy, samples keep the plain distribution."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import exact_plain_joint, fit_pvalues

from lattice_mlx import cache as caches
from lattice_mlx import generate, load
from lattice_mlx.bench.oracles import DeviceOracle, OracleDrafter
from lattice_mlx.decode import generate_step, prefill
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import SpecOptions, SpecStats, speculate
from lattice_mlx.speculative.tuning import ADAPTIVE_START_K, DepthTuner

PROMPTS = [[5, 9, 33, 21, 7, 100], [250], [3, 3, 3, 3, 17, 17, 2, 8, 64, 128, 256, 12, 13]]


def run_spec(model, prompt, n, *, sampler=None, drafter=None, **options):
    """n tokens of speculative decoding (fixed K unless adaptive=True is asked for) and the stats as the JSON has them.
    The batched host loop unless `verify` names another (this file tests it; the pipelined loop has test_pipelined.py)."""
    options = SpecOptions(**{"adaptive": False, "verify": "batched", **options})
    stats = SpecStats.of(options)
    gen = speculate(model, mx.array(prompt), sampler=sampler or Sampler(), options=options, stats=stats,
                           drafter=drafter)
    return [next(gen) for _ in range(n)], stats.to_dict()


@pytest.mark.parametrize("verify, k", [(v, k) for v in ("batched", "sequential") for k in (1, 2, 3, 4)]
                         + [("pipelined", 1), ("pipelined", 3)])
def test_greedy_mtp_equals_plain_greedy(checkpoints, k, verify, compile_mode):
    for name, path in checkpoints.items():
        model, tok = load(path)
        for prompt in PROMPTS:
            plain = generate(model, tok, prompt, max_tokens=40).tokens
            spec, _ = run_spec(model, prompt, 40, draft_tokens=k, verify=verify)
            assert spec == plain, (name, prompt)


def test_adaptive_depth_is_exact_and_logs_its_decision(checkpoints):
    model, tok = load(checkpoints["tied"])
    plain = generate(model, tok, PROMPTS[0], max_tokens=60).tokens
    spec, stats = run_spec(model, PROMPTS[0], 60, draft_tokens=4, adaptive=True)
    assert spec == plain
    # A random MTP head accepts ~nothing, so the tuner must turn speculation off, and say so.
    assert stats["decisions"][0].startswith("speculation off for 32 tokens after 4 rounds")
    # the warm-up rounds draft ADAPTIVE_START_K tokens, not draft_tokens: deeper positions only after a decision
    at = stats["proposed_at"] + [0] * 4  # (positions never drafted are not listed)
    assert ADAPTIVE_START_K < 4 and at[ADAPTIVE_START_K] == 0 < at[0]  # the random head never earns a deeper K


def test_depth_tuner_costs_are_measured_ones():
    """The cost priors give way to the first measured round, then a moving average of measured rounds."""
    tuner = DepthTuner(4, t1=1.0)
    tuner.observe(2, t_draft=1.0, t_verify=2.0)  # per drafted token: 0.5 of drafting, 0.5 of verify growth
    assert (tuner.t_draft, tuner.slope) == (0.5, 0.5)
    assert tuner.speedup(1, [1.0]) == pytest.approx(2.0 / 2.0)  # 2 tokens for 1 + 0.5 + 0.5
    tuner.observe(2, t_draft=0.0, t_verify=1.0)
    assert (tuner.t_draft, tuner.slope) == (pytest.approx(0.4), pytest.approx(0.4))


def test_depth_tuner_picks_the_depth_with_the_most_tokens_per_second():
    """best() is the depth of highest predicted speedup: deep when drafts are cheap and kept, shallow when they are
    dear or rejected (a tuner that always answered K=1 passed every test before this one)."""
    cheap = DepthTuner(4, t1=1.0)
    cheap.observe(2, t_draft=0.1, t_verify=1.1)  # 0.05 per draft, 0.05 of verify growth per drafted token
    kept = [0.9, 0.81, 0.729, 0.656]  # conditional acceptance 0.9 at every position
    assert cheap.best(kept)[0] == 4 and cheap.best(kept)[1] == pytest.approx(cheap.speedup(4, kept))
    assert cheap.best([0.3, 0.09])[0] == 1  # the deeper drafts rarely survive
    dear = DepthTuner(4, t1=1.0)
    dear.observe(1, t_draft=0.6, t_verify=1.3)  # a draft costs more than half a step
    assert dear.best(kept)[0] == 1  # E(K) / (1 + 0.9 K): 1.9 / 1.9, then 2.71 / 2.8, 3.44 / 3.7, ...
    middle = DepthTuner(4, t1=1.0)
    middle.observe(1, t_draft=0.1, t_verify=1.1)  # cost(K) = 1 + 0.2 K
    falling = [0.9, 0.45, 0.09, 0.009]  # the third draft is rarely kept
    assert middle.best(falling)[0] == 2  # 1.9 / 1.2 = 1.58, 2.35 / 1.4 = 1.68, 2.44 / 1.6 = 1.53
    assert [dear.best([1.0] * 4)[0], cheap.best([1.0] * 4)[0]] == [4, 4]
    for k_max in (1, 2, 3):
        assert DepthTuner(k_max, t1=1.0).best([1.0] * 4)[0] == k_max


def test_adaptive_chain_goes_deeper_when_every_draft_is_kept(checkpoints, monkeypatch):
    """The batched loop's own depth choice: with drafts always right it leaves the warm-up depth (2) for deeper
    rounds, up to draft_tokens, and never turns speculation off; the tokens stay plain greedy's. The round costs are
    fixed (cheap drafts and verify rows), so the choice is the loop's use of best(), not this machine's timings."""
    from lattice_mlx.speculative import chain

    class FixedCosts(DepthTuner):
        def __init__(self, k_max: int, t1: float):
            super().__init__(k_max, 1.0)
            self.slope = self.t_draft = 0.05

        def observe(self, k: int, t_draft: float, t_verify: float) -> None:
            pass

    monkeypatch.setattr(chain, "DepthTuner", FixedCosts)
    model, tok = load(checkpoints["untied"])
    plain = generate(model, tok, PROMPTS[0], max_tokens=200).tokens
    drafter = OracleDrafter(model, Sampler(), plain, 1.0)
    spec, stats = run_spec(model, PROMPTS[0], 160, draft_tokens=4, adaptive=True, drafter=drafter)
    assert spec == plain[:160] and stats["decisions"] == []
    at = stats["proposed_at"] + [0] * 4
    assert at[3] > 0 and at[3] >= stats["rounds"] // 2, stats  # most rounds at K = 4


def test_adaptive_probes_speculation_again_after_a_plain_stretch(checkpoints):
    """Off is not forever: after 32 plain tokens speculation is probed for 4 rounds, then off for 64, 128, ...;
    every stretch keeps the output exact (the drafter sees each plain position's hidden)."""
    model, tok = load(checkpoints["untied"])
    plain = generate(model, tok, PROMPTS[2], max_tokens=240).tokens
    spec, stats = run_spec(model, PROMPTS[2], 240, draft_tokens=3, adaptive=True)
    assert spec == plain
    assert [d.split(": ")[0] for d in stats["decisions"]] == [
        "speculation off for 32 tokens after 4 rounds", "speculation off for 64 tokens after 8 rounds",
        "speculation off for 128 tokens after 12 rounds"]  # each stretch followed by 4 probe rounds


@pytest.mark.parametrize("verify", ["batched", "sequential", "pipelined"])
@pytest.mark.parametrize("p_correct, expected", [(1.0, 1.0), (0.0, 0.0)])
def test_oracle_and_always_wrong_drafts(checkpoints, verify, p_correct, expected):
    model, tok = load(checkpoints["untied"])
    plain = generate(model, tok, PROMPTS[0], max_tokens=60).tokens  # longer than used: the last round drafts ahead
    drafter = DeviceOracle(plain, p_correct, model.args.vocab_size, 3) if verify == "pipelined" else \
        OracleDrafter(model, Sampler(), plain, p_correct)
    spec, stats = run_spec(model, PROMPTS[0], 50, draft_tokens=3, verify=verify, drafter=drafter)
    assert spec == plain[:50]
    assert stats["acceptance_rate"] == expected
    assert stats["accepted_per_position"] == [expected] * 3


def test_partial_acceptance_is_exact_and_reports_per_position_rates(checkpoints):
    model, tok = load(checkpoints["pattern"])
    plain = generate(model, tok, PROMPTS[2], max_tokens=120).tokens
    drafter = OracleDrafter(model, Sampler(), plain, 0.7, seed=3)
    spec, stats = run_spec(model, PROMPTS[2], 110, draft_tokens=3, drafter=drafter)
    assert spec == plain[:110]
    rates = stats["accepted_per_position"]
    assert 0.5 < rates[0] < 0.9 and rates[0] >= rates[1] >= rates[2] > 0


def test_rollback_equals_recomputing_the_accepted_prefix(checkpoints, compile_mode):
    model, _ = load(checkpoints["tied"])
    prompt, extra = mx.array(PROMPTS[0]), [40, 41, 42, 43, 44]
    for n_keep in range(len(extra) + 1):
        cache = model.make_cache()
        prefill(model, prompt, cache)
        caches.begin(cache)
        model(mx.array([extra]), cache)
        caches.rollback(cache, len(extra) - n_keep)
        caches.commit(cache)
        ref = model.make_cache()
        prefill(model, mx.array(PROMPTS[0] + extra[:n_keep]), ref, step=len(PROMPTS[0]))
        for c, r in zip(cache, ref):
            assert c.offset == r.offset
            for a, b in zip(c.state[:2], r.state[:2]):
                a = a[..., : c.offset, :] if isinstance(c, caches.KVCache) else a
                b = b[..., : r.offset, :] if isinstance(r, caches.KVCache) else b
                assert mx.allclose(a, b, atol=1e-5).item()
        probe = mx.array([[7]])
        assert mx.allclose(model(probe, cache), model(probe, ref), atol=1e-4).item()


def test_snapshot_restore_oracle_matches_stepwise_rollback(checkpoints):
    model, _ = load(checkpoints["pattern"])
    cache = model.make_cache()
    prefill(model, mx.array(PROMPTS[0]), cache)
    snap = caches.snapshot(cache)
    caches.begin(cache)
    model(mx.array([[40, 41, 42]]), cache)
    caches.rollback(cache, 2)
    caches.commit(cache)
    replay = model.make_cache()
    caches.restore(replay, snap)
    model(mx.array([[40]]), replay)
    probe = mx.array([[9, 10]])
    assert mx.allclose(model(probe, cache), model(probe, replay), atol=1e-4).item()


def _mtp_numpy(weights, args, tokens, hidden, embed):
    """The head's formula in plain numpy (one position at a time, causal attention by hand)."""
    eps, D = args.rms_norm_eps, args.head_dim
    nq, nkv = args.num_attention_heads, args.num_key_value_heads

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, pos):  # x [T, heads, D], split-half pairing on the first rope_dims
        r = args.rope_dims
        inv = args.rope_theta ** (-np.arange(0, r, 2) / r)
        ang = pos[:, None, None] * inv[None, None, :]
        x1, x2 = x[..., : r // 2], x[..., r // 2 : r]
        out = x.copy()
        out[..., : r // 2] = x1 * np.cos(ang) - x2 * np.sin(ang)
        out[..., r // 2 : r] = x2 * np.cos(ang) + x1 * np.sin(ang)
        return out

    p = lambda k: np.array(weights[k], dtype=np.float64)
    e = embed[tokens]
    x = np.concatenate([rms(e, p("mtp.pre_fc_norm_embedding.weight")), rms(hidden, p("mtp.pre_fc_norm_hidden.weight"))],
                       -1) @ p("mtp.fc.weight").T
    L = "mtp.layers.0."
    h = rms(x, p(L + "input_layernorm.weight"))
    T = len(tokens)
    qg = (h @ p(L + "self_attn.q_proj.weight").T).reshape(T, nq, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(T, -1)
    k = (h @ p(L + "self_attn.k_proj.weight").T).reshape(T, nkv, D)
    v = (h @ p(L + "self_attn.v_proj.weight").T).reshape(T, nkv, D)
    pos = np.arange(T, dtype=np.float64)
    q, k = rope(rms(q, p(L + "self_attn.q_norm.weight")), pos), rope(rms(k, p(L + "self_attn.k_norm.weight")), pos)
    k, v = np.repeat(k, nq // nkv, axis=1), np.repeat(v, nq // nkv, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", a, v).reshape(T, -1) * (1 / (1 + np.exp(-gate)))
    x = x + o @ p(L + "self_attn.o_proj.weight").T
    m = rms(x, p(L + "post_attention_layernorm.weight"))
    g, u = m @ p(L + "mlp.gate_proj.weight").T, m @ p(L + "mlp.up_proj.weight").T
    x = x + (g / (1 + np.exp(-g)) * u) @ p(L + "mlp.down_proj.weight").T
    return rms(x, p("mtp.norm.weight")) @ embed.T


@pytest.mark.parametrize("converted", [False, True])
def test_mtp_head_matches_numpy_formula_and_shifts_norms_once(checkpoints, tmp_path, converted):
    from safetensors.numpy import load_file

    from lattice_mlx.convert import convert

    src = checkpoints["tied"]
    model, _ = load(convert(str(src), str(tmp_path / "c"), mtp_dtype=None) if converted else src)
    raw = load_file(str(src / "model.safetensors"))
    # All seven MTP norms are zero-centred in the hub checkpoint; the formula applies x * (1 + w).
    weights = {k: (v + 1.0 if k.startswith("mtp.") and "norm" in k else v) for k, v in raw.items()}
    assert sum(k.startswith("mtp.") and "norm" in k for k in raw) == 7
    embed = raw["model.language_model.embed_tokens.weight"].astype(np.float64)
    tokens = np.array([5, 9, 33, 21, 7])
    hidden = np.random.default_rng(0).normal(0, 1, (5, model.args.hidden_size))
    ref = _mtp_numpy(weights, model.args, tokens, hidden, embed)
    x = model.mtp(model.model.embed_tokens(mx.array(tokens))[None], mx.array(hidden, dtype=mx.float32)[None])
    out = np.array(model.lm_logits(model.mtp.norm(x))[0])
    assert np.abs(out - ref).max() < 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("temp, top_p, top_k", [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.8, 0), (0.6, 0.9, 12)])
def test_speculative_sampling_keeps_the_distribution(temp, top_p, top_k, tmp_path_factory):
    """Chi-square over the first 3 tokens' joint outcome class, tiny vocabulary, fixed seeds."""
    from scipy.stats import chi2_contingency

    from lattice_mlx.bench.synthetic import random_checkpoint

    path = random_checkpoint(tmp_path_factory.mktemp("tiny") / "v", seed=5, vocab_size=16, hidden_size=32,
                             intermediate_size=64, num_hidden_layers=4)
    model, _ = load(path)
    sampler = Sampler(temp=temp, top_p=top_p, top_k=top_k)
    prompt, trials = [1, 2, 3], 400
    mx.random.seed(1)
    plain = model.make_cache()
    logits, _ = prefill(model, mx.array(prompt), plain)
    first = sampler.probs(logits)
    counts_plain, counts_spec = np.zeros(16 * 16), np.zeros(16 * 16)
    for i in range(trials):
        mx.random.seed(1000 + i)
        a = sampler(logits).item()
        c = [cc for cc in model.make_cache()]
        caches.restore(c, caches.snapshot(plain))
        b = sampler(model(mx.array([[a]]), c)[0, -1]).item()
        counts_plain[a * 16 + b] += 1
        mx.random.seed(50_000 + i)
        toks, _ = run_spec(model, prompt, 2, draft_tokens=2, sampler=sampler)
        counts_spec[toks[0] * 16 + toks[1]] += 1
    keep = (counts_plain + counts_spec) > 0
    _, pvalue, _, _ = chi2_contingency(np.stack([counts_plain[keep], counts_spec[keep]]))
    assert pvalue > 0.01, pvalue
    assert first.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_long_greedy_run_has_no_drift(checkpoints):
    model, tok = load(checkpoints["untied"])
    steps = generate_step(model, mx.array(PROMPTS[0]), sampler=Sampler())  # no EOS stop: 2,000 tokens for sure
    plain = [next(steps) for _ in range(2010)]
    drafter = OracleDrafter(model, Sampler(), plain, 0.8, seed=7)
    spec, stats = run_spec(model, PROMPTS[0], 2000, draft_tokens=3, drafter=drafter)
    assert spec == plain[:2000]
    assert stats["acceptance_rate"] > 0.3


def test_mtp_head_prefill_runs_in_chunks_with_bounded_memory(checkpoints):
    """An 8k-token prompt: the head's prompt slots go in 512-row chunks like the target's prefill (it once took them
    in one piece: ~1.2 GB and 7 s for this call on the CPU) and the first draft equals the one-piece result."""
    from lattice_mlx.speculative.drafters import MTPDrafter, mtp_prefill

    model, _ = load(checkpoints["tied"])
    ids = mx.array([i % 300 + 1 for i in range(8192)])
    cache = model.make_cache()
    _, hidden = prefill(model, ids, cache, return_hidden=True)
    mx.eval(hidden)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    drafter = MTPDrafter(model, Sampler())
    drafter.start(ids.tolist(), 5, hidden, cache)
    chunked, _ = drafter.propose([*ids.tolist(), 5], 2)
    mx.eval(chunked)
    assert mx.get_peak_memory() - base < 300e6
    whole = model.mtp.make_cache()
    rest = mtp_prefill(model, [*ids.tolist()[1:4097], 5], hidden[:4097], whole, step=1 << 20)
    assert len(rest[0]) == 4097  # a step longer than the prompt keeps it all for the first draft step
    small = model.mtp.make_cache()
    tokens, h = mtp_prefill(model, [*ids.tolist()[1:4097], 5], hidden[:4097], small, step=1000)
    assert len(tokens) == 97 and h.shape[0] == 97 and small[0].offset == 4000
    from lattice_mlx.speculative.drafters import mtp_step

    a, _ = mtp_step(model, mx.array(rest[0]), model.mtp.from_target(rest[1]), whole)
    b, _ = mtp_step(model, mx.array(tokens), model.mtp.from_target(h), small)
    assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


def test_kv_snapshot_is_not_changed_by_later_writes():
    """snapshot() promised a copy but returned the live arrays, which the cache's row writes change in place."""
    c = caches.KVCache()
    ones = mx.ones((1, 2, 3, 4))
    c.update_and_fetch(ones, ones)
    snap = c.snapshot()
    c.trim(1)
    c.update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    assert mx.array_equal(snap[0][..., :3, :], ones) and mx.array_equal(snap[1][..., :3, :], ones)
    c.restore(snap)
    assert c.offset == 3 and mx.array_equal(c.keys[..., :3, :], ones)
    c.trim(1)
    c.update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))  # a restored cache writes its own copy
    assert mx.array_equal(snap[0][..., :3, :], ones)


def _round_tokens(model, seeds) -> list[tuple[int, ...]]:
    """Tokens 2..5 of a speculative generation (the first comes from prefill): exactly one K=3 round and its bonus
    when all drafts are accepted. Drafts: the target's own layers sampled at temperature 0.3 against the target's
    1.0, so q is sharper than p: drafts are accepted often but with p/q < 1, where each position's own uniform
    matters."""
    from lattice_mlx.speculative.drafters import SelfSpecDrafter

    sampler, options, out = Sampler(temp=1.0), SpecOptions(draft="self", draft_tokens=3, adaptive=False), []
    for seed in seeds:
        mx.random.seed(seed)
        drafter = SelfSpecDrafter(model, Sampler(temp=0.3), "first:4")
        gen = speculate(model, mx.array([1, 2, 1, 2, 1]), sampler=sampler, options=options,
                        stats=SpecStats.of(options), drafter=drafter)
        out.append(tuple(next(gen) for _ in range(5))[1:])
    return out


def _fit(model, spec) -> dict:
    """Chi-square p-values of the speculative tokens 2..5 against plain sampling's exact joint, over the pairs
    (t1, t2), (t2, t3), (t3, t4) and t4 alone."""
    joint = exact_plain_joint(model, [1, 2, 1, 2, 1], 5, Sampler(temp=1.0)).sum(axis=0)  # t1..t4
    return fit_pvalues(joint, spec, ((0, 1), (1, 2), (2, 3), (3,)))


def test_sampled_round_keeps_the_joint_distribution_and_planted_bugs_fail(tiny_vocab_model, monkeypatch):
    """Every position of a K=3 round and its bonus token, jointly in adjacent pairs, against plain sampling; the same
    check catches a bonus drawn from the last draft's row and one uniform shared by all draft positions."""
    from lattice_mlx import sample
    from lattice_mlx.speculative import chain as speculative

    seeds = range(500_000, 500_000 + 300)
    right = _fit(tiny_vocab_model, _round_tokens(tiny_vocab_model, seeds))
    assert min(right.values()) > 1e-3, right
    real = sample.accept_sampled

    def bonus_from_wrong_row(p, q, drafts):
        n, token = real(p, q, drafts)
        return (n, sample.sample_from(p[n - 1]).item()) if n == len(drafts) and p.shape[0] > n else (n, token)

    def one_shared_uniform(p, q, drafts):
        uniform = mx.random.uniform
        with monkeypatch.context() as m:
            m.setattr(mx.random, "uniform",
                      lambda shape, key=None: mx.broadcast_to(uniform(shape=(1,), key=key), shape))
            return real(p, q, drafts)

    for planted in (bonus_from_wrong_row, one_shared_uniform):
        monkeypatch.setattr(speculative, "accept_sampled", planted)
        wrong = _fit(tiny_vocab_model, _round_tokens(tiny_vocab_model, seeds))
        assert min(wrong.values()) < 1e-4, (planted.__name__, wrong)


def test_head_catches_up_a_plain_stretch_in_fixed_chunks(checkpoints, monkeypatch):
    """A plain stretch (adaptive depth off) of 37 positions: the MTP head takes the slots in forwards of at most
    CATCH_UP_ROWS rows as they come, never one forward of the stretch's length (a new row count compiles new kernels
    on a GPU), and drafts what one forward over the whole stretch drafts."""
    from lattice_mlx.models.mtp import MTPHead
    from lattice_mlx.speculative import drafters

    model, _ = load(checkpoints["untied"])
    ids = mx.array(PROMPTS[2])
    rows, real = [], MTPHead.__call__

    def spy(self, x, *a, **k):
        rows.append(x.shape[1])
        return real(self, x, *a, **k)

    def stretch(chunk_rows: int):
        monkeypatch.setattr(drafters, "CATCH_UP_ROWS", chunk_rows)
        cache = model.make_cache()
        logits, hidden = prefill(model, ids, cache, return_hidden=True)
        drafter = drafters.MTPDrafter(model, Sampler())
        y = mx.argmax(logits).item()
        drafter.start(PROMPTS[2], y, hidden, cache)
        rows.clear()
        for _ in range(37):  # plain steps, each position's hidden handed over as speculative.plain_steps does
            logits, h = model(mx.array([[y]]), cache, return_hidden=True)
            drafter.observe([y], h[0])
            y = mx.argmax(logits[0, -1]).item()
        drafts, _ = drafter.propose([], 3)
        return drafts.tolist(), list(rows)

    monkeypatch.setattr(MTPHead, "__call__", spy)
    chunk_rows = drafters.CATCH_UP_ROWS
    chunked, chunked_rows = stretch(chunk_rows)
    whole, whole_rows = stretch(1 << 20)
    tail = len(PROMPTS[2])  # the prompt's pending slots ride with the first piece, as they rode with the first draft
    assert chunked_rows[0] == tail + chunk_rows and max(chunked_rows[1:]) <= chunk_rows < 37, chunked_rows
    assert whole_rows[0] == tail + 37  # the old way: one forward over the prompt's slots and the stretch
    assert chunked == whole
