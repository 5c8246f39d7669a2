"""Continuous batching (lattice_mlx/batch.py): every sequence in a batch gets its single generation's tokens, whoever
its batch-mates are and whenever they join or leave; sampled rows keep the plain distribution."""

import mlx.core as mx
import pytest
from conftest import greedy_tokens, two_token_pvalue

from lattice_mlx import batch_generate, load
from lattice_mlx.batch import BatchDecoder
from lattice_mlx.sample import Sampler

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], list(range(10, 40)), [5] * 17, [9], list(range(60, 73))]


@pytest.fixture(scope="module")
def model32(checkpoint):
    return load(checkpoint, dtype="float32")[0]


solo = greedy_tokens


def test_batch_generate_greedy_equals_each_single_generation(model32, compile_mode):
    """Mixed prompt lengths (1 to 30 tokens), a budget per prompt, and fewer rows than prompts: sequences leave at
    different steps and the waiting ones join a batch already running."""
    budgets = [9, 3, 12, 6, 1, 10]
    got = batch_generate(model32, None, PROMPTS, max_tokens=budgets, max_batch=3)
    for prompt, n, r in zip(PROMPTS, budgets, got):
        assert r.tokens == solo(model32, prompt, n), prompt
        assert r.finish_reason == "length" and r.prompt_tokens == len(prompt)


def test_a_batched_forward_builds_one_mask_for_every_attention_layer(model32, compile_mode, monkeypatch):
    """The attention layers' batch caches hold the same columns, so a forward masks once, not once per layer; the
    sequences keep their single generations' tokens."""
    from mlx_lm.models.cache import BatchKVCache

    masks, forwards, make_mask, forward = [], [], BatchKVCache.make_mask, type(model32).__call__

    def counted_mask(self, N, **kwargs):
        masks.append(N)
        return make_mask(self, N, **kwargs)

    def counted_forward(self, inputs, cache=None, *args, **kwargs):
        if cache and any(isinstance(c, BatchKVCache) for c in cache):
            forwards.append(inputs.shape)
        return forward(self, inputs, cache, *args, **kwargs)

    monkeypatch.setattr(BatchKVCache, "make_mask", counted_mask)
    monkeypatch.setattr(type(model32), "__call__", counted_forward)
    monkeypatch.setenv("LATTICE_TRACE_STEPS", "0")  # a traced step's mask is built once, at its trace
    got = batch_generate(model32, None, PROMPTS[:3], max_tokens=5, max_batch=3)
    for prompt, r in zip(PROMPTS[:3], got):
        assert r.tokens == solo(model32, prompt, 5)
    assert len(forwards) >= 3 and len(masks) == len(forwards), (forwards, masks)


def test_arrivals_and_a_cancel_mid_generation_leave_the_others_untouched(model32):
    engine = BatchDecoder(model32, max_batch=4)
    a = engine.add(PROMPTS[2], max_tokens=14)
    for _ in range(3):
        engine.step()
    b = engine.add(PROMPTS[0], max_tokens=10)  # joins a batch whose keys are 33 positions long
    c = engine.add(PROMPTS[3], max_tokens=10)
    assert b.tokens == [] and engine.waiting  # prefilled by the steps (both fit one step's 512 prompt tokens)
    engine.step()
    engine.step()
    engine.cancel(b)
    # (a cancel first reads the step queued behind the last one: b has that step's token too)
    assert b.finish_reason == "cancelled" and len(b.tokens) == 4 and engine.active == [a, c]
    d = engine.add(PROMPTS[1], max_tokens=8)  # takes the freed row
    while engine.busy:
        engine.step()
    assert b.tokens == solo(model32, PROMPTS[0], 4)
    for seq, prompt in ((a, PROMPTS[2]), (c, PROMPTS[3]), (d, PROMPTS[1])):
        assert seq.tokens == solo(model32, prompt, seq.max_tokens) and seq.finish_reason == "length"


