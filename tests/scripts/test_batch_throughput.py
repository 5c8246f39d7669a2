"""scripts/bench/batch_throughput.py's record of one step's kernels in launch order: runs of one kernel collapsed,
and each copy kernel's neighbours counted (where batch run 7's copies sit)."""

import types

from conftest import load_script


def _module():
    return load_script("bench/batch_throughput.py")


def test_kernel_order_collapses_runs_and_counts_each_copys_neighbours():
    names = ["rms", "copy_v<float>", "void mlx::core::cu::copy_s<float>", "gdn_kernel", "qmm", "qmm",
             "void mlx::core::cu::copy_v<float>", "gdn_kernel", "memset"]  # (CUDA's names: `void mlx::core::cu::..`)
    # out of launch order in the list: the record sorts by start time
    events = [{"cat": "kernel", "name": n, "ts": 10.0 * i, "dur": 1.0 + i} for i, n in enumerate(names)][::-1]
    events.append({"cat": "memcpy", "name": "copy_v<float>", "ts": 5.0, "dur": 3.0})  # not a kernel: left out
    got = _module().kernel_order(types.SimpleNamespace(events=events))
    assert got["kernels"] == len(names)
    assert got["runs"][:5] == [["rms", 1, 1.0], ["copy_v<float>", 1, 2.0],
                               ["void mlx::core::cu::copy_s<float>", 1, 3.0], ["gdn_kernel", 1, 4.0],
                               ["qmm", 2, 11.0]]
    sites = got["copy_sites"]
    assert sites == {"copy_v<float> | before: rms | next: gdn_kernel": 1,
                     "copy_s<float> | before: copy_v<float> | next: gdn_kernel": 1,
                     "copy_v<float> | before: qmm | next: gdn_kernel": 1}


def test_the_machine_warm_up_runs_every_kind_of_pass_the_adaptive_batch_engine_runs():
    """warm_kinds drives the adaptive batch engine through the single generation's warm-up schedule: every depth as
    the first pass, plain steps before and after each depth, and every change between two depths are dispatched."""
    from lattice_mlx.bench.oracles import ForcedBatchRounds
    from lattice_mlx.bench.run import load_target
    from lattice_mlx.speculative.pipelined import warm_passes

    mod = _module()
    target = load_target("tiny", bits=4, group_size=32, dtype="float32", seed=0, stock=False)
    dispatched, real = [], ForcedBatchRounds._dispatch_pass

    def spy(self, k):
        dispatched.append(k)
        return real(self, k)

    ForcedBatchRounds._dispatch_pass = spy
    try:
        passes = mod.warm_kinds(target, 2, 0.8, k_max=3)
    finally:
        ForcedBatchRounds._dispatch_pass = real
    schedules = warm_passes(3)
    assert passes == sum(len(s) + 2 for s in schedules)
    pairs = {(a, b) for a, b in zip(dispatched, dispatched[1:])}
    want = {(a, b) for s in schedules for a, b in zip(s, s[1:])}
    assert want <= pairs, want - pairs
    for s in schedules:  # each schedule's depths in order, as a contiguous run of the dispatched passes
        assert any(dispatched[i:i + len(s)] == s for i in range(len(dispatched))), s


