"""What a process keeps on a model while it runs it, beside its weights: one typed attribute, `model.runtime`, that
goes with the model (nothing is keyed by id() in module globals)."""

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(eq=False)
class Runtime:
    traces: dict[str, dict] = field(default_factory=dict)  # kind ("steps", "rounds") -> key -> (trace, slot)
    tuner: dict = field(default_factory=dict)  # greedy? -> what the pipelined tuners measured; "batch": batch size
    # bucket -> what the batched rounds' tuners measured (speculative/batched.py)
    # what the batched rounds replayed from a trace in this process (engine class, K, sampler structure, kernel
    # policy, batch-size bucket): a depth's first passes at a bucket are not its cost (speculative/batched.py)
    batch_sizes: set = field(default_factory=set)
    hidden_tap: Any = None  # lattice_mlx.make_draft_model's tap: the model publishes each forward's hidden to it
    compiled: Any = None  # models/compiled.CompiledLayers of a TextModel or MTP head, built on first use
    round_builds: bool = False  # load.keep_round_builds checked this model's once-per-machine builds in this process
    rounds_run: bool = False  # this process ran pipelined rounds of the model (or warmed them): their first uses paid


def runtime_of(model) -> Runtime:
    """`model.runtime`, made on first use for an object that has none (Model makes its own)."""
    rt = getattr(model, "runtime", None)
    if rt is None:
        rt = Runtime()
        object.__setattr__(model, "runtime", rt)
    return rt


PACKAGE = Path(__file__).resolve().parent


def source_digest(root: Path = PACKAGE) -> str:
    """sha256 over the package's files as they are on disk when the run starts (relative path and bytes, in path
    order, caches left out): names the code that ran even where there is no git, or the tree was dirty."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                       and p.suffix not in {".pyc", ".so", ".o"}):
        rel = path.relative_to(root).as_posix().encode()
        h.update(len(rel).to_bytes(4, "little") + rel)
        data = path.read_bytes()
        h.update(len(data).to_bytes(8, "little") + data)
    return "sha256:" + h.hexdigest()
