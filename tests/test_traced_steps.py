"""Traced plain steps (decode.TracedSteps): one mx.compile trace per model and sampler, replayed every step, gives
the tokens of steps built op by op (greedy and, under one seed, sampled), across a KV buffer growth, with weights
changed after tracing, and after a trace that failed."""

import gc
import weakref

import mlx.core as mx
import pytest

from lattice_mlx import cache as caches
from lattice_mlx import decode, load
from lattice_mlx.decode import generate_step
from lattice_mlx.sample import Sampler
from lattice_mlx.speculative import pipelined as rounds

PROMPT = [3, 3, 3, 3, 17, 17, 2, 8, 64, 128, 256, 12, 13]


def tokens(model, n, *, prompt=PROMPT, sampler=None, **kw):
    return [t for t, _ in zip(generate_step(model, mx.array(prompt), sampler=sampler or Sampler(), **kw), range(n))]


def traces(model) -> dict:
    return model.runtime.traces.get("steps", {})


@pytest.mark.parametrize("name", ["pattern", "tied"])
def test_traced_steps_replay_one_trace_and_give_the_tokens_of_steps_built_op_by_op(checkpoints, monkeypatch, name):
    """Greedy, 90 tokens across a KV buffer growth (GROW = 64: a new shape, one more trace), then a second
    generation that replays the traces; the step's Python runs only while MLX traces it."""
    model, _ = load(checkpoints[name])
    monkeypatch.setattr(caches.FixedKVCache, "GROW", 64)
    with decode.tracing(False):
        eager = tokens(model, 90)
    assert not traces(model)
    calls = []
    forward = type(model).__call__

    def counting(self, *a, **kw):
        calls.append(a[0].shape)
        return forward(self, *a, **kw)

    monkeypatch.setattr(type(model), "__call__", counting)
    assert tokens(model, 90) == eager
    assert len(traces(model)) == 1  # one sampler, one kernels setting
    # the forward ran in Python twice (the trace at capacity 64, then at 128), not once per step
    assert len(calls) == 2, calls
    assert tokens(model, 90) == eager and len(calls) == 2


def test_sampled_traced_steps_draw_what_steps_built_op_by_op_draw(checkpoints):
    """The PRNG key goes in and out of the trace: under one seed, the traced loop draws the very same tokens."""
    model, _ = load(checkpoints["pattern"])
    sampler = Sampler(temp=0.9, top_p=0.9)
    out = {}
    for on in (False, True, True):
        mx.random.seed(4)
        with decode.tracing(on):
            out.setdefault(on, []).append(tokens(model, 60, sampler=sampler))
    assert out[False][0] == out[True][0] == out[True][1]
    assert len(set(out[True][0])) > 5  # sampled, not stuck on one token


def test_one_trace_serves_every_temperature_top_p_and_min_p(checkpoints):
    """The sampler's numbers are inputs of the step's trace, not constants: samplers that differ only in them share
    one trace, and each draws under its seed the tokens of steps built op by op."""
    model, _ = load(checkpoints["pattern"])
    for sampler in (Sampler(temp=0.7, top_p=0.9, min_p=0.05), Sampler(temp=1.3, top_p=0.5, min_p=0.2),
                    Sampler(temp=0.2, top_p=0.95, min_p=0.01)):
        mx.random.seed(8)
        with decode.tracing(False):
            eager = tokens(model, 40, sampler=sampler)
        mx.random.seed(8)
        assert tokens(model, 40, sampler=sampler) == eager, sampler
    assert len(traces(model)) == 1
    tokens(model, 5, sampler=Sampler(temp=0.7))  # no top-p / min-p filter: another graph, another trace
    tokens(model, 5, sampler=Sampler(temp=0.7, top_k=5))
    assert len(traces(model)) == 3


def test_traced_steps_follow_the_switch_and_skip_what_they_cannot_trace(checkpoints, monkeypatch):
    model, _ = load(checkpoints["pattern"])
    monkeypatch.setenv("LATTICE_TRACE_STEPS", "0")
    tokens(model, 5)
    assert not traces(model)
    monkeypatch.setenv("LATTICE_TRACE_STEPS", "1")
    # a cache the caller passes (updated in place), logits processors and a sliding window take the op-by-op step
    tokens(model, 5, cache=model.make_cache(trimmable=False))
    tokens(model, 5, logits_processors=[lambda history, logits: logits])
    tokens(model, 5, max_kv_size=8)
    assert not traces(model)
    tokens(model, 5)
    assert len(traces(model)) == 1
    monkeypatch.setenv("LATTICE_TRACE_STEPS", "yes")
    with pytest.raises(ValueError, match="LATTICE_TRACE_STEPS"):
        decode.tracing_enabled()