def test_the_host_split_times_every_pass_and_leaves_the_engine_as_it_was():
    """host_split parts a batch engine's passes into building, MLX's dispatch, waiting and the rest: they add up to
    the wall time, a pass hands MLX its graph (dispatch > 0) and a round's tokens are waited for; the engine's
    methods and mx.async_eval are its own again afterwards, and its tokens are those of an engine never timed."""
    import mlx.core as mx

    from lattice_mlx.batch import BatchDecoder
    from lattice_mlx.bench.oracles import ForcedBatchRounds
    from lattice_mlx.bench.run import load_target

    mod = _module()
    target = load_target("tiny", bits=4, group_size=32, dtype="float32", seed=0, stock=False)
    prompts = [[3, 5, 7, 9], [11, 2, 4]]
    for make, keys in ((lambda: BatchDecoder(target.model, max_batch=2), ("build", "dispatch")),
                       (lambda: ForcedBatchRounds(target.model, k=2, p_correct=0.8, max_batch=2),
                        ("build", "dispatch", "wait"))):
        tokens = []
        for timed in (True, False):
            mx.random.seed(1)
            engine = make()
            seqs = [engine.add(p, max_tokens=40) for p in prompts]
            mod.joined(engine)
            if timed:
                before = dict(vars(engine))
                got = mod.host_split(engine, 4)
                assert set(vars(engine)) == set(before)  # (no timing wrapper left on the instance)
                assert mx.async_eval.__name__ == "async_eval"
                assert got["passes"] == 4
                assert all(got[k] > 0 for k in keys), got
                parts = got["build"] + got["dispatch"] + got["wait"] + got["rest"]
                assert abs(parts - got["wall"]) < 1e-2 and got["rest"] >= -1e-3, got
            while engine.busy:
                engine.step()
            tokens.append([s.tokens for s in seqs])
        assert tokens[0] == tokens[1]


def test_the_timeline_puts_every_pass_of_a_generation_in_one_phase():
    """batch_throughput.timeline: a whole generation pass by pass; every pass and token counted once, prefills while
    prompts wait, a pass after a join marked, steady passes at the full batch and a tail once sequences leave."""
    from lattice_mlx.batch import BatchDecoder
    from lattice_mlx.bench.oracles import ForcedBatchRounds
    from lattice_mlx.bench.run import load_target

    mod = _module()
    target = load_target("tiny", bits=4, group_size=32, dtype="float32", seed=0, stock=False)
    prompts = [[3 + i, 5, 7, 11 + i] for i in range(3)]
    steps = []
    real = BatchDecoder.step

    def counted(self):
        steps.append(1)
        return real(self)

    BatchDecoder.step = counted
    try:
        got = mod.timeline(BatchDecoder(target.model, max_batch=3, prefill_step=4), prompts, 8)
    finally:
        BatchDecoder.step = real
    phases = {p: got[p] for p in ("prefill", "after_join", "steady", "tail")}
    assert sum(c for c, _, _ in phases.values()) == len(steps)
    assert sum(t for _, _, t in phases.values()) == 3 * 8
    # one prompt per step (prefill_step = its length): three prefill passes, each joining one sequence (its first
    # token, then a step's in the same pass); the pass after the last join, one steady pass, and the first sequence
    # leaves (8 tokens after 5 passes): four passes of tail
    assert [phases[p][0] for p in ("prefill", "after_join", "steady", "tail")] == [3, 1, 1, 4], got
    assert got["total_ms"] >= sum(ms for _, ms, _ in phases.values())
    # MTP rounds at forced acceptance: sequences finish at different rounds, so a tail
    rounds = ForcedBatchRounds(target.model, k=3, p_correct=0.5, max_batch=3, seed=1)
    got = mod.timeline(rounds, prompts, 12)
    assert sum(got[p][2] for p in ("prefill", "after_join", "steady", "tail")) == 3 * 12


def test_host_top_lists_the_engines_own_calls_costliest_first():
    from lattice_mlx.batch import BatchDecoder
    from lattice_mlx.bench.run import load_target

    mod = _module()
    target = load_target("tiny", bits=4, group_size=32, dtype="float32", seed=0, stock=False)
    engine = BatchDecoder(target.model, max_batch=2)
    for ids in ([3, 5, 7], [11, 13]):
        engine.add(ids, max_tokens=40)
    mod.joined(engine)
    before = [len(s.tokens) for s in engine.active]
    top = mod.host_top(engine, 4, top=5)
    assert [len(s.tokens) for s in engine.active] == [b + 4 for b in before]  # (four passes ran)
    assert len(top) == 5 and all(isinstance(w, str) and calls > 0 and ms >= 0 for w, calls, ms in top)
    assert [ms for _, _, ms in top] == sorted((ms for _, _, ms in top), reverse=True)
    assert any("step" in w for w, _, _ in top) or any("_dispatch" in w for w, _, _ in top), top
