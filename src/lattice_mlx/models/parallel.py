"""One forward on several processes: pipeline stages (each process runs its range of layers and hands the hidden on)
and the rank hand-offs; tensor parallelism is Model.shard (qwen3_5.py)."""

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import settings
from .compiled import run_layers


class SkipLayer(nn.Module):
    """Stands in for a decoder layer another pipeline stage runs (Model.pipeline): no weights, never called."""

    def __init__(self, is_linear: bool):
        super().__init__()
        self.is_linear = is_linear


@dataclass(frozen=True)
class Pipe:
    """This process's stage: layers [start, end) of a pipeline over `group` (rank size-1 runs the first layers,
    rank 0 the last, as mlx-lm's PipelineMixin orders them). `transport`: how a stage's hidden reaches the next one:
    "sendrecv" (mx.distributed.send / recv_like, what mlx-lm uses) or "collective" (all_sum with zeros from every
    rank but the sender: MLX 0.32's NCCL backend has no Send/Recv; chosen for the whole CUDA
    backend, so a ring or MPI group on a CUDA machine takes it too, which is exact there as well)."""

    group: Any
    rank: int
    size: int
    start: int
    end: int
    transport: str = "sendrecv"


PIPELINE_TRANSPORTS = ("sendrecv", "collective")


def default_pipeline_transport() -> str:
    """LATTICE_PIPELINE_TRANSPORT if set, else "collective" on MLX's CUDA backend (NCCL: no send/recv) and
    "sendrecv" elsewhere (ring, JACCL, MPI)."""
    return settings.raw("pipeline_transport") or ("collective" if mx.cuda.is_available() else "sendrecv")


_NEVER = mx.array(False)


def from_rank(x: mx.array, src: int, group) -> mx.array:
    """Rank `src`'s x on every rank of `group`, as one all_sum to which the other ranks add zeros (x + 0 is exact).
    Every rank's term depends on its own x, so the graph, and the order of its collectives, is the same on all
    ranks: a bare zeros term could run this all_sum before an earlier collective of x's graph on those ranks."""
    term = x if group.rank() == src else mx.where(_NEVER, x, 0)
    return mx.distributed.all_sum(term, group=group)


def split_stages(model, group=None, split: list[int] | None = None, transport: str | None = None) -> set[str]:
    """Model.pipeline's work (see there): this process keeps its stage's decoder layers, the others become
    SkipLayers. Returns the parameter names this rank no longer holds."""
    group = group or mx.distributed.init()
    N, rank = group.size(), group.rank()
    n = len(model.layers)
    if split is None:
        base, extra = divmod(n, N)
        split = [base + (1 if r < extra else 0) for r in range(N)]
    if len(split) != N or any(s <= 0 for s in split) or sum(split) != n:
        raise ValueError(f"cannot split {n} layers over {N} pipeline ranks as {split}: every rank needs at least "
                         f"one layer and the counts must add up to {n}")
    if model.sharding_group is not None:
        raise ValueError("a model is either tensor-parallel (shard) or pipelined, not both")
    transport = transport or default_pipeline_transport()
    if transport not in PIPELINE_TRANSPORTS:
        raise ValueError(f"pipeline transport {transport!r}: use one of {', '.join(PIPELINE_TRANSPORTS)}")
    start = sum(split[rank + 1 :])
    end = start + split[rank]
    before = {k for k, _ in tree_flatten(model.parameters())}
    for i in [*range(start), *range(end, n)]:
        model.model.layers[i] = SkipLayer(model.model.layers[i].is_linear)
    model.model.pipe = Pipe(group, rank, N, start, end, transport)
    model.sharding_group = group
    return before - {k for k, _ in tree_flatten(model.parameters())}


def run_stages(text_model, p: Pipe, h: mx.array, cache: list | None, mask, tree, input_embeddings) -> mx.array:
    """A pipelined forward of `text_model`'s layers from hidden h: this stage's part, and the hand-offs."""
    # Pipeline: the previous stage's hidden in, this stage's layers, the hidden out to the next stage; then
    # every stage takes the last stage's (rank 0's) result, so logits, sampling and the MTP head run everywhere.
    own = cache[p.start : p.end] if cache is not None else None
    if p.transport == "collective":  # stages in order size-1 .. 0, each hand-off one all_sum over all ranks
        for stage in range(p.size - 1, -1, -1):
            if stage == p.rank:
                h = run_layers(text_model, text_model.layers[p.start : p.end], h, own, mask, tree, input_embeddings)
            h = from_rank(h, stage, p.group)  # the last one (stage 0) gives every rank the result
        return h
    if p.rank < p.size - 1:
        h = mx.distributed.recv_like(h, p.rank + 1, group=p.group)
    h = run_layers(text_model, text_model.layers[p.start : p.end], h, own, mask, tree, input_embeddings)
    if p.rank != 0:
        h = mx.distributed.send(h, p.rank - 1, group=p.group)
    return mx.distributed.all_gather(h, group=p.group)[: h.shape[0]]
