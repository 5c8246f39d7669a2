"""One process: the demo (its own MTP head), lattice_mlx.batch_generate greedy over 4 prompts, MTP K=3 fixed, then
plain; each timed whole after one untimed run. Prints JSON."""
import json, sys, time
import mlx.core as mx
import lattice_mlx

from lattice_mlx.speculative.options import SpecOptions
model, tok = lattice_mlx.load()
prompts = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time"]
spec = SpecOptions(draft_tokens=3, adaptive=False)
out = {"src": lattice_mlx.__file__}
for name, kw in (("mtp_k3", {"speculation": spec}), ("plain", {})):
    lattice_mlx.batch_generate(model, tok, prompts, max_tokens=48, **kw)
    tic = time.perf_counter()
    res = lattice_mlx.batch_generate(model, tok, prompts, max_tokens=96, **kw)
    out[name] = time.perf_counter() - tic
    out[name + "_tokens"] = [r.tokens[:8] for r in res] if hasattr(res[0], "tokens") else None
print(json.dumps(out))