def test_a_long_prompt_joins_a_chunk_per_step_without_stalling_the_batch(model32):
    """A 30-token prompt prefilled 8 tokens per step (4 chunks) while two sequences run: each step still gives them
    a token, and the newcomer's first token comes with its last chunk; every sequence ends with its single
    generation's tokens."""
    engine = BatchDecoder(model32, max_batch=3, prefill_step=8)
    a, b = engine.add(PROMPTS[0], max_tokens=12), engine.add(PROMPTS[1], max_tokens=12)
    while len(engine.active) < 2:
        engine.step()
    long = engine.add(PROMPTS[2], max_tokens=5)
    for chunk in range(4):
        got = engine.step()
        assert {s for s, _ in got} >= {a, b}, chunk
        assert (long in {s for s, _ in got}) == (chunk == 3)
    while engine.busy:
        engine.step()
    for seq, prompt in ((a, PROMPTS[0]), (b, PROMPTS[1]), (long, PROMPTS[2])):
        assert seq.tokens == solo(model32, prompt, seq.max_tokens)
    # short prompts join several in one step, up to prefill_step prompt tokens: 3 + 2 + 3 fit, then 5 would not
    engine = BatchDecoder(model32, max_batch=4, prefill_step=8)
    short = [engine.add(p, max_tokens=4) for p in ([1, 2, 3], [4, 5], [6, 7, 8], [9, 10, 11, 12, 13])]
    engine.step()
    assert engine.active == short[:3] and [w[0] for w in engine.waiting] == short[3:]
    while engine.busy:
        engine.step()
    assert [s.tokens for s in short] == [solo(model32, s.prompt, 4) for s in short]


def test_a_stop_token_ends_only_its_sequence(model32):
    ref = solo(model32, PROMPTS[0], 8)
    engine = BatchDecoder(model32)
    s = engine.add(PROMPTS[0], max_tokens=8, stop_ids=[ref[3]])
    t = engine.add(PROMPTS[5], max_tokens=8)
    while engine.busy:
        engine.step()
    assert s.tokens == ref[: ref.index(ref[3]) + 1] and s.finish_reason == "stop"
    assert t.tokens == solo(model32, PROMPTS[5], 8)


def test_sampled_rows_keep_the_plain_distribution(tiny_vocab_model):
    """The first two tokens of a sequence decoded beside a batch-mate (row 1 of the step) follow plain sampling
    (chi-square over the 64 outcomes; a row sampled from another row's logits fails it)."""
    sampler, prompt = Sampler(temp=1.0), [1, 2, 3]

    def batched():
        engine = BatchDecoder(tiny_vocab_model)
        engine.add([5, 6, 7, 0, 4], max_tokens=10, sampler=sampler)
        seq = engine.add(prompt, max_tokens=2, sampler=sampler)
        while not seq.done:
            engine.step()
        return seq.tokens

    assert two_token_pvalue(tiny_vocab_model, prompt, sampler, batched, trials=300) > 1e-3

    def mixed():  # batch-mates with samplers of their own: each row sampled by its sequence's
        engine = BatchDecoder(tiny_vocab_model)
        engine.add([5, 6, 7, 0, 4], max_tokens=10, sampler=Sampler(temp=0.5, top_k=3))
        engine.add([2, 2], max_tokens=10)  # greedy
        seq = engine.add(prompt, max_tokens=2, sampler=sampler)
        while not seq.done:
            engine.step()
        return seq.tokens

    assert two_token_pvalue(tiny_vocab_model, prompt, sampler, mixed, trials=300) > 1e-3

    def numbers():  # batch-mates of the same structure at other temperatures: one traced step, a row's own numbers
        engine = BatchDecoder(tiny_vocab_model)
        engine.add([5, 6, 7, 0, 4], max_tokens=10, sampler=Sampler(temp=3.0))
        engine.add([2, 2], max_tokens=10, sampler=Sampler(temp=0.3))
        seq = engine.add(prompt, max_tokens=2, sampler=sampler)
        while not seq.done:
            engine.step()
        return seq.tokens

    assert two_token_pvalue(tiny_vocab_model, prompt, sampler, numbers, trials=300) > 1e-3