def test_traced_steps_see_replaced_and_edited_weights(checkpoints):
    """The weights are captured inputs read at every replay: a replaced weight, or one changed in place, is what the
    next step computes with."""
    model, _ = load(checkpoints["pattern"])
    first = tokens(model, 30)
    norm = model.model.norm
    norm.weight = norm.weight * -1.5
    second = tokens(model, 30)
    with decode.tracing(False):
        assert second == tokens(model, 30) != first
    w = norm.weight
    w *= -0.5
    third = tokens(model, 30)
    with decode.tracing(False):
        assert third == tokens(model, 30) != second
    assert len(traces(model)) == 1


def test_a_failing_step_trace_is_dropped_and_leaves_the_prng_usable(checkpoints):
    """The step raises after its sampler drew from the PRNG key (a captured input and output of the trace): the key
    must be a real array again afterwards, usable without reseeding, and the trace dropped."""
    model, _ = load(checkpoints["pattern"])

    class Failing(Sampler):
        def __call__(self, logits):
            y = super().__call__(logits)
            if any(slot.owner is not None for _, slot in traces(model).values()):
                raise RuntimeError("planted")
            return y

    with pytest.raises(RuntimeError, match="planted"):
        tokens(model, 5, sampler=Failing(temp=1.0))
    assert not traces(model)
    mx.eval(mx.random.uniform(shape=(3,)))  # no reseeding: a key left as a placeholder fails here
    mx.random.seed(3)
    with decode.tracing(False):
        eager = tokens(model, 12, sampler=Sampler(temp=1.0))
    mx.random.seed(3)
    assert tokens(model, 12, sampler=Sampler(temp=1.0)) == eager


@pytest.mark.parametrize("loop", ["plain", "pipelined"])
def test_the_prefill_caches_are_not_held_for_the_generation(checkpoints, monkeypatch, loop):
    """The traced step (and a pipelined round) copies the prefill's attention rows into its own buffers: the
    prefill's cache objects must go, not stay alive beside them for the whole generation (twice the KV memory)."""
    model, _ = load(checkpoints["pattern"])
    module = decode if loop == "plain" else rounds
    real, made = module.resume, []

    def spy(*a, **kw):
        out = real(*a, **kw)
        made.extend(weakref.ref(c) for c in out[0] if type(c) is caches.KVCache)
        return out

    monkeypatch.setattr(module, "resume", spy)
    if loop == "plain":
        gen = generate_step(model, mx.array(PROMPT), sampler=Sampler())
    else:
        from lattice_mlx.speculative import SpecOptions, SpecStats, speculate

        options = SpecOptions(draft_tokens=2, verify="pipelined", adaptive=False)
        gen = speculate(model, mx.array(PROMPT), sampler=Sampler(), options=options,
                               stats=SpecStats.of(options))
    for _ in range(6):
        next(gen)
    gc.collect()
    assert made and all(r() is None for r in made)


def test_tracing_is_on_by_default_on_a_gpu_and_off_on_the_cpu(monkeypatch):
    """Unset, the three tracing switches follow the backend: a first replay on MLX's CPU backend compiles C++ (tens of
    seconds on a fresh machine) for no warm gain, so they are off there; on a GPU they are on."""
    from types import SimpleNamespace

    from lattice_mlx import settings

    for variable in ("LATTICE_COMPILE", "LATTICE_TRACE_STEPS", "LATTICE_TRACE_ROUNDS"):
        monkeypatch.delenv(variable, raising=False)
    names = ("compile", "trace_steps", "trace_rounds")
    monkeypatch.setattr(mx, "default_device", lambda: SimpleNamespace(type=mx.DeviceType.cpu))
    assert [settings.on(n) for n in names] == [False] * 3
    monkeypatch.setattr(mx, "default_device", lambda: SimpleNamespace(type=mx.DeviceType.gpu))
    assert [settings.on(n) for n in names] == [True] * 3
    monkeypatch.setenv("LATTICE_TRACE_STEPS", "0")
    assert [settings.on(n) for n in names] == [True, False, True]
    assert settings.current().compile == settings.GPU_ONLY
