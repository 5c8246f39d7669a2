"""One rank of tests/test_distributed.py, run under `mlx.launch -n N --backend ring`: the checkpoint loaded whole and
tensor-parallel in the same process, and what each computes written to OUT/rank{r}.json.

Usage: python tests/dist_worker.py CHECKPOINT OUT [pipeline | mtp-sharded-too]

pipeline: the stages hand their hidden on by send/recv (the CPU default), then the model is loaded again with the
all_sum hand-off (what MLX's CUDA backend gets) and checked too. mtp-sharded-too: tensor parallel as usual, then
loaded again with the MTP head's layer sharded and checked too.
"""

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from lattice_mlx import SpecOptions, generate, load
from lattice_mlx.load import LoadError

PROMPT = [5, 9, 2, 7, 11, 3, 8, 1, 6, 4, 10, 12]


def tokens(model, tok, *, k: int | None = None, temp: float = 0.0, seed: int = 0, n: int = 12) -> list[int]:
    mx.random.seed(seed)
    spec = SpecOptions(draft_tokens=k, adaptive=False) if k else None
    return generate(model, tok, PROMPT, max_tokens=n, temp=temp, speculation=spec).tokens


def head_check(whole, sharded, ids: mx.array, name: str) -> dict:
    """The MTP head's output on the same inputs, whole vs sharded (relative), and its parameters on this rank."""
    hw = whole(ids, return_hidden=True)[1]
    emb = whole.model.embed_tokens(ids[:, 1:])
    mw = whole.mtp(emb, whole.mtp.from_target(hw[:, :-1]))
    ms = sharded.mtp(emb, sharded.mtp.from_target(hw[:, :-1]))
    return {f"{name}_rel_diff": mx.abs(mw - ms).max().item() / mx.abs(mw).max().item(),
            f"{name}_params": sum(v.size for _, v in tree_flatten(sharded.mtp.parameters())),
            "whole_mtp_params": sum(v.size for _, v in tree_flatten(whole.mtp.parameters()))}


def main() -> int:
    ckpt, out = sys.argv[1], Path(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else ""
    pipeline = mode == "pipeline"
    group = mx.distributed.init()
    rank = group.rank()
    res = {"rank": rank, "size": group.size()}
    mx.reset_peak_memory()
    try:
        sharded, tok = load(ckpt, group=group, pipeline=pipeline)
        res["load_peak_bytes"] = mx.get_peak_memory()
    except LoadError as e:
        res["load_error"] = str(e)
        (out / f"rank{rank}.json").write_text(json.dumps(res))
        return 0
    whole, _ = load(ckpt)
    res["whole_bytes"] = sum(v.nbytes for _, v in tree_flatten(whole.parameters()))
    ids = mx.array([PROMPT])
    a, b = whole(ids), sharded(ids)
    res["max_logit_diff"] = mx.abs(a - b).max().item()
    res["max_logit"] = mx.abs(a).max().item()
    if pipeline:
        res["transport"] = sharded.model.pipe.transport
        os.environ["LATTICE_PIPELINE_TRANSPORT"] = "collective"  # the hand-off MLX's CUDA backend gets
        other, _ = load(ckpt, group=group, pipeline=True)
        res["collective_transport"] = other.model.pipe.transport
        res["collective_max_logit_diff"] = mx.abs(a - other(ids)).max().item()
        res["collective_greedy_k3"] = tokens(other, tok, k=3) == tokens(whole, tok, k=3)
        res["held_layers"] = sum(not type(layer).__name__ == "SkipLayer" for layer in sharded.layers)
        res["held_params"] = sum(v.size for _, v in tree_flatten(sharded.parameters()))
        res["whole_params"] = sum(v.size for _, v in tree_flatten(whole.parameters()))
    else:
        # each layer on the same input, whole vs sharded: only the order of the partial sums differs
        h, worst = whole.model.embed_tokens(ids), 0.0
        for lw, ls in zip(whole.layers, sharded.layers):
            hw, hs = lw(h), ls(h)
            worst = max(worst, mx.abs(hw - hs).max().item() / mx.abs(hw).max().item())
            h = hw
        res["worst_layer_rel_diff"] = worst
        res.update(head_check(whole, sharded, ids, "mtp"))
        if mode == "mtp-sharded-too":  # the MTP head's layer split over the ranks as well
            split, _ = load(ckpt, group=group, mtp="sharded")
            res.update(head_check(whole, split, ids, "mtp_sharded"))
            res["mtp_sharded_greedy_k3"] = tokens(split, tok, k=3) == tokens(whole, tok, k=3)
            res["mtp_sharded_sampled_equal"] = tokens(split, tok, k=3, temp=1.0, seed=7 + 1000 * rank) == \
                tokens(whole, tok, k=3, temp=1.0, seed=7)
    for k in (None, 3):
        name = f"greedy_k{k or 0}"
        res[name] = tokens(sharded, tok, k=k) == tokens(whole, tok, k=k)
    # sampled MTP: rank 0 seeded as the one-process run; the other ranks seeded differently on purpose, so only the
    # agreement on rank 0's tokens and verdicts can keep them in step
    want = tokens(whole, tok, k=3, temp=1.0, seed=7)
    got = tokens(sharded, tok, k=3, temp=1.0, seed=7 + 1000 * rank)
    res["sampled_equal_one_process"] = got == want
    res["sampled_tokens"] = got
    res["plain_sampled_equal"] = tokens(sharded, tok, temp=1.0, seed=3 + 1000 * rank) == tokens(whole, tok, temp=1.0,
                                                                                                  seed=3)
    # adaptive K (the default): the depth tuner reads each rank's own clock, jittered here on the ranks other than 0;
    # rank 0's choices must rule, or the ranks run different rounds and their collectives never meet
    import random
    import types

    from lattice_mlx.speculative import chain as speculative

    clock = speculative.time
    if rank:
        rng, real = random.Random(rank), clock.perf_counter
        speculative.time = types.SimpleNamespace(perf_counter=lambda: real() + rng.random() * 0.01)
    try:
        got = generate(sharded, tok, PROMPT, max_tokens=48, speculation=SpecOptions(draft_tokens=3)).tokens
    finally:
        speculative.time = clock
    res["adaptive_equal_plain"] = got == generate(whole, tok, PROMPT, max_tokens=48).tokens
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