def test_bad_requests_are_one_line_errors(model32):
    engine = BatchDecoder(model32, max_batch=1)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add([], max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add([1], max_tokens=0)
    engine.add([1, 2], max_tokens=4)
    with pytest.raises(ValueError, match="full"):
        engine.add([3], max_tokens=4)
    with pytest.raises(ValueError, match="entries"):
        batch_generate(model32, None, [[1], [2]], max_tokens=[3])
    with pytest.raises(ValueError, match="MTP chains"):
        batch_generate(model32, None, [[1]], speculation="auto")


def test_a_4bit_model_batched_equals_its_single_generations():
    """The 4-bit projections run B rows per step (this project's kernel up to 8 rows where kernels run, each row
    bitwise a one-row call; MLX's quantized matmul otherwise)."""
    from lattice_mlx.bench.synthetic import random_model

    model = random_model(bits=4, group_size=32, dtype=mx.float32)
    got = batch_generate(model, None, PROMPTS[:4], max_tokens=[6, 8, 5, 7], max_batch=3)
    for prompt, r in zip(PROMPTS, got):
        assert r.tokens == solo(model, prompt, len(r.tokens)), prompt


@pytest.mark.parametrize("bits", [0, 4], ids=["fp32", "q4"])
def test_batch_generate_equals_mlx_lms_batch_generate(bits):
    """mlx-lm's own batch_generate (its BatchGenerator: batched prefill, left padding, its GDN masks) on mlx-lm's
    qwen3_5 sharing our weight arrays gives the same greedy tokens per prompt."""
    import types

    import mlx_lm

    from lattice_mlx.bench.run import load_target

    target = load_target("tiny", bits=bits, group_size=32, dtype="float32", seed=0, stock=True)
    assert target.stock is not None, target.stock_note
    budgets = [9, 3, 12, 6, 1]
    tok = types.SimpleNamespace(eos_token_ids=[], decode=lambda ids: "")
    theirs = mlx_lm.batch_generate(target.stock, tok, PROMPTS[:5], max_tokens=budgets, return_token_ids=True)
    ours = batch_generate(target.model, None, PROMPTS[:5], max_tokens=budgets, max_batch=3)
    assert [r.tokens for r in ours] == [list(t) for t in theirs.token_ids]


def test_bf16_tokens_do_not_depend_on_batch_mates_on_the_cpu():
    """What ADR 0009 claims for bf16: where no kernel runs (MLX's CPU backend) a batched row's ops are its single
    generation's, so its greedy tokens are too (the demo in its bf16 dtype, 3 prompts, 24 tokens). On a GPU a batch's
    attention runs MLX's masked SDPA instead of this project's kernel, so bf16 tokens may differ there."""
    from lattice_mlx.metal import use_kernels

    if use_kernels():
        pytest.skip("a GPU backend or the CPU render: a batch's attention and a single generation's differ")
    model, tok = load(dtype="bfloat16")
    prompts = [list(tok.encode(t)) for t in ["def add(a, b):", "import os\n", "class Stack:\n    def"]]
    got = batch_generate(model, None, prompts, max_tokens=24, max_batch=3)
    assert [r.tokens for r in got] == [solo(model, p, 24) for p in prompts]


def test_plain_steps_are_queued_one_ahead(model32):
    """A plain step is built on the previous step's tokens before they are read (the host builds step t + 1 while
    the device runs step t), except where a budget ends; the tokens are the single generations' all the same."""
    engine = BatchDecoder(model32)
    seqs = [engine.add(p, max_tokens=8) for p in PROMPTS[:2]]
    engine.step()
    queued = []
    while engine.busy:
        engine.step()
        queued.append(engine._ahead is not None)
    assert queued[:3] == [True] * 3 and not queued[-1]
    for s, p in zip(seqs, PROMPTS):
        assert s.tokens == solo(model32, p, 8)


def _run(model, prompts, budgets, *, max_batch: int, sampler=None, cancel_at: int | None = None):
    """Every prompt through one BatchDecoder (a cancel of the first sequence at step `cancel_at`): the tokens."""
    engine = BatchDecoder(model, max_batch=max_batch)
    pending = list(zip(prompts, budgets))
    seqs, steps = [], 0
    while pending or engine.busy:
        while pending and not engine.full:
            p, n = pending.pop(0)
            seqs.append(engine.add(p, max_tokens=n, sampler=sampler))
        engine.step()
        steps += 1
        if steps == cancel_at:
            engine.cancel(seqs[0])
    return [s.tokens for s in seqs]


@pytest.mark.parametrize("grow", [256, 8])
def test_traced_batch_steps_equal_steps_built_op_by_op(model32, monkeypatch, grow):
    """With tracing on, plain steps replay one trace per batch size (BatchSteps: the write column on the device, the
    rows' masks over the whole buffer): greedy and sampled tokens equal the steps built op by op, through arrivals,
    departures, a cancel and buffer growth (every 8 columns when grow is 8), the buffers whole GROW blocks."""
    from lattice_mlx import cache as caches
    from lattice_mlx import settings
    from lattice_mlx.batch import BatchSteps
    from lattice_mlx.runtime import runtime_of

    monkeypatch.setattr(caches.BatchFixedKVCache, "GROW", grow)
    replays, widths = [], set()
    step = BatchSteps.step

    def spy(self, cache, y, samplers, keys):
        out = step(self, cache, y, samplers, keys)
        replays.append(y.shape[0])
        widths.update(c.keys.shape[2] for c in cache if isinstance(c, caches.BatchFixedKVCache))
        return out

    monkeypatch.setattr(BatchSteps, "step", spy)
    budgets = [9, 30, 12, 6, 1, 10]
    for sampler in (None, Sampler(temp=1.0)):
        got = {}
        for traced in (True, False):
            mx.random.seed(3)
            with settings.override(trace_steps=traced):
                got[traced] = _run(model32, PROMPTS, budgets, max_batch=3, sampler=sampler, cancel_at=5)
        assert got[True] == got[False]
    assert len(set(replays)) >= 2 and "batch_steps" in runtime_of(model32).traces
    # buffers stay whole GROW blocks through joins and leaves (each other width would be another trace, kept)
    assert widths and all(w % grow == 0 for w in widths), widths


@pytest.mark.parametrize("traced", [True, False])
def test_a_seeded_sequence_samples_its_tokens_whoever_its_batch_mates_are(model32, traced):
    """A seed keys the sequence's own PRNG stream: its sampled tokens are the same alone and beside batch-mates
    (sampled ones of its sampler's structure, so the traced step runs with keys, unseeded and seeded; then a greedy
    one, so steps are built op by op), joining before and after it, whatever the global generator's state; another
    seed gives other tokens."""
    from lattice_mlx import settings

    hot = Sampler(temp=1.5)

    def run(seed: int, mates: list[tuple[Sampler, int | None]], global_seed: int) -> list[int]:
        mx.random.seed(global_seed)
        with settings.override(trace_steps=traced):
            engine = BatchDecoder(model32, max_batch=4)
            if mates:
                engine.add(PROMPTS[0], max_tokens=30, sampler=mates[0][0], seed=mates[0][1])
                engine.step()
            seq = engine.add(PROMPTS[2], max_tokens=20, sampler=hot, seed=seed)
            for n, (sampler, mate_seed) in enumerate(mates[1:]):
                for _ in range(2 + n):
                    engine.step()
                engine.add(PROMPTS[3 + n], max_tokens=9, sampler=sampler, seed=mate_seed)
            while engine.busy:
                engine.step()
        return seq.tokens

    alone = run(5, [], 0)
    assert len(alone) == 20
    assert run(5, [(Sampler(temp=0.7), None), (Sampler(temp=1.0, top_p=1.0), 11)], 1) == alone
    assert run(5, [(Sampler(temp=0.9), 3), (Sampler(), None)], 2) == alone
    assert run(6, [], 0) != alone


def test_a_kept_prefix_is_reused_by_the_next_turn(model32):
    """keep_prefix leaves the state after all but the prompt's last token; a later prompt extending it (the next turn
    of a conversation, beside a batch-mate) prefills only its new tokens and gets its single generation's tokens;
    the kept state is not changed by that use."""
    turn1 = PROMPTS[2]
    engine = BatchDecoder(model32, max_batch=2)
    first = engine.add(turn1, max_tokens=5, keep_prefix=True)
    while engine.busy:
        engine.step()
    assert first.tokens == solo(model32, turn1, 5) and first.prefix.tokens == turn1[:-1]
    kept = first.prefix
    turn2 = turn1 + [5, 6, 7] + first.tokens
    for _ in range(2):  # (twice from the same kept state)
        mate = engine.add(PROMPTS[0], max_tokens=6)
        second = engine.add(turn2, max_tokens=8, prefix=kept, keep_prefix=True)
        while engine.busy:
            engine.step()
        assert second.cached == len(turn1) - 1 and second.prefix.tokens == turn2[:-1]
        assert second.tokens == solo(model32, turn2, 8) and mate.tokens == solo(model32, PROMPTS[0], 6)
    other = engine.add([9, 9, 9], max_tokens=2, prefix=kept)  # not an extension of it: prefilled whole
    while engine.busy:
        engine.step()
    assert other.cached == 0 and other.tokens == solo(model32, [9, 9, 9], 2)


def test_a_seeded_batch_generate_repeats_whatever_max_batch_is(model32):
    """batch_generate(seed=): each prompt's own stream (seed + its index), so sampled results do not depend on how
    many decode together; another seed gives others."""
    kw = dict(max_tokens=[12, 7, 10, 5], temp=1.3, seed=11)
    one = [r.tokens for r in batch_generate(model32, None, PROMPTS[:4], max_batch=1, **kw)]
    assert [r.tokens for r in batch_generate(model32, None, PROMPTS[:4], max_batch=3, **kw)] == one
    assert [r.tokens for r in batch_generate(model32, None, PROMPTS[:4], max_batch=3, **{**kw, "seed": 12})] != one


def test_split_k_projections_keep_every_sequence_exact(monkeypatch):
    """Past the fused kernel's 8 rows, on a CUDA device, the 4-bit weights of few outputs and many inputs are split
    over K (q4_matmul.SplitK, made when a batch engine starts: batch.BatchDecoder._split_k). Made to apply here (a
    CUDA device stood in, the tiny shape's down projections qualifying): ten sequences' plain steps and four
    sequences' K = 2 rounds (12 verify rows) give every sequence its single generation's tokens, and the split path
    ran for them and not for the single generations' one-row steps. A weight update drops the layouts."""
    from lattice_mlx import batch as batch_module
    from lattice_mlx.bench.synthetic import random_model
    from lattice_mlx.metal import q4_matmul as q4_module
    from lattice_mlx.models.layers import Q4Linear
    from lattice_mlx.speculative.batched import BatchRounds

    model = random_model(bits=4, group_size=32, dtype=mx.float32)
    monkeypatch.setattr(q4_module, "SPLIT_K_MIN_K", 128)
    monkeypatch.setattr(batch_module, "cuda_gpu", lambda: True)
    monkeypatch.setattr(q4_module, "split_k_applies", lambda x, split: split is not None and
                        q4_module.MAX_ROWS < x.size // x.shape[-1] <= q4_module.SPLIT_K_MAX_ROWS)
    rows = []
    split_matmul = q4_module.split_k_matmul
    monkeypatch.setattr(q4_module, "split_k_matmul", lambda x, *a, **k: rows.append(x.shape[0]) or
                        split_matmul(x, *a, **k))
    prompts = [[(7 * i + j) % 300 + 1 for j in range(3 + i % 5)] for i in range(10)]
    budgets = [6 + i % 4 for i in range(10)]
    engine = BatchDecoder(model, max_batch=10)
    seqs = [engine.add(p, max_tokens=n) for p, n in zip(prompts, budgets)]
    splits = [m for _, m in model.named_modules() if isinstance(m, Q4Linear) and m.split_k is not None]
    assert len(splits) == model.args.num_hidden_layers  # every MLP's down projection (K = 128: 4 parts of 32)
    while engine.busy:
        engine.step()
    assert 10 in rows
    rounds = BatchRounds(model, k=2, max_batch=4)
    more = [rounds.add(p, max_tokens=n) for p, n in zip(prompts[:4], budgets)]
    while rounds.busy:
        rounds.step()
    assert 12 in rows
    rows.clear()
    for s, p in [*zip(seqs, prompts), *zip(more, prompts)]:
        assert s.tokens == solo(model, p, s.max_tokens), p
    assert not rows  # (one row a step)
    # weights changed through Model.update (load_weights, an optimizer): the layouts of the old weights are dropped,
    # with the traces holding them, so nothing computes with a stale copy
    assert model.runtime.traces
    model.update(model.parameters())
    assert not any(isinstance(m, Q4Linear) and m.split_k is not None for _, m in model.named_modules())
    assert not model.runtime.traces


def forward_rows(monkeypatch, model) -> list[tuple[int, int]]:
    """The [rows, tokens] of every forward of `model`'s decoder from now on (to the test's end, or monkeypatch.undo)."""
    inner = type(model.model)
    real = inner.__call__
    rows = []

    def counted(self, x, *a, **kw):
        rows.append(tuple(x.shape[:2]))
        return real(self, x, *a, **kw)

    monkeypatch.setattr(inner, "__call__", counted)
    return rows


@pytest.mark.parametrize("k", [0, 1, 3])
def test_prompts_prefilled_together_keep_every_sequence_exact(model32, monkeypatch, k):
    """LATTICE_BATCH_PREFILL: waiting prompts at the front of the queue run in one forward over their rows
    (batch.BatchDecoder._prefill_group; prompts of other lengths left-padded to the longest), each row then sampled
    and joined as its own prefill's would be. Plain steps (k = 0) and MTP rounds of depth k: every sequence keeps
    its single generation's greedy tokens, seeded sampled sequences the tokens they get with a forward each; fewer
    forwards run."""
    from lattice_mlx import settings
    from lattice_mlx.speculative.batched import BatchRounds

    rows = forward_rows(monkeypatch, model32)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(6)] for i in range(5)] + [[3, 4, 5], [9, 9, 9], [1, 2, 3, 4]]
    budgets = [7, 3, 9, 5, 6, 8, 4, 6]

    def run(on: bool, sampler=None) -> tuple[list[list[int]], list[tuple]]:
        rows.clear()
        with settings.override(batch_prefill=on):
            engine = BatchDecoder(model32, max_batch=6) if not k else BatchRounds(model32, k=k, max_batch=6)
            pending, seqs = list(zip(prompts, budgets)), []
            while pending or engine.busy:
                while pending and not engine.full:
                    p, n = pending.pop(0)
                    seqs.append(engine.add(p, max_tokens=n, sampler=sampler, seed=len(seqs)))
                engine.step()
        return [s.tokens for s in seqs], list(rows)

    got, forwards = run(True)
    for p, n, tokens in zip(prompts, budgets, got):
        assert tokens == solo(model32, p, n), p
    plain, alone = run(False)
    assert plain == got
    prefills = [r for r in forwards if r[1] > 1 + k]  # (prompt forwards: more rows than a step's or a round's)
    # the first six prompts wait together: five of length 6 and [3, 4, 5] (left-padded) in one forward; the last two
    # arrive one at a time as rows free; a forward per prompt without the setting
    assert prefills[0] == (6, 6) and len(prefills) < len([r for r in alone if r[1] > 1 + k])
    sampler = Sampler(temp=1.0)
    assert run(True, sampler)[0] == run(False, sampler)[0]


def test_a_prompt_group_leaves_out_what_needs_its_own_prefill(model32):
    """_group takes only prompts of one chunk from scratch, in queue order, within the step's budget of prompt
    tokens, padding at most a quarter of the forward; with the setting off, the first prompt alone."""
    from lattice_mlx import settings

    with settings.override(batch_prefill=True):
        engine = BatchDecoder(model32, max_batch=8, prefill_step=12)
        a = engine.add([1, 2, 3, 4], max_tokens=2)
        b = engine.add([5, 6, 7, 8], max_tokens=2)
        c = engine.add([9, 10, 11], max_tokens=2)  # another length: left-padded (1 pad of 12)
        engine.add([12, 13], max_tokens=2)  # over the budget of 12 prompt tokens
        assert [e[0] for e in engine._group(12)] == [a, b, c]
        assert [e[0] for e in engine._group(7)] == [a]  # (two prompts of 4 tokens are over 7)
        wide = BatchDecoder(model32, max_batch=8)
        d = wide.add(list(range(1, 9)), max_tokens=2)
        wide.add([1, 2], max_tokens=2)  # 6 pads of a 16-row forward: over a quarter
        assert [e[0] for e in wide._group(512)] == [d]
        long = BatchDecoder(model32, max_batch=8, prefill_step=4)
        first = long.add(list(range(1, 7)), max_tokens=2)  # two chunks
        long.add([1, 2, 3, 4], max_tokens=2)
        assert [e[0] for e in long._group(4)] == [first]
        kept = BatchDecoder(model32, max_batch=8)
        held = kept.add([1, 2, 3, 4], max_tokens=2, keep_prefix=True)
        kept.add([5, 6, 7, 8], max_tokens=2)
        assert [e[0] for e in kept._group(512)] == [held]  # (a prompt that keeps its prefix is prefilled alone)
    assert [e[0] for e in engine._group(12)] == [a, b, c]  # (on by default)
    with settings.override(batch_prefill=False):
        assert [e[0] for e in engine._group(12)] == [a]


@pytest.mark.parametrize("k", [0, 2])
def test_prompts_of_unequal_lengths_left_padded_into_one_forward_keep_their_own_tokens(model32, monkeypatch, k):
    """Prompts of 7 to 10 tokens waiting together run in one left-padded forward [4, 10]; each sequence's greedy
    tokens are its single generation's (plain steps and MTP rounds), its first token's logits its own prefill's (to
    float32 rounding: the padding lengthens the attention's sums), and a pad position's input reaches no GDN state."""
    from lattice_mlx import settings
    from lattice_mlx.decode import prefill
    from lattice_mlx.speculative.batched import BatchRounds

    rows = forward_rows(monkeypatch, model32)
    prompts = [[(5 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate([9, 7, 10, 8])]
    with settings.override(batch_prefill=True):
        engine = BatchDecoder(model32, max_batch=4) if not k else BatchRounds(model32, k=k, max_batch=4)
        seqs = [engine.add(p, max_tokens=6) for p in prompts]
        engine.step()
        assert rows[0] == (4, 10) and len(engine.active) == 4
        while engine.busy:
            engine.step()
    for s, p in zip(seqs, prompts):
        assert s.tokens == solo(model32, p, 6), p
    # the group's first logits against each prompt's own prefill, and the rows it joined
    monkeypatch.undo()
    from lattice_mlx.batch import _padded, row_of

    T, pads = 10, [10 - len(p) for p in prompts]
    cache = model32.make_cache(trimmable=False)
    mask = _padded(cache, pads, T)
    ids = mx.array([[0] * q + p for q, p in zip(pads, prompts)])
    h = model32.model(ids, cache, mask=mask)
    logits = model32.lm_logits(h[:, -1:], norm=model32.model.norm)[:, -1]
    for b, (p, q) in enumerate(zip(prompts, pads)):
        own = model32.make_cache(trimmable=False)
        want, _ = prefill(model32, mx.array(p), own)
        assert mx.allclose(logits[b], want.reshape(-1), atol=1e-4, rtol=1e-4), b
        for mine, theirs in zip(row_of(cache, b, q), own):
            assert mine.offset == theirs.offset == len(p)
            if hasattr(theirs, "keys"):  # attention: the row's keys and values from its first real token
                n = theirs.offset
                pairs = [(mine.keys[..., :n, :], theirs.keys[..., :n, :]), (mine.values[..., :n, :], theirs.values[..., :n, :])]
            else:  # GDN: the conv window and the state, no pad position in them
                pairs = [(mine.conv, theirs.conv), (mine.ssm, theirs.ssm)]
            for x, y in pairs:
                assert x.shape == y.shape and mx.allclose(x, y, atol=1e-4, rtol=1e-4), b
